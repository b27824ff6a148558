"""How unscaled values enter the scale graph, and how operands agree on a common scale.

This module is the one place that decides the scale of a value scalify did not receive as
a ScaledArray:

- **promotion** (`promote`): an unscaled float operand of an equation that has scaled
  inputs becomes a ScaledArray.
    * A plain array (not known to be a broadcast scalar) gets scale 1: it is represented
      exactly as plain JAX represents it.
    * A constant (a literal or a 0-d value, possibly broadcast, reshaped or converted) `c`
      is split exactly as `c = m * 2^e` with the power of two `2^e` the rounded `|c|`
      (ScalifyConfig rounding mode) clipped to the scale dtype's normal range; the mantissa
      `m` is computed in float32 (or wider), never in the data dtype, so `2^-e` cannot
      overflow float16 or FP8. The same arithmetic runs for a concrete constant (NumPy, at
      trace time) and a traced one (lax ops), so eager and jitted calls agree.
    * An "any scale" constant (0, inf, nan: e.g. an attention mask's `-inf`) takes the
      largest scale of the equation's scaled inputs, so it never changes a common scale.
- **common scale** (`common_scale`): rules that place values of several operands side by
  side (select_n, max, min, clamp, concatenate, pad, dynamic_update_slice, scatter,
  comparisons) rescale them to the largest operand scale. A promoted constant takes part
  with its *placement scale* `min(2^e, 1)`: a constant larger than 1 (`finfo.min` of a
  mask, a clip bound, `nan_to_num`'s `finfo.max`) raises the common scale at most to 1,
  where every value of the data dtype fits as it does in plain JAX. It never drags the
  scale to 2^127 and flushes the other operands (the result is then at least as accurate
  as the plain computation, and equal to it in float32).

Arithmetic rules (mul, div, add, sub, ...) use the constant's exact scale `2^e`, which keeps
its data a unit mantissa.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify.core.config import Pow2RoundMode, get_config
from scalify.core.lax_utils import arr, astype, div, maximum, minimum, mul, select
from scalify.core.pow2 import np_pow2_round, pow2_round
from scalify.core.scaled_array import ScaledArray, compute_dtype, is_concrete

__all__ = [
    "PromotedConstant",
    "promote",
    "max_scale",
    "placement_scale",
    "common_scale",
    "product_scale",
    "scale_exponent_range",
]


class PromotedConstant(ScaledArray):
    """A constant promoted next to scaled operands: `data * scale` is the constant with its
    exact power-of-two scale; `placement` is the scale it asks of a common scale (`None`
    for an "any scale" value: 0, inf, nan). Only rules see it: the interpreter turns rule
    outputs back into plain ScaledArray."""

    __slots__ = ("placement",)

    def __init__(self, data, scale, placement):
        super().__init__(data, scale)
        self.placement = placement


def scale_exponent_range() -> tuple[int, int]:
    """(min, max) exponent k of a normal power of two 2^k in the configured scale dtype
    (float32: -126, 127)."""
    finfo = jnp.finfo(get_config().scale_dtype)
    return max(int(finfo.minexp), -126), min(int(finfo.maxexp) - 1, 127)


def max_scale(*xs: ScaledArray):
    """Largest scale among `xs` (elementwise when scales are arrays)."""
    out = arr(xs[0].scale)
    for x in xs[1:]:
        out = maximum(out, x.scale)
    return out


def placement_scale(x: ScaledArray):
    """The scale `x` asks of a common scale: its own, or a promoted constant's placement."""
    if isinstance(x, PromotedConstant) and x.placement is not None:
        return x.placement
    return x.scale


def common_scale(xs):
    """The scale at which the ScaledArray among `xs` are placed side by side: the largest
    scale of the scaled operands, where a promoted constant counts with its placement scale
    (see the module docstring) and an "any scale" constant does not count."""
    scaled = [x for x in xs if isinstance(x, ScaledArray)]
    counted = [x for x in scaled if not (isinstance(x, PromotedConstant) and x.placement is None)]
    out = None
    for x in counted or scaled:
        s = arr(placement_scale(x))
        out = s if out is None else maximum(out, s)
    return out


def product_scale(sa, sb, divide: bool = False):
    """The scale of `a * b` (or `a / b`) and the data factor that keeps it in range.

    Returns (scale, factor): scale = sa*sb (sa/sb) clamped to the scale dtype's normal range,
    factor = (sa*sb)/scale, computed as (sa/scale)*sb so that nothing overflows. The factor
    is exactly 1 unless the product left the range; multiplying the data by it then gives
    what the plain value would be (0 for an underflow, as in plain arithmetic), never the
    NaN of a zero or infinite scale.
    """
    lo, hi = scale_exponent_range()
    sa, sb = arr(sa), arr(sb)
    op = div if divide else mul
    dtype = jnp.result_type(sa, sb)
    scale = lax.clamp(np.asarray(2.0**lo, dtype), astype(op(sa, sb), dtype), np.asarray(2.0**hi, dtype))
    return scale, op(div(sa, scale), sb)


def _np_split(c: float):
    """(exponent e, placement exponent) of a concrete finite non-zero constant c."""
    lo, hi = scale_exponent_range()
    pow2 = float(np_pow2_round(abs(c)))
    e = int(np.clip(np.round(np.log2(pow2)), lo, hi))
    return e, min(e, 0)


def promote(value, scalar, ref_scale) -> ScaledArray:
    """Promote an unscaled float value to ScaledArray (see the module docstring).

    Args:
      value: the unscaled operand (an array or a NumPy scalar).
      scalar: its broadcast-scalar metadata: the 0-d constant it broadcasts (concrete or
        traced), or None for a general array.
      ref_scale: a thunk giving the scale of "any scale" values (0, inf, nan), or None.
    """
    sdtype = get_config().scale_dtype
    x = arr(value)
    if scalar is None:
        return ScaledArray(x, jnp.ones((), sdtype))
    cdt = compute_dtype(x.dtype, sdtype)
    if is_concrete(scalar):
        c = float(np.asarray(scalar, np.float64))
        if not (np.isfinite(c) and c != 0):
            return PromotedConstant(x, _any_scale(ref_scale(), x.shape), None)
        e, p = _np_split(c)
        scale = np.asarray(2.0**e, sdtype)
        placement = np.asarray(2.0**p, sdtype)
        if e == 0:
            return PromotedConstant(x, scale, placement)
        if is_concrete(value):
            data = np.asarray(np.asarray(value, np.float64) * 2.0**-e, x.dtype)
        else:
            data = astype(lax.mul(astype(x, cdt), np.asarray(2.0**-e, cdt)), x.dtype)
        return PromotedConstant(data, scale, placement)
    # A traced constant (e.g. a 0-d argument under jit): the same arithmetic as lax ops.
    lo, hi = scale_exponent_range()
    s = astype(scalar, jnp.float32)
    regular = lax.is_finite(s) & lax.ne(s, np.float32(0))
    pow2 = pow2_round(lax.abs(select(regular, s, np.float32(1))))
    pow2 = lax.clamp(np.float32(2.0**lo), pow2, np.float32(2.0**hi))
    any_scale = _any_scale(ref_scale(), x.shape)
    scale = select(regular, astype(pow2, sdtype), any_scale)
    placement = select(regular, astype(minimum(pow2, np.float32(1)), sdtype), any_scale)
    data = astype(div(astype(x, cdt), astype(scale, cdt)), x.dtype)
    return PromotedConstant(data, scale, placement)


def _any_scale(ref, shape):
    """The scale given to an "any scale" value: the reference scale if it broadcasts."""
    sdtype = get_config().scale_dtype
    if ref is None:
        return jnp.ones((), sdtype)
    if np.ndim(ref) > 0 and not _broadcasts(ref, shape):
        ref = jnp.max(ref)
    return astype(ref, sdtype)


def _broadcasts(scale, shape) -> bool:
    try:
        return np.broadcast_shapes(np.shape(scale), tuple(shape)) == tuple(shape)
    except ValueError:
        return False


def as_plain_scaled(x):
    """A rule output as a plain ScaledArray (a promoted constant returned by a rule loses its
    placement: it is an ordinary scaled value from then on)."""
    if type(x) is PromotedConstant:
        out = object.__new__(ScaledArray)
        out.data, out.scale = x.data, x.scale
        return out
    return x


def conform_constant(x: ScaledArray) -> ScaledArray:
    """A promoted constant expressed at its placement scale (for loop carries and branch
    outputs, where the constant becomes a value that later operands are placed next to):
    `finfo.min` as a running-max initial value stays at scale 1 instead of 2^127."""
    if not isinstance(x, PromotedConstant) or x.placement is None:
        return as_plain_scaled(x)
    cdt = compute_dtype(x.dtype)
    ratio = div(astype(x.scale, cdt), astype(x.placement, cdt))
    data = astype(mul(astype(x.data, cdt), ratio), x.dtype)
    out = object.__new__(ScaledArray)
    out.data, out.scale = data, x.placement
    return out
