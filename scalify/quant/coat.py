"""Per-group FP8 quantisation with dynamic range expansion (Xi et al. 2024, "COAT:
Compressing Optimizer States and Activation for Memory-Efficient FP8 Training", ICLR 2025).

Optimizer states quantised per group of ``G`` (1 x G along the last axis) use only a
small part of FP8's range: a group's range ``R_X = max|x| / min|x|`` is often far below
the format's ``R_fp8``. COAT expands it first with ``f(x) = sign(x) |x|^k`` and picks
``k`` per group so the expanded range fills the format, ``R_X^k = R_fp8``::

    k     = log(R_fp8) / log(R_X)                         (min over nonzero |x|)
    q     = saturating_cast(sign(x) * fmax * (|x| / max|x|)^k, fp8)
    scale = max|x| * fmax^(-1/k)
    x    ~= sign(q) * scale * |q|^(1/k)                   (k = 1: x ~= q * scale)

The relative error of FP8 (``u`` in the normal range) turns into ``u / k`` after the
``1/k`` power, so ``k > 1`` lowers the error of all normal-range values and avoids
flushing small values to zero. Normalising by ``max|x|`` before the power keeps every
intermediate in [fmax / R_fp8, fmax] (the CUDA kernel of the paper centres by
``sqrt(max*min)`` instead; same result up to rounding). ``R_fp8`` defaults to
``fmax^2 / 2`` (= 100352 for E4M3), the value of the paper's reference kernel; it maps
the group minimum to ``2 / fmax`` (~2^-7.8 for E4M3), inside the subnormal range.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from scalify.quant._jit import eager_jit
from scalify.core.lax_utils import widen
from scalify.quant.formats import format_info, saturating_cast

__all__ = ["coat_quantize", "coat_dequantize", "coat_expansion_exponent", "default_target_range"]


def default_target_range(dtype=jnp.float8_e4m3fn) -> float:
    """``fmax^2 / 2``: the expanded group range COAT aims for (100352 for E4M3)."""
    fmax = format_info(dtype).max
    return fmax * fmax / 2.0


def _groups(x: jax.Array, group_size: int, fn: str):
    if x.ndim == 0:
        x = x.reshape(1)
    if group_size <= 0:
        raise ValueError(f"{fn}: group_size must be positive, got {group_size}.")
    n = x.shape[-1]
    ng = max(1, -(-n // group_size))
    pad = ng * group_size - n
    if pad:
        # Zero padding changes neither max|x| nor the minimum over nonzero |x|.
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], ng, group_size), n


def _ungroup(xg: jax.Array, n: int, shape) -> jax.Array:
    flat = xg.reshape(*xg.shape[:-2], -1)[..., :n]
    return flat.reshape(shape)


MIN_K = 0.125


def coat_expansion_exponent(
    amax: jax.Array, amin: jax.Array, target_range: float, max_k: float = 64.0
) -> jax.Array:
    """``k = log(target_range) / log(amax / amin)`` per group, clipped to ``[1/8, max_k]``.

    Groups with a single nonzero magnitude have no range to expand and get ``max_k``;
    all-zero groups get 1. ``k < 1`` (compression) happens when a group's range exceeds
    ``target_range``; it multiplies the relative error by ``1/k``. The floor 1/8 keeps
    ``scale = amax * fmax^(-1/k)`` a normal float32 (values below ``amax /
    target_range^8`` then flush to zero).
    """
    log_r = jnp.log(amax) - jnp.log(amin)
    k = jnp.log(jnp.float32(target_range)) / jnp.where(log_r > 0, log_r, 1.0)
    k = jnp.where(log_r > 0, jnp.clip(k, MIN_K, max_k), max_k)
    return jnp.where(amax > 0, k, 1.0).astype(jnp.float32)


@eager_jit(static_argnames=("group_size", "dtype", "expand", "target_range", "max_k"))
def coat_quantize(
    x: jax.Array,
    group_size: int = 128,
    dtype=jnp.float8_e4m3fn,
    expand: bool = True,
    target_range: float | None = None,
    max_k: float = 64.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-group (1 x ``group_size`` along the last axis) FP8 quantisation, COAT style.

    Args:
      x: floating array; the last axis is split into groups (zero-padded if its size is
        not a multiple of ``group_size``).
      group_size: elements per group ``G`` (128 in the paper).
      dtype: FP8 (or other float) storage format.
      expand: apply dynamic range expansion; ``False`` gives plain per-group absmax
        scaling (``k = 1``, ``scale = max|x| / fmax``).
      target_range: expanded range ``R_fp8`` (default :func:`default_target_range`).
      max_k: upper bound on ``k``.

    Returns:
      ``(data, scale, k)``: ``data`` in ``dtype`` with ``x``'s shape; ``scale`` and
      ``k`` float32 of shape ``x.shape[:-1] + (ceil(n / group_size),)``.
    """
    info = format_info(dtype)
    x = jnp.asarray(x)
    shape = x.shape
    xg, n = _groups(x.astype(jnp.float32), group_size, "coat_quantize")
    ax = jnp.abs(xg)
    amax = jnp.max(ax, axis=-1)
    safe_max = jnp.where(amax > 0, amax, 1.0)
    fmax = jnp.float32(info.max)
    if expand:
        if target_range is None:
            target_range = default_target_range(dtype)
        if not target_range > 1:
            raise ValueError(f"target_range must be > 1, got {target_range}.")
        amin = jnp.min(jnp.where(ax > 0, ax, jnp.inf), axis=-1)
        amin = jnp.where(jnp.isfinite(amin), amin, safe_max)
        k = coat_expansion_exponent(amax, amin, target_range, max_k)
        # (|x| / amax)^k in the log domain: the ratio itself may underflow float32
        # (e.g. 1e-30 / 1e30) even though its k-th power (k < 1) does not.
        r = ax / safe_max[..., None]
        log2_r = jnp.where(
            r >= jnp.finfo(jnp.float32).tiny,
            jnp.log2(r),
            jnp.log2(ax) - jnp.log2(safe_max)[..., None],
        )
        y = jnp.sign(xg) * fmax * jnp.exp2(k[..., None] * log2_r)
        scale = amax * jnp.power(fmax, -1.0 / k)
    else:
        k = jnp.ones_like(amax)
        scale = amax / fmax
        y = xg / jnp.where(scale > 0, scale, 1.0)[..., None]
    data = saturating_cast(y, info.dtype)
    return _ungroup(data, n, shape), scale.astype(jnp.float32), k


@eager_jit(static_argnames=("group_size", "dtype"))
def coat_dequantize(
    data: jax.Array,
    scale: jax.Array,
    k: jax.Array | None = None,
    group_size: int = 128,
    dtype=jnp.float32,
) -> jax.Array:
    """Inverse of :func:`coat_quantize`: ``x = sign(q) * scale * |q|^(1/k)`` per group.

    ``k=None`` means no expansion (``x = q * scale``).
    """
    data = jnp.asarray(data)
    shape = data.shape
    qg, n = _groups(widen(data, jnp.float32), group_size, "coat_dequantize")
    scale = jnp.asarray(scale, jnp.float32)
    if scale.shape != qg.shape[:-1]:
        raise ValueError(
            f"coat_dequantize: scale shape {scale.shape} does not match data shape "
            f"{shape} with group_size={group_size}; expected {qg.shape[:-1]} (as "
            "returned by coat_quantize with the same group_size)."
        )
    if k is None:
        out = qg * scale[..., None]
    else:
        k = jnp.asarray(k, jnp.float32)
        out = jnp.sign(qg) * scale[..., None] * jnp.power(jnp.abs(qg), 1.0 / k[..., None])
    return _ungroup(out, n, shape).astype(dtype)
