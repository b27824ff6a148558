"""Small lax-level helpers: `jnp.where` / `jnp.clip` / `*` / `astype` equivalents that emit
plain lax ops, `widen`, the FP8-safe up-cast, and `bind_as_is`, a primitive bound with an
equation's params.

`jnp.where`, `jnp.clip` and the jnp operators (`x * y`, `jnp.maximum`, ...) are jitted
functions: each call traces a nested `jit` and inlines it. Scale rules call them on every
equation of a scalified step (tens of thousands of times for a GPT step), so their
per-call overhead adds up in the trace time. These helpers bind the lax primitive directly when the operands already agree (same dtype, same
shape or one of them a scalar) and fall back to the jnp function otherwise, so their
results (values, dtypes, shapes) are those of the jnp expressions they replace.

Static values: when every operand is a NumPy value (`is_static`: a scale known at trace
time, such as the unit scale of an unscaled input or a promoted constant's power of two),
`astype`, `add`, `sub`, `mul`, `div`, `maximum`, `minimum`, `select` and `clip` compute in
NumPy and return NumPy, so scale arithmetic on static scales adds no operation to the
traced program (inside `jax.jit` a `jnp` constant is a traced value; a NumPy one is not).
NumPy computes these IEEE operations as XLA does on normal numbers; scales are normal
powers of two.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def is_static(x) -> bool:
    """Whether `x` is a NumPy value (array or scalar): known at trace time, never traced."""
    return isinstance(x, (np.ndarray, np.generic))


def arr(x):
    """`jnp.asarray(x)`, skipping the call for jax arrays and tracers."""
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


def astype(x, dtype):
    """`jnp.asarray(x).astype(dtype)` as one `convert_element_type` (none if equal)."""
    dtype = np.dtype(dtype)
    if is_static(x):
        return x if x.dtype == dtype else np.asarray(x).astype(dtype)
    x = arr(x)
    return x if x.dtype == dtype else lax.convert_element_type(x, dtype)


def _binary(lax_op, jnp_op, np_op):
    def op(a, b):
        if is_static(a) and is_static(b) and a.dtype == b.dtype:
            with np.errstate(all="ignore"):
                return np.asarray(np_op(a, b), a.dtype)
        a, b = arr(a), arr(b)
        if a.dtype == b.dtype and (a.shape == b.shape or not a.ndim or not b.ndim) \
                and not (a.weak_type or b.weak_type):
            return lax_op(a, b)
        return jnp_op(a, b)

    op.__name__ = jnp_op.__name__
    op.__doc__ = f"`jnp.{jnp_op.__name__}(a, b)`, as `lax` when the operands already agree."
    return op


add = _binary(lax.add, jnp.add, np.add)
sub = _binary(lax.sub, jnp.subtract, np.subtract)
mul = _binary(lax.mul, jnp.multiply, np.multiply)
div = _binary(lax.div, jnp.divide, np.divide)
maximum = _binary(lax.max, jnp.maximum, np.maximum)
minimum = _binary(lax.min, jnp.minimum, np.minimum)


def select(pred, on_true, on_false):
    """`jnp.where(pred, on_true, on_false)` (broadcasting, dtype promotion) as `lax.select`."""
    if is_static(pred) and is_static(on_true) and is_static(on_false) and on_true.dtype == on_false.dtype:
        return np.asarray(np.where(pred, on_true, on_false), on_true.dtype)
    pred, on_true, on_false = jnp.asarray(pred), jnp.asarray(on_true), jnp.asarray(on_false)
    dtype = jnp.result_type(on_true, on_false)
    shape = jnp.broadcast_shapes(pred.shape, on_true.shape, on_false.shape)
    return lax.select(
        jnp.broadcast_to(pred, shape),
        jnp.broadcast_to(on_true.astype(dtype), shape),
        jnp.broadcast_to(on_false.astype(dtype), shape),
    )


def clip(x, lo, hi):
    """`jnp.clip(x, lo, hi)` for scalar bounds, as `lax.clamp` in x's dtype."""
    if is_static(x):
        return np.asarray(np.clip(x, np.asarray(lo, x.dtype), np.asarray(hi, x.dtype)), x.dtype)
    x = arr(x)
    return lax.clamp(np.asarray(lo, x.dtype), x, np.asarray(hi, x.dtype))


def widen(x, dtype):
    """``x`` converted to a wider float ``dtype``, keeping the rounding of FP8 data.

    FP8 data first passes a ``lax.optimization_barrier``: XLA's GPU compiler folds
    ``convert(convert(v, f8), f32)`` into ``v`` (no value is rounded to FP8), which silently drops
    the FP8 quantisation wherever a value is quantised and dequantised in one jitted
    function (and, for FP8 matmuls, keeps XLA from forming the FP8 GEMM).
    """
    x = jnp.asarray(x)
    if x.dtype.itemsize == 1 and jnp.issubdtype(x.dtype, jnp.floating):
        x = lax.optimization_barrier(x)
    return x.astype(dtype)


def bind_as_is(primitive, params, invals, eqn=None) -> list:
    """Bind `primitive` on plain values with an equation's params (under the equation's
    context manager, if any); returns the list of outputs."""
    bind_params = primitive.get_bind_params(params)
    subfuns = ()
    if isinstance(bind_params, tuple):  # jax < 0.10: (subfuns, params)
        subfuns, bind_params = bind_params
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
    if ctx is not None:
        with ctx:
            outs = primitive.bind(*subfuns, *invals, **bind_params)
    else:
        outs = primitive.bind(*subfuns, *invals, **bind_params)
    return list(outs) if primitive.multiple_results else [outs]


def stacked_reductions(xs, reduce, key=lambda x: (np.shape(x), np.dtype(x.dtype))):
    """`[reduce(x, all of x's axes) for x in xs]`, one reduction per group of arrays with the
    same `key` (default: shape and dtype): a group of several is stacked along a new
    leading axis and reduced over the other axes, `reduce(stacked, (1, ..., ndim))` giving
    the per-array results. A model's layers repeat their shapes, so a step reduces a few
    stacks instead of every array; XLA fuses the stack into the reduction (each array is
    read once). `reduce(x, axes)` must reduce over exactly `axes` (none for a 0-d x)."""
    groups: dict = {}
    for i, x in enumerate(xs):
        groups.setdefault(key(x), []).append(i)
    out = [None] * len(xs)
    for members in groups.values():
        if len(members) == 1:
            x = xs[members[0]]
            out[members[0]] = reduce(x, tuple(range(np.ndim(x))))
            continue
        stacked = jnp.stack([xs[i] for i in members])
        ms = reduce(stacked, tuple(range(1, stacked.ndim)))
        for k, i in enumerate(members):
            out[i] = ms[k]
    return out
