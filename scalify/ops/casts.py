"""Directional casts: cast (or round) to a format in one direction of autodiff only.

    y = cast_on_forward(x, float8_e4m3fn)      # forward: y = cast(x); backward: dx = dy
    y = cast_on_backward(x, float8_e5m2)       # forward: y = x;       backward: dx = cast(dy)
    y = reduce_precision_on_forward(x, fp8)    # forward: y = round(x) in x's dtype; backward: dx = dy
    y = reduce_precision_on_backward(x, fp8)   # forward: y = x; backward: dx = round(dy) in x's dtype

Rounding is IEEE round-to-nearest, ties-to-even (XLA's `convert`), applied once (narrow
inputs are widened exactly to float32 first, so there is no double rounding). FP8 targets
saturate: finite values beyond the format's largest value become +-max, and E4M3 (which has
no infinity) maps +-inf to +-max too, so overflow never turns into NaN as a plain
`astype(float8_e4m3fn)` does; NaN stays NaN. Other targets (float16, bfloat16) follow IEEE:
overflow gives inf, unless `saturate=True`.

The cotangent of `x` always has `x`'s dtype (JAX's rule for cotangents; an FP8-typed
cotangent flowing into an op that expects `x`'s dtype would not type-check), so
`cast_on_backward` rounds the gradient *through* `dtype` and returns it in `x`'s dtype, like
`reduce_precision_on_backward`; they differ only in the forward-direction counterparts.
For the FP8 matmul whose backward runs on FP8 *typed* gradients (E5M2 x E4M3 GEMMs), use
`scalify.ops.fp8.fp8_dot_general` / `scalify.nn.Dense`.

Outside `scalify` these are plain casts. Inside `scalify` the cast applies to the data of a
ScaledArray and keeps its scale: the saturation bound is the format's max *in data units*,
which is why the cast is a primitive (`scalify_cast`) with its own scale rule rather than a
`clip` + `convert` (a value-level clip would compare the value, not the data, with 448).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from scalify.core.config import get_config
from scalify.core.scale_flow import exact_in
from scalify.core.guards import rebalance_drift
from scalify.core.scaled_array import ScaledArray
from scalify.core.registry import register_scale_rule
from scalify.quant.formats import format_info, is_fp8, saturating_cast

__all__ = [
    "cast",
    "cast_on_forward",
    "cast_on_backward",
    "reduce_precision",
    "reduce_precision_on_forward",
    "reduce_precision_on_backward",
    "cast_p",
]


# ---------------------------------------------------------------------------------------
# The cast primitive
# ---------------------------------------------------------------------------------------
def _cast_impl(x, *, dtype, saturate):
    if saturate:
        return saturating_cast(x, dtype)
    return lax.convert_element_type(x, dtype)


def _cast_abstract_eval(x, *, dtype, saturate):
    del saturate
    return x.update(dtype=dtype, weak_type=False)


cast_p = Primitive("scalify_cast")
cast_p.def_impl(_cast_impl)
cast_p.def_abstract_eval(_cast_abstract_eval)
mlir.register_lowering(cast_p, mlir.lower_fun(_cast_impl, multiple_results=False))
batching.defvectorized(cast_p)
# Straight-through derivative: the tangent is converted like the value but never clipped
# (the directional casts below replace it with their own rule anyway).
ad.defjvp(cast_p, lambda t, x, *, dtype, saturate: lax.convert_element_type(t, dtype))


def fp8_cast_window(src, dst) -> tuple[int, int] | None:
    """The drift window (lo, hi) of a cast of `src` data to an FP8 format `dst`
    (`ScalifyConfig.cast_drift_window`), or None (no guard).

    Guarded: sources of wider exponent range than float16 (bfloat16, float32), whose data
    nothing keeps inside an FP8 range. Data whose max-abs m has 2^floor(log2 m) below 2^-lo
    (4 by default: most values would be FP8 subnormals or zeros) or above 2^hi, hi =
    floor(log2 fmax) (E4M3: m >= 512, E5M2: m >= 2^16, beyond the format's max), go to unit
    max-abs first. Data placed in the format's top binade (a quantiser's) stay where they
    are. Not guarded: float16 and FP8 sources, whose range the float16 guards and the
    producers already bound (float16 to E5M2 keeps every normal value's exponent). `src`
    is the narrowest dtype the data's values are known to be exact in (`_cast_rule` passes
    `scale_flow.exact_in`): float32 data widened from float16, such as the float32 view of
    float16 master weights, is float16 data and is not guarded either."""
    w = get_config().cast_drift_window
    if w is None or not is_fp8(dst) or not jnp.issubdtype(src, jnp.floating):
        return None
    if jnp.finfo(src).maxexp <= jnp.finfo(jnp.float16).maxexp:
        return None
    return (4 if w == "auto" else w, int(np.floor(np.log2(float(format_info(dst).max)))))


@register_scale_rule(cast_p)
def _cast_rule(x: ScaledArray, *, dtype, saturate):
    """cast(x): scale kept; data cast (saturating at the format's max in data units).
    To FP8 from bfloat16 / float32 data, data far below unit or beyond the format first go
    to unit max-abs (`fp8_cast_window`; one max-reduction). Data widened from float16 or
    FP8 (`exact_in`) counts as its narrow dtype: not guarded."""
    x = rebalance_drift(x, fp8_cast_window(exact_in(x.data) or x.dtype, dtype))
    return ScaledArray(cast_p.bind(x.data, dtype=dtype, saturate=saturate), x.scale)


def _resolve_saturate(dtype, saturate) -> bool:
    return is_fp8(dtype) if saturate is None else bool(saturate)


def _check_float(x, fn):
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(
            f"{fn} casts floating-point arrays, got dtype {jnp.result_type(x)}. Integer and "
            "boolean values have no low-precision float format: convert them explicitly."
        )


def cast(x, dtype, saturate: bool | None = None):
    """Cast `x` to `dtype` with round-to-nearest-even; FP8 targets saturate (see module doc).

    Differentiable straight-through (the tangent is converted, never clipped). On a
    ScaledArray (outside or inside `scalify`) the data is cast and the scale kept.

    Args:
      x: float array or ScaledArray.
      dtype: target dtype (e.g. `jnp.float8_e4m3fn`, `jnp.float16`).
      saturate: clamp finite overflow (and inf when `dtype` has no inf) to +-max. Default:
        True for FP8 formats, False (IEEE overflow to inf) otherwise.
    """
    dtype = jnp.dtype(dtype)
    if isinstance(x, ScaledArray):
        return ScaledArray(cast(x.data, dtype, saturate), x.scale)
    x = jnp.asarray(x)
    _check_float(x, "cast")
    return cast_p.bind(x, dtype=dtype, saturate=_resolve_saturate(dtype, saturate))


def reduce_precision(x, dtype, saturate: bool | None = None):
    """Round `x` to the values of `dtype` and keep `x`'s dtype (the "fake cast").

    Exactly `cast(cast(x, dtype), x.dtype)`: every FP8/FP16 value is representable in a
    wider container, so the only rounding is the first cast. (Unlike `lax.reduce_precision`
    with E4M3's bit counts, this gives E4M3FN's real range, max 448, and its saturation.)
    When `dtype` has a larger range than the container (bfloat16 in a float16 container),
    the way back saturates to the container's max.
    """
    dtype = jnp.dtype(dtype)
    if isinstance(x, ScaledArray):
        return ScaledArray(reduce_precision(x.data, dtype, saturate), x.scale)
    x = jnp.asarray(x)
    _check_float(x, "reduce_precision")
    if dtype == x.dtype:
        return x
    y = cast(x, dtype, saturate)
    back_saturate = format_info(dtype).max > format_info(x.dtype).max
    return cast(y, x.dtype, back_saturate)


# ---------------------------------------------------------------------------------------
# Directional versions (custom_vjp, one per (source, target, saturate) triple)
# ---------------------------------------------------------------------------------------
@functools.cache
def _directional(kind: str, src, dst, saturate: bool):
    fwd_op = {
        "cast_fwd": lambda x: cast(x, dst, saturate),
        "cast_bwd": lambda x: x,
        "rp_fwd": lambda x: reduce_precision(x, dst, saturate),
        "rp_bwd": lambda x: x,
    }[kind]
    if kind in ("cast_bwd", "rp_bwd"):

        def bwd_op(g):
            return reduce_precision(g.astype(src), dst, saturate)

    else:

        def bwd_op(g):
            return g.astype(src)

    @jax.custom_vjp
    def f(x):
        return fwd_op(x)

    f.defvjp(lambda x: (fwd_op(x), None), lambda _, g: (bwd_op(g),))
    return f


def _apply(kind, fn_name, x, dtype, saturate):
    dtype = jnp.dtype(dtype)
    if isinstance(x, ScaledArray):
        return ScaledArray(_apply(kind, fn_name, x.data, dtype, saturate), x.scale)
    x = jnp.asarray(x)
    _check_float(x, fn_name)
    sat = _resolve_saturate(dtype, saturate)
    return _directional(kind, x.dtype, dtype, sat)(x)


def cast_on_forward(x, dtype, saturate: bool | None = None):
    """Forward: `cast(x, dtype)`. Backward: the cotangent passes through, returned in x's dtype.

    Args:
      x: float array (a ScaledArray: data cast, scale kept).
      dtype: forward target dtype, e.g. `jnp.float8_e4m3fn`.
      saturate: see `cast` (default: saturate FP8 targets only).
    Returns:
      `x` cast to `dtype`.
    """
    return _apply("cast_fwd", "cast_on_forward", x, dtype, saturate)


def cast_on_backward(x, dtype, saturate: bool | None = None):
    """Forward: identity. Backward: the cotangent is cast to `dtype` (saturating for FP8,
    round-to-nearest-even) and handed on in x's dtype (see the module doc for why)."""
    return _apply("cast_bwd", "cast_on_backward", x, dtype, saturate)


def reduce_precision_on_forward(x, dtype, saturate: bool | None = None):
    """Forward: `reduce_precision(x, dtype)` (values of `dtype`, container `x.dtype`).
    Backward: identity."""
    return _apply("rp_fwd", "reduce_precision_on_forward", x, dtype, saturate)


def reduce_precision_on_backward(x, dtype, saturate: bool | None = None):
    """Forward: identity. Backward: the cotangent rounded to the values of `dtype`
    (saturating for FP8), kept in x's dtype."""
    return _apply("rp_bwd", "reduce_precision_on_backward", x, dtype, saturate)

