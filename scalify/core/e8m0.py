"""E8M0 storage of power-of-two scales (`float8_e8m0fnu`: 8 exponent bits, no mantissa).

An E8M0 value is exactly 2^(e - 127) for e in 0..254 (255 is NaN), the scale format of the
OCP Microscaling (MX) spec. Conversion of a power-of-two float32 scale is exact.
"""
from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from scalify.core.errors import ScaleError
from scalify.core.pow2 import is_pow2

E8M0 = jnp.dtype(ml_dtypes.float8_e8m0fnu)


def scale_to_e8m0(scale):
    """Convert power-of-two scales to E8M0 (exact in [2^-127, 2^127]).

    Concrete non-power-of-two inputs raise ScaleError; traced inputs are rounded down to a
    power of two by the cast.
    """
    if isinstance(scale, (np.ndarray, np.generic, float, int)):
        s = np.asarray(scale, dtype=np.float64)
        if not is_pow2(s).all() or (s < 2.0**-127).any() or (s > 2.0**127).any():
            raise ScaleError(
                f"scale_to_e8m0 takes powers of two in [2^-127, 2^127], got {s.ravel()[:4]}. "
                "Round with scalify.pow2_round first."
            )
    return jnp.asarray(scale, jnp.float32).astype(E8M0)


def scale_from_e8m0(scale, dtype=jnp.float32):
    """Convert E8M0 scales back to `dtype` (float32 by default)."""
    return jnp.asarray(scale).astype(dtype)
