"""Scaling ops: choose, read, drop and move the scale of a value.

Each op is a JAX primitive with the identity (or a cast) as its meaning outside `scalify`,
so a model that calls them runs unchanged without the transform; inside `scalify` its scale
rule acts on the `(data, scale)` representation:

| op | inside scalify | outside |
|---|---|---|
| `set_scaling(x, s)` | scale s, data `x.data * (x.scale / s)` | x |
| `get_data_scale(x)` | `(x.data, x.scale)` as plain arrays | `(x, 1.0)` |
| `stop_scaling(x, dtype)` | the unscaled value `data * scale` in `dtype` | `x.astype(dtype)` |
| `rebalance(x, f)` | data `x.data * f`, scale `x.scale / f` | x |

`merge_scale(x, scale_shape)` (a function on a ScaledArray, not a primitive) reduces a
scale to a coarser shape by its largest value, the data rescaled: e.g. the per-layer scales
of parameters stacked by `nn.scan` into one (`get_data_scale(..., merge=True)` inside
scalify).

`set_scaling`, `get_data_scale` and `rebalance` also act on unscaled inputs inside
scalify (they make them scaled, with scale 1 before the change). Called eagerly on a
`ScaledArray` outside scalify, each op applies its scale rule.

Autodiff: every op is the identity on values (a cast for `stop_scaling`), so its derivative
is the identity (a cast). In particular `set_scaling` does not rescale gradients: under
`scalify(jax.grad(f))` the cotangent keeps the scale the backward rules give it. To choose
the scale of a gradient use `dynamic_rescale_*_grad` (`scalify.ops.rescale`). The derivative
of `get_data_scale` is that of its meaning outside scalify: `data` carries the tangent of
`x`, `scale` none.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad, batching

from scalify.core.config import get_config
from scalify.core.errors import ScaleError
from scalify.core.scaled_array import ScaledArray, compute_dtype
from scalify.core.registry import register_scale_rule
from scalify.ops._common import (
    as_scale_operand,
    batch_scale_operand,
    check_broadcasts,
    check_float,
    check_pow2,
    define_primitive,
    has_scaled,
    requested_scale,
    scalified,
)
from scalify.rules.common import materialize, rescale

__all__ = [
    "set_scaling",
    "get_data_scale",
    "stop_scaling",
    "as_scaled_value",
    "rebalance",
    "merge_scale",
    "set_scaling_p",
    "get_data_scale_p",
    "stop_scaling_p",
    "as_scaled_value_p",
    "rebalance_p",
]


def _same_aval(x):
    return jax.core.ShapedArray(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False))


def _with_operand_aval(op):
    def abstract_eval(x, s, **_):
        check_broadcasts(s.shape, x.shape, op)
        return _same_aval(x)

    return abstract_eval


def _batch_with_operand(prim):
    """Batching of `prim(x, s)` where `s` is a scale-like operand that broadcasts to `x`."""

    def rule(args, dims, **params):
        (x, s), (bx, bs) = args, dims
        size = x.shape[bx] if bx is not None else s.shape[bs]
        x = batching.bdim_at_front(x, bx, size)
        s = batch_scale_operand(s, bs, x.ndim - 1, size)
        return prim.bind(x, s, **params), 0

    return rule


# ---------------------------------------------------------------------------------------
# set_scaling
# ---------------------------------------------------------------------------------------
set_scaling_p = define_primitive(
    "set_scaling", lambda x, s: x, _with_operand_aval("set_scaling")
)
ad.defjvp(set_scaling_p, lambda g, x, s: g, None)
batching.primitive_batchers[set_scaling_p] = _batch_with_operand(set_scaling_p)


def set_scaling(x, scale):
    """Represent `x` with the power-of-two `scale` (inside scalify); the identity outside.

    Inside scalify the result is `ScaledArray(x.data * (x.scale / scale), scale)`: the value
    is unchanged and exact unless the new data under- or overflows its dtype. An unscaled `x`
    becomes scaled. A traced `scale` that is not a power of two is rounded (value unchanged);
    a traced 0, inf or nan keeps x's scale. The gradient is the identity.

    Args:
      x: a floating-point array (or ScaledArray).
      scale: a positive power of two, scalar or of a shape that broadcasts to `x`.
    Returns:
      x, with scale `scale` inside scalify.
    Raises:
      ScaleError: `x` is not floating point, or a concrete `scale` is not a power of two.
    """
    check_float(x, "set_scaling")
    check_pow2(scale, "scale", "set_scaling")
    scale = as_scale_operand(scale, "set_scaling")
    check_broadcasts(jnp.shape(scale), jnp.shape(x), "set_scaling")
    if has_scaled(x, scale):
        return scalified(set_scaling)(x, scale)
    return set_scaling_p.bind(jnp.asarray(x), scale)


@register_scale_rule(set_scaling_p, always=True)
def _set_scaling_rule(x: ScaledArray, scale: ScaledArray):
    """set_scaling(x, s): output scale s; data x.data * (x.scale / s) (a power-of-two ratio)."""
    s = requested_scale(scale, x.scale)
    return ScaledArray(rescale(x, s), s)


# ---------------------------------------------------------------------------------------
# get_data_scale
# ---------------------------------------------------------------------------------------
def _gds_impl(x, *, scale_shape, scale_dtype, merge):
    return [x, jnp.ones(scale_shape, scale_dtype)]


def _gds_abstract_eval(x, *, scale_shape, scale_dtype, merge):
    check_broadcasts(scale_shape, x.shape, "get_data_scale", "scale_shape")
    return [_same_aval(x), jax.core.ShapedArray(scale_shape, scale_dtype)]


get_data_scale_p = define_primitive(
    "get_data_scale", _gds_impl, _gds_abstract_eval, multiple_results=True
)


def _gds_jvp(primals, tangents, *, scale_shape, scale_dtype, merge):
    (x,), (t,) = primals, tangents
    outs = get_data_scale_p.bind(x, scale_shape=scale_shape, scale_dtype=scale_dtype, merge=merge)
    zero = ad.Zero(jax.core.ShapedArray(scale_shape, scale_dtype).to_tangent_aval())
    return outs, [t, zero]


def _gds_batch(args, dims, *, scale_shape, scale_dtype, merge):
    (x,), (bx,) = args, dims
    x = jnp.moveaxis(x, bx, 0)
    nd = x.ndim - 1
    shape = (x.shape[0],) + (1,) * (nd - len(scale_shape)) + tuple(scale_shape)
    outs = get_data_scale_p.bind(x, scale_shape=shape, scale_dtype=scale_dtype, merge=merge)
    return outs, [0, 0]


ad.primitive_jvps[get_data_scale_p] = _gds_jvp
batching.primitive_batchers[get_data_scale_p] = _gds_batch


def get_data_scale(x, scale_shape=(), *, merge=False):
    """Split `x` into `(data, scale)` plain arrays: inside scalify its representation,
    outside `(x, 1.0)`.

    Args:
      x: a floating-point array (or ScaledArray).
      scale_shape: shape of the returned scale (default scalar); it must broadcast to x.
        Inside scalify the actual scale is broadcast to it (a per-row scale needs e.g.
        `scale_shape=(n, 1)`).
      merge: a scale that varies where `scale_shape` does not (e.g. the per-layer scales
        of parameters stacked by `nn.scan`, with the default scalar `scale_shape`) is
        merged to its largest value there, the data multiplied by the power of two
        `scale / largest <= 1` (exact unless a value falls below the data dtype's range);
        without it, such a scale is an error.
    Returns:
      `(data, scale)`: data of x's dtype and shape, scale of the configured scale dtype.
    Raises:
      ScaleError: `x` is not floating point, or its scale does not fit `scale_shape` (and
        `merge` is off).
    """
    check_float(x, "get_data_scale")
    scale_shape = tuple(int(d) for d in scale_shape)
    check_broadcasts(scale_shape, jnp.shape(x), "get_data_scale", "scale_shape")
    if isinstance(x, ScaledArray):
        return tuple(scalified(functools.partial(get_data_scale, merge=merge))(x, scale_shape))
    data, scale = get_data_scale_p.bind(
        jnp.asarray(x), scale_shape=scale_shape, scale_dtype=get_config().scale_dtype, merge=bool(merge)
    )
    return data, scale


def merge_scale(x: ScaledArray, scale_shape=()) -> ScaledArray:
    """`x` with its scale reduced by max over the dims where `scale_shape` (aligned to the
    right of x's shape) is 1, e.g. the per-layer scales of parameters stacked by `nn.scan`
    merged into one: data * (scale / largest), a power of two <= 1 (exact unless a value
    falls below the data dtype's range). The same value; works inside and outside scalify."""
    s = jnp.asarray(x.scale)
    s = s.reshape((1,) * (x.ndim - s.ndim) + s.shape)
    target = (1,) * (x.ndim - len(scale_shape)) + tuple(scale_shape)
    axes = tuple(i for i, (a, b) in enumerate(zip(s.shape, target)) if a != 1 and b == 1)
    if not axes:
        return x
    largest = jnp.max(s, axis=axes, keepdims=True)
    cdt = compute_dtype(x.data.dtype)
    data = (x.data.astype(cdt) * (s / largest).astype(cdt)).astype(x.data.dtype)
    return ScaledArray(data, largest)


@register_scale_rule(get_data_scale_p, always=True)
def _get_data_scale_rule(x: ScaledArray, *, scale_shape, scale_dtype, merge):
    """get_data_scale(x): (x.data, x.scale) as plain arrays; scale broadcast to scale_shape
    (with `merge`, first reduced by max where it does not fit: `merge_scale`)."""
    if merge:
        x = merge_scale(x, scale_shape)
    s = jnp.asarray(x.scale)
    if s.size == 1:
        s = s.reshape(())
    try:
        s = jnp.broadcast_to(s, scale_shape)
    except ValueError:
        raise ScaleError(
            f"scalify.get_data_scale: the scale of this value has shape {s.shape}, which does not "
            f"fit scale_shape={scale_shape}. Pass `scale_shape={s.shape}` (or a shape it "
            "broadcasts to), or `merge=True` to merge it to its largest value."
        ) from None
    return [x.data, s.astype(scale_dtype)]


# ---------------------------------------------------------------------------------------
# stop_scaling
# ---------------------------------------------------------------------------------------
stop_scaling_p = define_primitive(
    "stop_scaling",
    lambda x, *, dtype: x.astype(dtype),
    lambda x, *, dtype: jax.core.ShapedArray(x.shape, dtype),
)
ad.defjvp(stop_scaling_p, lambda g, x, *, dtype: lax.convert_element_type(g, dtype))
batching.defvectorized(stop_scaling_p)


def stop_scaling(x, dtype=None):
    """The unscaled value of `x` (inside scalify: `data * scale`), cast to `dtype`.

    Outside scalify this is `x.astype(dtype)`. Inside, the product is computed in at least
    float32 and cast once, so only the final dtype's range matters.

    Args:
      x: a floating-point array (or ScaledArray).
      dtype: a floating-point dtype (default: x's dtype).
    Returns:
      A plain (unscaled) array of `dtype`. Its gradient is a cast back.
    """
    check_float(x, "stop_scaling")
    dtype = jnp.dtype(x.dtype if dtype is None else dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ScaleError(
            f"scalify.stop_scaling: dtype must be floating point, got {dtype}. Cast the result "
            "to an integer type afterwards if that is what you need."
        )
    if isinstance(x, ScaledArray):
        return scalified(stop_scaling)(x, dtype)
    return stop_scaling_p.bind(jnp.asarray(x), dtype=dtype)


@register_scale_rule(stop_scaling_p)
def _stop_scaling_rule(x: ScaledArray, *, dtype):
    """stop_scaling(x): unscaled output data*scale, computed in >= float32, cast to dtype."""
    return materialize(x, dtype)


# ---------------------------------------------------------------------------------------
# as_scaled_value
# ---------------------------------------------------------------------------------------
as_scaled_value_p = define_primitive("as_scaled_value", lambda x: x, lambda x: jax.core.ShapedArray(x.shape, x.dtype))
ad.defjvp(as_scaled_value_p, lambda g, x: g)
batching.defvectorized(as_scaled_value_p)


def as_scaled_value(x):
    """Inside scalify, `x` as a ScaledArray: an unscaled value at scale 1, a scaled one
    unchanged; the identity outside. The rules of the ops that follow (an FP8 cast and its
    drift guard) then run on it. The gradient is the identity."""
    check_float(x, "as_scaled_value")
    if isinstance(x, ScaledArray):
        return x
    return as_scaled_value_p.bind(jnp.asarray(x))


@register_scale_rule(as_scaled_value_p, always=True)
def _as_scaled_value_rule(x: ScaledArray):
    """as_scaled_value(x) = x (an unscaled input arrives promoted, at scale 1)."""
    return x


# ---------------------------------------------------------------------------------------
# rebalance
# ---------------------------------------------------------------------------------------
rebalance_p = define_primitive("rebalance", lambda x, f: x, _with_operand_aval("rebalance"))
ad.defjvp(rebalance_p, lambda g, x, f: g, None)
batching.primitive_batchers[rebalance_p] = _batch_with_operand(rebalance_p)


def rebalance(x, factor):
    """Move a power-of-two `factor` from the scale into the data (inside scalify).

    Inside scalify the result is `ScaledArray(x.data * factor, x.scale / factor)` (same value;
    exact unless the data under- or overflows its dtype); outside it is the identity. A traced
    `factor` that is not a power of two is rounded; a traced 0, inf or nan acts as 1.

    Args:
      x: a floating-point array (or ScaledArray).
      factor: a positive power of two, scalar or of a shape that broadcasts to `x`.
    Raises:
      ScaleError: `x` is not floating point, or a concrete `factor` is not a power of two.
    """
    check_float(x, "rebalance")
    check_pow2(factor, "factor", "rebalance")
    factor = as_scale_operand(factor, "rebalance", "factor")
    check_broadcasts(jnp.shape(factor), jnp.shape(x), "rebalance", "factor")
    if has_scaled(x, factor):
        return scalified(rebalance)(x, factor)
    return rebalance_p.bind(jnp.asarray(x), factor)


@register_scale_rule(rebalance_p, always=True)
def _rebalance_rule(x: ScaledArray, factor: ScaledArray):
    """rebalance(x, f): scale x.scale / f; data x.data * f (f a power of two: exact)."""
    f = requested_scale(factor, 1.0)
    cdt = compute_dtype(x.dtype)
    data = (x.data.astype(cdt) * f.astype(cdt)).astype(x.dtype)
    return ScaledArray(data, jnp.asarray(x.scale).astype(f.dtype) / f)
