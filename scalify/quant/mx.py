"""MX block scaling (OCP Microscaling Formats (MX) Specification v1.0, 2023; Rouhani et al.
2023, "Microscaling Data Formats for Deep Learning").

A block of ``k`` (default 32) consecutive elements along ``axis`` shares one E8M0 scale::

    X     = 2^(floor(log2(max_i |V_i|)) - emax_elem)     # emax_elem = 8 (E4M3), 15 (E5M2)
    P_i   = saturating_cast(V_i / X, elem_dtype)           # RNE, clamp to +-max normal
    V_i  ~= P_i * X

The block amax lands in ``[2^emax_elem, 2^(emax_elem+1))`` and values above the element
max (448 for E4M3) saturate, as the spec prescribes. Exponents are clamped to the E8M0
range ``[-127, 127]``; an all-zero block gets ``2^-127``; a block with inf or NaN gets the
NaN scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from scalify.quant._jit import eager_jit
from scalify.quant.e8m0 import E8M0, E8M0_MAX_EXP, E8M0_MIN_EXP, from_e8m0
from scalify.core.lax_utils import widen
from scalify.quant.formats import format_info, saturating_cast

__all__ = ["mx_quantize", "mx_dequantize", "floor_log2"]


def floor_log2(x: jax.Array) -> jax.Array:
    """Exact ``floor(log2(|x|))`` of normal float32 values, from the exponent bits (int32).

    Zero and float32 subnormals give -127; inf/NaN give 128.
    """
    x = jnp.abs(jnp.asarray(x, jnp.float32))
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return (bits >> 23).astype(jnp.int32) - 127


def _exp2_int(e: jax.Array) -> jax.Array:
    """Exact ``2^e`` as float32 for int ``e`` in [-126, 127] (built from exponent bits)."""
    e = jnp.clip(e, -126, 127)
    return jax.lax.bitcast_convert_type(((e + 127).astype(jnp.uint32) << 23), jnp.float32)


def _moved_shape(shape, axis):
    """Shape after ``jnp.moveaxis(x, axis, -1)``."""
    return tuple(d for i, d in enumerate(shape) if i != axis) + (shape[axis],)


def _blocked(x: jax.Array, block_size: int, axis: int, fn: str):
    if x.ndim == 0:
        raise ValueError(f"{fn} needs an array with at least one dimension, got a scalar.")
    axis = axis % x.ndim
    n = x.shape[axis]
    if block_size <= 0:
        raise ValueError(f"{fn}: block_size must be positive, got {block_size}.")
    if n % block_size:
        raise ValueError(
            f"{fn}: axis {axis} has size {n}, not a multiple of block_size={block_size}. "
            f"Pad that axis to {-(-n // block_size) * block_size} (e.g. with jnp.pad) or "
            "pick another axis/block_size."
        )
    xm = jnp.moveaxis(x, axis, -1)
    return axis, xm.reshape(*xm.shape[:-1], n // block_size, block_size)


@eager_jit(static_argnames=("dtype", "block_size", "axis", "scale_rounding"))
def mx_quantize(
    x: jax.Array,
    dtype=jnp.float8_e4m3fn,
    block_size: int = 32,
    axis: int = -1,
    scale_rounding: str = "floor",
) -> tuple[jax.Array, jax.Array]:
    """MX-quantise ``x`` into ``(data, scales)``.

    Args:
      x: floating array; ``x.shape[axis]`` must be a multiple of ``block_size``.
      dtype: element format (float8_e4m3fn, float8_e5m2, ...).
      block_size: elements per shared scale (32 in the MX spec).
      axis: axis along which blocks are formed.
      scale_rounding: ``"floor"`` (the spec formula above; the block max may saturate,
        e.g. 1.97 -> 1.75 in E4M3 since 1.97 * 2^8 > 448) or ``"ceil"``: the smallest
        ``e`` with ``amax <= fmax * 2^e``, so nothing saturates (one binade less for
        the smallest values of the block).

    Returns:
      ``data`` with ``x``'s shape and dtype ``dtype``; ``scales`` as ``float8_e8m0fnu``
      with ``x``'s shape except ``shape[axis] // block_size`` along ``axis``.
    """
    info = format_info(dtype)
    x = jnp.asarray(x)
    axis, xb = _blocked(x, block_size, axis, "mx_quantize")
    xb = xb.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    finite = jnp.isfinite(amax)  # NaN propagates through max, so this covers NaN too
    if scale_rounding not in ("floor", "ceil"):
        raise ValueError(f"scale_rounding must be 'floor' or 'ceil', got {scale_rounding!r}.")
    e = floor_log2(amax) - info.emax
    if scale_rounding == "ceil":
        # amax * 2^-e is exact (power-of-two scaling of a normal float).
        e = e + (amax * _exp2_int(-e) > info.max).astype(jnp.int32)
    e = jnp.clip(e, E8M0_MIN_EXP, E8M0_MAX_EXP)
    e = jnp.where(amax == 0, E8M0_MIN_EXP, e)
    e = jnp.where(finite, e, 0)
    # Multiply by the exact inverse 2^-e (never subnormal since e > -127 whenever the
    # block holds a nonzero normal value); exact, so the only rounding is the cast.
    data = saturating_cast(xb * _exp2_int(-e)[..., None], info.dtype)
    bits = jnp.where(finite, e + 127, 255).astype(jnp.uint8)
    scales = jax.lax.bitcast_convert_type(bits, E8M0)
    data = jnp.moveaxis(data.reshape(_moved_shape(x.shape, axis)), -1, axis)
    scales = jnp.moveaxis(scales, -1, axis)
    return data, scales


@eager_jit(static_argnames=("block_size", "axis", "dtype"))
def mx_dequantize(
    data: jax.Array,
    scales: jax.Array,
    block_size: int = 32,
    axis: int = -1,
    dtype=jnp.float32,
) -> jax.Array:
    """Inverse of :func:`mx_quantize`: ``V_i = P_i * 2^(scale exponent)``, returned as ``dtype``."""
    data = jnp.asarray(data)
    scales = jnp.asarray(scales)
    axis_n, db = _blocked(data, block_size, axis, "mx_dequantize")
    want = db.shape[:-1]
    s = jnp.moveaxis(scales, axis_n, -1) if scales.ndim == data.ndim else scales
    if s.shape != want:
        expected = list(data.shape)
        expected[axis_n] //= block_size
        raise ValueError(
            f"mx_dequantize: scales shape {scales.shape} does not match data shape "
            f"{data.shape} with block_size={block_size} along axis {axis_n}; expected "
            f"{tuple(expected)} (as returned by mx_quantize)."
        )
    out = widen(db, jnp.float32) * from_e8m0(s)[..., None]
    out = jnp.moveaxis(out.reshape(_moved_shape(data.shape, axis_n)), -1, axis_n)
    return out.astype(dtype)
