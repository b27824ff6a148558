"""Helpers shared by the scale rules: rescaling data, common scales, safe unscaled compute."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import numpy as np

from scalify.core.config import get_config
from scalify.core.lax_utils import add, arr, astype, div, is_static, maximum, minimum, mul, sub
from scalify.core.pow2 import clear_mantissa, pow2_round
from scalify.core.scaled_array import ScaledArray, compute_dtype, has_float32_range, is_concrete
from scalify.core.scale_flow import common_scale, cut_scale, note_max_abs, pass_max_abs, scale_exponent_range
from scalify.core.guards import delayed_estimate
from scalify.quant.formats import saturating_cast


def named_rule(prim, fn, doc=None):
    """`fn` named `_<primitive>_rule` (and given `doc`): a rule made by a factory gets its
    own name in error messages, in docs/operators.md and in the registry's check of rules
    re-registered by a re-import of their module (which compares module and name)."""
    if doc is not None:
        fn.__doc__ = doc
    fn.__name__ = fn.__qualname__ = f"_{prim.name.replace('-', '_')}_rule"
    return fn


def is_one(x) -> bool:
    """Whether `x` is concretely known to be all ones (so a multiplication can be skipped)."""
    return is_concrete(x) and np.size(x) >= 1 and bool(np.all(np.asarray(x) == 1))


def times_factor(data, factor):
    """data * factor (a power of two, 1 unless a product scale left the scale range, see
    `scalify.core.scale_flow.product_scale`), computed in float32 or wider; skipped for a
    static 1 or None."""
    if factor is None or is_one(factor):
        return data
    cdt = compute_dtype(data.dtype)

    def times(d):
        return astype(mul(astype(d, cdt), astype(factor, cdt)), d.dtype)

    out = times(data)
    pass_max_abs(out, data, lambda m: astype(times(astype(m, data.dtype)), np.float32))
    return out


def out_shape(xs) -> tuple[int, ...]:
    return tuple(np.broadcast_shapes(*[np.shape(x.data if isinstance(x, ScaledArray) else x) for x in xs]))


def rescale(x: ScaledArray, scale, shape=None, dtype=None, down: bool = False):
    """Data of `x` expressed in the power-of-two `scale`, in `dtype` (default: x's dtype);
    `down`: `scale` is known to be at least x's scale (see `scale_ratio`).

    The ratio x.scale/scale is a power of two, so this is exact unless the result under- or
    overflows `dtype`. When a non-scalar scale would change the data's shape (a scalar
    literal operand next to per-row scales), the data is broadcast to `shape`.
    """
    dtype = x.dtype if dtype is None else dtype
    ratio = np.ones((), np.float32) if x.scale is scale else scale_ratio(x.scale, scale, down)
    data = arr(x.data)
    if is_one(ratio):
        out = astype(data, dtype)
        pass_max_abs(out, data, lambda m: astype(astype(m, dtype), np.float32))
    else:
        cdt = compute_dtype(data.dtype, dtype)
        out = astype(mul(astype(data, cdt), astype(ratio, cdt)), dtype)
        pass_max_abs(out, data, lambda m: astype(astype(mul(astype(m, cdt), astype(ratio, cdt)), dtype),
                                                 np.float32))
    if shape is not None and np.shape(out) != np.shape(data):
        out, narrow = jnp.broadcast_to(out, shape), out
        pass_max_abs(out, narrow)
    return out


def scale_at_rank(x: ScaledArray):
    """x's scale as an array of the data's rank (leading 1s added)."""
    s = jnp.asarray(x.scale)
    return s.reshape((1,) * (x.ndim - s.ndim) + s.shape)


def align_scale(x: ScaledArray, axes, dtype=None):
    """(data, scale): x with its scale made constant along `axes`, the scale at the data's
    rank with size 1 on `axes`, the data re-expressed in it (in `dtype`, default x's).

    The new scale is the largest scale over `axes` among the elements whose data are not
    zero (the largest of all where every element is zero); zeros stay zero. Exact barring
    underflow of the smaller-scale elements. Zeros are left out because a zero's scale says
    nothing about its value: a zero keeps the scale it was made with, which can lie far above
    its neighbours' (a masked time step's gradient at 2^1 among steps at 2^-29 in a float16
    LSTM's backward pass), and the largest scale of all would flush every other element."""
    dtype = x.dtype if dtype is None else dtype
    s = scale_at_rank(x)
    axes = tuple(d for d in axes if s.shape[d] != 1)
    if not axes:
        return astype(x.data, dtype), s
    data = arr(x.data)
    live = lax.ne(data, jnp.zeros((), data.dtype))
    over = tuple(d for d in range(x.ndim) if d in axes or s.shape[d] == 1)  # to s's shape
    s_live = jnp.max(jnp.where(live, jnp.broadcast_to(s, x.shape), jnp.zeros((), s.dtype)), axis=over,
                     keepdims=True)
    s_new = jnp.where(s_live > 0, s_live, jnp.max(s, axis=axes, keepdims=True))
    # a zero whose scale lies above the new one would be multiplied by a ratio above 1
    # (possibly inf): it stays zero
    out = jnp.where(live, rescale(x, s_new, dtype=dtype), jnp.zeros((), dtype))
    return out, s_new


def scale_ratio(s, t, down: bool = False):
    """s / t for power-of-two scales. Two traced float32 scales: from the bits, with no
    division (XLA makes every float division a kernel of its own): bits(2^(es - et)) =
    bits(s) - bits(t) + (127 << 23), the exponent difference clamped to [-127, 128] so that
    a ratio beyond float32's normal range is 0 or inf, as the division flushes (subnormal
    results are flushed by the GPU and XLA:CPU) or overflows. `down` (t >= s, a ratio
    <= 1): only the lower bound, max(bits(s) - bits(t) + (127 << 23), 0)."""
    if is_static(s) or is_static(t) or jnp.result_type(s) != np.float32 or jnp.result_type(t) != np.float32:
        return div(s, t)
    i32 = np.int32
    diff = sub(lax.bitcast_convert_type(arr(s), jnp.int32), lax.bitcast_convert_type(arr(t), jnp.int32))
    if down:
        bits = maximum(add(diff, i32(127 << 23)), i32(0))
    else:
        bits = lax.add(lax.clamp(i32(-127 << 23), diff, i32(128 << 23)), i32(127 << 23))
    return lax.bitcast_convert_type(bits, jnp.float32)


def to_common(xs, dtype=None):
    """Rescale the ScaledArray among `xs` to their common scale (others are kept as is):
    the largest scale, a promoted constant counting with its placement scale
    (`scalify.core.scale_flow.common_scale`).

    Returns (list of data, scale); data in `dtype` (default: each input's dtype).
    """
    scale = common_scale(xs)
    shape = out_shape(xs)
    datas = [rescale(x, scale, shape, dtype) if isinstance(x, ScaledArray) else x for x in xs]
    return datas, scale


def round_scale(scale):
    """Round a positive float scale to a power of two (active ScalifyConfig mode), clamped to
    the scale dtype's normal range: a rule that multiplies its data by `s_in / s_out` then
    keeps the value when `s_out` would over- or underflow, instead of a zero or inf scale."""
    lo, hi = scale_exponent_range()
    sdtype = get_config().scale_dtype
    out = pow2_round(astype(scale, sdtype))
    if is_static(out):
        return np.clip(out, np.asarray(2.0**lo, sdtype), np.asarray(2.0**hi, sdtype))
    return lax.clamp(np.asarray(2.0**lo, sdtype), out, np.asarray(2.0**hi, sdtype))


def round_scale_times(scale, c: float):
    """`round_scale(scale * c)` for a power-of-two `scale` and a static c > 0, as
    `scale * pow2_round(c)` clamped: multiplying by a power of two leaves the mantissa of
    c (rounded to the scale dtype, as the product would round it) unchanged, so the rounding
    commutes with it, and a product beyond the range saturates to the same clamp. Two
    operations on a traced scale in range instead of a rounding's bit arithmetic; the clamp
    is one-sided (a factor >= 1 can only overflow, one < 1 only underflow)."""
    lo, hi = scale_exponent_range()
    sdtype = get_config().scale_dtype
    r = pow2_round(np.asarray(c, sdtype))
    out = mul(astype(scale, sdtype), r)
    if is_static(out):
        return np.clip(out, np.asarray(2.0**lo, sdtype), np.asarray(2.0**hi, sdtype))
    if r >= 1:
        return minimum(out, np.asarray(2.0**hi, sdtype))
    return maximum(out, np.asarray(2.0**lo, sdtype))


def with_scale(data, scale) -> ScaledArray:
    """A ScaledArray from data and a (power-of-two) scale, in the configured scale dtype."""
    return ScaledArray(data, astype(scale, get_config().scale_dtype))


def unit_scale_like(data) -> ScaledArray:
    """`data` with scale 1."""
    return ScaledArray(data, np.ones((), get_config().scale_dtype))


def materialize(x: ScaledArray, dtype=None):
    """`data * scale` computed in at least float32 and returned in `dtype` (default: float32
    or wider). Used by rules whose output is not scaled (exp, log, tanh, ...)."""
    cdt = compute_dtype(x.dtype)
    return astype(mul(astype(x.data, cdt), astype(x.scale, cdt)), dtype or cdt)


def scalar_scale(x: ScaledArray) -> bool:
    """Whether x's scale is a single value (shape () or all ones)."""
    return int(np.prod(np.shape(x.scale))) == 1


def scalar_of(s):
    """A single-valued scale as a 0-d array, with no op when it already is one (a NumPy
    scale stays NumPy)."""
    if is_static(s):
        return np.reshape(s, ())
    s = jnp.asarray(s)
    return s if s.ndim == 0 else lax.reshape(s, ())


def full_scale(x: ScaledArray):
    """x's scale broadcast to the data's shape (for rules that move elements around)."""
    return jnp.broadcast_to(jnp.asarray(x.scale), x.shape)


def narrow_range(dtype) -> bool:
    """Whether float `dtype` has a narrower exponent range than float32 (float16, FP8): a
    value it holds can overflow or underflow where float32 keeps it, so data whose size no
    rule can bound are placed from their measured maximum (`place_measured`)."""
    return jnp.issubdtype(dtype, jnp.floating) and not has_float32_range(dtype)


def pow2_floor_of_max(m):
    """2^floor(log2 m) of a measured float32 maximum m; 1 for a zero or non-finite m."""
    return clear_mantissa(jnp.where(jnp.isfinite(m) & (m > 0), m, 1.0))


def place_measured(acc, base, out_dtype) -> ScaledArray:
    """`acc * base` (acc computed in float32, base a power-of-two scale) as a ScaledArray
    with `out_dtype` data at unit max-abs: f = 2^floor(log2 max|acc|) (1 for a zero or
    non-finite maximum), scale = clamp(base * f, 2^-126, 2^127), data = acc * (base / scale)
    cast once. The value is kept up to the cast's rounding, whatever the size of `acc`:
    a narrow dtype never overflows where float32 holds the value. One max-reduction over
    `acc` (XLA fuses it with acc's producer). The scale is cut from the scale graph where
    it is made (`cut_scale`): its consumers read it, and the product behind `base` and the
    estimate behind f run once, not in every fusion that uses the placed value.

    Under delayed statistics (`scalify.core.statistics`) f comes from the previous step's
    record of this site and the data are cast saturating (`saturating_cast`: a finite value
    that grew beyond the estimate by more than the dtype's headroom is clipped, never inf;
    an inf of the data stays inf, NaN stays NaN)."""
    base = jnp.asarray(base, jnp.float32)

    def measure():
        return jnp.max(jnp.abs(acc)).astype(jnp.float32)

    m, delayed = delayed_estimate(measure, base) if base.ndim == 0 else (None, False)
    if m is None:
        m = measure()
    f = pow2_floor_of_max(m)
    f = lax.clamp(np.float32(2.0**-126), f, np.float32(2.0**126))
    new_scale = cut_scale(lax.clamp(np.float32(2.0**-126), base * f, np.float32(2.0**127)))
    ratio = scale_ratio(base, new_scale)
    data = acc * ratio
    data = saturating_cast(data, out_dtype) if delayed else data.astype(out_dtype)
    note_max_abs(data, (m * ratio).astype(out_dtype).astype(jnp.float32))  # for later guards
    return ScaledArray(data, new_scale.astype(get_config().scale_dtype))
