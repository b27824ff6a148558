"""E8M0 power-of-two scales (OCP Microscaling Formats (MX) Specification v1.0, 2023).

``float8_e8m0fnu`` stores only a biased exponent: bits ``b`` in 0..254 encode ``2^(b-127)``,
``b = 255`` encodes NaN; there is no sign, no zero and no infinity. The bias equals the
float32 exponent bias, so a float32 power of two ``2^e`` (``-126 <= e <= 127``) has
E8M0 bits equal to its float32 exponent field; ``2^-127`` is a float32 subnormal.

Note: XLA on CPU/GPU flushes float32 subnormals in arithmetic, so ``from_e8m0`` of the
smallest code (``2^-127``) is exact as a value but multiplies like zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from scalify.quant._jit import eager_jit

__all__ = ["E8M0", "E8M0_MIN_EXP", "E8M0_MAX_EXP", "to_e8m0", "from_e8m0", "e8m0_exponent"]

E8M0 = jnp.dtype("float8_e8m0fnu")
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127


def _concrete(x):
    """``x`` as a numpy array when it holds known values, else None (under tracing)."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def _check_pow2(v: np.ndarray) -> None:
    v = v.astype(np.float64)
    bad = ~np.isfinite(v) | (v <= 0)
    m, e = np.frexp(np.where(bad, 1.0, v))  # v = m * 2^e, m in [0.5, 1)
    bad |= m != 0.5
    bad |= (e - 1 < E8M0_MIN_EXP) | (e - 1 > E8M0_MAX_EXP)
    if np.any(bad):
        first = v[bad].ravel()[:5]
        raise ValueError(
            f"to_e8m0 needs positive finite powers of two in [2^{E8M0_MIN_EXP}, "
            f"2^{E8M0_MAX_EXP}]; {int(bad.sum())} of {v.size} values are not, e.g. "
            f"{first.tolist()}. Round the scale first (e.g. 2**floor(log2(s))), or call "
            "to_e8m0 under jit, where non-powers of two round to the nearest power of two."
        )


def to_e8m0(scale: jax.Array) -> jax.Array:
    """Convert float32 power-of-two scales to ``float8_e8m0fnu``.

    Exact for ``2^e`` with ``-127 <= e <= 127``. With concrete (non-traced) input, any
    other value (non-power of two, zero, negative, inf, NaN, out of range) raises
    ``ValueError``. Under tracing no check is possible: XLA's convert rounds the mantissa
    to nearest-even (``3 -> 4``, ``1.4 -> 1``) and maps zero, negatives, inf and NaN to
    the NaN code 0xFF.
    """
    scale = jnp.asarray(scale)
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        scale = scale.astype(jnp.float32)
    if scale.dtype == E8M0:
        return scale
    v = _concrete(scale)
    if v is not None:
        _check_pow2(v)
    return _to_e8m0(scale)


@eager_jit
def _to_e8m0(scale):
    return scale.astype(jnp.float32).astype(E8M0)


@eager_jit(static_argnames=("dtype",))
def from_e8m0(x: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Decode E8M0 scales to ``dtype``: bits ``b`` -> ``2^(b-127)``, 0xFF -> NaN.

    ``x`` may be ``float8_e8m0fnu`` or raw ``uint8`` bits. Decoding to float32 is exact;
    narrower ``dtype`` (float16) overflows to inf / underflows to 0 outside its range.
    """
    x = jnp.asarray(x)
    if x.dtype == jnp.uint8:
        x = jax.lax.bitcast_convert_type(x, E8M0)
    if x.dtype != E8M0:
        raise TypeError(
            f"from_e8m0 expects float8_e8m0fnu (or uint8 bits), got {x.dtype}; "
            "encode float scales with to_e8m0 first."
        )
    return x.astype(jnp.float32).astype(dtype)


@eager_jit
def e8m0_exponent(x: jax.Array) -> jax.Array:
    """Unbiased int32 exponent ``b - 127`` of E8M0 scales (the NaN code gives 128)."""
    x = jnp.asarray(x)
    if x.dtype == E8M0:
        x = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return x.astype(jnp.int32) - 127
