"""Power-of-two helpers: rounding, exact mantissa/exponent split, checks.

Rounding works on the bits: clearing the mantissa field of an IEEE float gives
2^floor(log2|x|) exactly, with two cheap ops (bitcast, and) that XLA fuses away. It is
exact for float16, bfloat16, float32 and float64. Zero, inf and nan map to themselves;
subnormal inputs (below the dtype's smallest normal) round down to 0.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify.core.config import Pow2RoundMode, get_config
from scalify.core.lax_utils import select

_INT_OF = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _masks(dtype):
    finfo = jnp.finfo(dtype)
    nbits = 8 * np.dtype(dtype).itemsize
    mant_mask = (1 << int(finfo.nmant)) - 1
    sign_mask = 1 << (nbits - 1)
    all_mask = (1 << nbits) - 1
    return mant_mask, all_mask & ~mant_mask, sign_mask


def _float_array(x):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize not in _INT_OF:
        x = x.astype(jnp.float32)
    return x


def clear_mantissa(x):
    """x with its mantissa bits cleared: 2^floor(log2|x|) with the sign of x for a normal x,
    0 for 0 and subnormals, +-inf for inf and NaN (three operations)."""
    x = _float_array(x)
    itype = _INT_OF[x.dtype.itemsize]
    _, keep, _ = _masks(x.dtype)
    bits = lax.bitcast_convert_type(x, itype)
    return lax.bitcast_convert_type(lax.bitwise_and(bits, np.asarray(keep, itype)), x.dtype)


def pow2_round_down(x):
    """2^floor(log2|x|) with the sign of x (exact: the mantissa bits are cleared)."""
    x = _float_array(x)
    return lax.select(lax.ne(x, x), x, clear_mantissa(x))  # NaN stays NaN


def _mantissa_bits(x):
    itype = _INT_OF[x.dtype.itemsize]
    mant, _, _ = _masks(x.dtype)
    return lax.bitcast_convert_type(x, itype) & jnp.asarray(mant, itype)


def pow2_round_up(x):
    """2^ceil(log2|x|) with the sign of x."""
    x = _float_array(x)
    down = pow2_round_down(x)
    exact = (_mantissa_bits(x) == 0) | ~jnp.isfinite(x)
    return select(exact, down, down * 2).astype(x.dtype)


def pow2_round_nearest(x):
    """2^round(log2|x|) with the sign of x: up when |x| / 2^floor(log2|x|) >= sqrt(2)."""
    x = _float_array(x)
    down = pow2_round_down(x)
    cdt = jnp.promote_types(x.dtype, jnp.float32)  # float64 stays float64 (its range)
    ratio = jnp.abs(x.astype(cdt) / select(down == 0, 1, down).astype(cdt))
    up = (ratio >= np.sqrt(2.0)) & jnp.isfinite(x)
    return select(up, down * 2, down).astype(x.dtype)


_ROUNDERS = {
    Pow2RoundMode.DOWN: pow2_round_down,
    Pow2RoundMode.NEAREST: pow2_round_nearest,
    Pow2RoundMode.UP: pow2_round_up,
}


def _np_float_array(x):
    """`_float_array` in NumPy: the dtype JAX would compute in (float64 is float32 unless
    jax_enable_x64), float32 for other dtypes."""
    x = np.asarray(x)
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize not in _INT_OF:
        dtype = np.dtype(np.float32)
    return x.astype(dtype)


def _np_pow2_round_bits(x, mode: Pow2RoundMode):
    """`pow2_round` of a NumPy value, with the same bit arithmetic (NumPy result)."""
    x = _np_float_array(x)
    itype = np.dtype(_INT_OF[x.dtype.itemsize])
    mant, keep, _ = _masks(x.dtype)
    bits = x.view(itype) if x.ndim else np.asarray(x).reshape(1).view(itype).reshape(())
    with np.errstate(all="ignore"):
        down = (bits & np.asarray(keep, itype)).reshape(-1).view(x.dtype).reshape(x.shape)
        down = np.where(np.isnan(x), x, down).astype(x.dtype)
        if mode is Pow2RoundMode.DOWN:
            return down
        if mode is Pow2RoundMode.UP:
            exact = ((bits & np.asarray(mant, itype)) == 0) | ~np.isfinite(x)
            return np.where(exact, down, down * np.asarray(2, x.dtype)).astype(x.dtype)
        cdt = np.promote_types(x.dtype, np.float32)
        ratio = np.abs(x.astype(cdt) / np.where(down == 0, 1, down).astype(cdt))
        up = (ratio >= np.asarray(np.sqrt(2.0), cdt)) & np.isfinite(x)
        return np.where(up, down * np.asarray(2, x.dtype), down).astype(x.dtype)


def pow2_round(x, mode: Pow2RoundMode | str | None = None):
    """Round x to a power of two with `mode` (default: the active ScalifyConfig's mode).
    A NumPy value is rounded in NumPy (same bits, no traced operation)."""
    mode = get_config().rounding_mode if mode is None else Pow2RoundMode(mode)
    if isinstance(x, (np.ndarray, np.generic)):
        return _np_pow2_round_bits(x, mode)
    return _ROUNDERS[mode](x)


def np_pow2_round(x, mode: Pow2RoundMode | str | None = None) -> np.ndarray:
    """NumPy version of `pow2_round` for concrete values (no graph ops at trace time)."""
    mode = get_config().rounding_mode if mode is None else Pow2RoundMode(mode)
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(all="ignore"):
        e = np.log2(np.abs(x))
        e = {Pow2RoundMode.DOWN: np.floor, Pow2RoundMode.UP: np.ceil}.get(mode, np.round)(e)
        out = np.sign(x) * np.exp2(e)
    return np.where(np.isfinite(x) & (x != 0), out, x)


def split_pow2(x, mode: Pow2RoundMode | str | None = None):
    """Exact split x = mantissa * scale with scale = pow2_round(|x|) > 0.

    0, inf and nan get scale 1 (their scale does not matter; see the interpreter's
    "any scale" values). Returns (mantissa, scale), both of x's dtype.
    """
    x = _float_array(x)
    scale = pow2_round(jnp.abs(x), mode)
    scale = select(jnp.isfinite(x) & (scale != 0), scale, jnp.ones_like(scale))
    return (x / scale).astype(x.dtype), scale


def split_scale(s):
    """Exact split of a scale `s = mantissa * p`: mantissa in [1, 2) with the sign of s (1
    for a power of two), read from the bits, and p = s / mantissa = 2^floor(log2|s|), a
    positive power of two (a division of two numbers with the same mantissa: exact). For
    s = 0 or inf: mantissa 1 and p = s; nan: p nan; a subnormal s: a mantissa from its
    bits and p = s / mantissa, subnormal. Returns (p, mantissa), both of s's dtype and
    shape (float32 if s is not float16, bfloat16, float32 or float64)."""
    s = _float_array(s)
    itype = _INT_OF[s.dtype.itemsize]
    mant_mask, _, sign_mask = _masks(s.dtype)
    one_bits = np.asarray(1, s.dtype).view(itype)
    bits = lax.bitcast_convert_type(s, itype)
    mantissa = lax.bitcast_convert_type(
        lax.bitwise_or(lax.bitwise_and(bits, np.asarray(mant_mask | sign_mask, itype)), one_bits), s.dtype)
    return lax.div(s, mantissa), mantissa


def is_pow2(x) -> np.ndarray:
    """Elementwise: is x a (positive) power of two? Concrete inputs only (NumPy result)."""
    x = np.asarray(x, dtype=np.float64)
    mant, _ = np.frexp(x)
    return (x > 0) & np.isfinite(x) & (mant == 0.5)


def pow2_fit(amax, target: float):
    """The smallest power of two `s` with `amax / s <= target`: the scale that maps a
    maximum `amax` (float32, any shape) to at most `target` (a static positive number, e.g.
    a format's largest value `fmax / 2^margin`). 1 where `amax` is 0, negative, inf or NaN.

    `s = 2^ceil(log2(amax / target))`, computed on the float32 bits with no float operation
    (exact, also where subnormals are flushed), clipped to float32's normal range
    [2^-126, 2^127]. With `target = t 2^et`, t in [1, 2) (rounded down to float32, which can
    only make `s` a binade larger, never break the bound) and `amax = f 2^e`, f in [1, 2):
    `s = 2^(e - et + [f > t])`. The exponent e is the exponent field minus 127; for a
    subnormal amax, f 2^-149 with integer f, it is -149 + floor(log2 f), from the leading
    zeros of f, whose fraction bits are shifted up to its leading one for the comparison;
    for `target >= 1` every subnormal amax gives the clip 2^-126, and `e + [f > t]` is the
    exponent field after adding `2^23 - 1 - (t's fraction)` to the bits (a carry exactly
    when f > t).
    """
    target = float(target)
    if not (math.isfinite(target) and target > 0):
        raise ValueError(f"pow2_fit: target must be a positive finite number, got {target!r}.")
    m, e_t = math.frexp(target)  # target = m 2^e_t, m in [0.5, 1)
    t, e_t = np.float32(2 * m), e_t - 1
    t_bits = int(t.view(np.int32)) - (1 if float(t) > 2 * m else 0)  # rounded down to float32
    bits = lax.bitcast_convert_type(jnp.asarray(amax, jnp.float32), jnp.int32)
    ok = (bits > 0) & (bits < 0x7F800000)  # positive (not 0, -0 or negative), not inf or NaN
    if e_t >= 0:
        # Adding 2^23 - 1 - (t's fraction) carries into the exponent field exactly when
        # f > t, so the field becomes e + 127 + [f > t]. A subnormal amax (e <= -127) gives
        # k <= -126: the clip, whatever its fraction.
        biased = jnp.clip(((bits + (0x7FFFFF - (t_bits & 0x7FFFFF))) >> 23) - e_t, 1, 254)
        return jnp.where(ok, lax.bitcast_convert_type(biased << 23, jnp.float32), jnp.float32(1.0))
    field = bits >> 23  # the exponent field (negative for a negative amax)
    lead = lax.clz(bits)  # of a subnormal: 9 + the leading zeros of its 23-bit fraction
    subnormal = field == 0
    e = jnp.where(subnormal, -118 - lead, field - 127)
    fraction = jnp.where(subnormal, bits << jnp.maximum(lead - 8, 0), bits) & 0x7FFFFF
    above = fraction > (t_bits & 0x7FFFFF)
    k = jnp.clip(e - e_t + above.astype(jnp.int32), -126, 127)
    return jnp.where(ok, lax.bitcast_convert_type((k + 127) << 23, jnp.float32), jnp.float32(1.0))
