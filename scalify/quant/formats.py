"""Floating-point format descriptions and saturating casts.

A binary floating-point format with ``m`` mantissa bits represents a normal value as
``(-1)^s * 2^e * (1 + f / 2^m)``; the relative rounding error of round-to-nearest is at
most ``2^-(m+1)`` in the normal range. FP8 formats follow Micikevicius et al. 2022,
"FP8 Formats for Deep Learning" (E4M3 without infinities, max 448; E5M2 IEEE-like, max
57344) and the ``fnuz`` variants of Graphcore/AMD (no negative zero, one NaN).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from scalify.core.lax_utils import widen  # noqa: F401  (re-exported as scalify.quant.widen)
from scalify.quant._jit import eager_jit

__all__ = ["FormatInfo", "format_info", "saturating_cast", "is_fp8", "SUPPORTED_FORMATS"]

SUPPORTED_FORMATS = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float16",
    "bfloat16",
    "float32",
)

# 8-bit float *element* formats. float8_e8m0fnu is a scale-only format (no sign, no
# mantissa) and deliberately not listed.
_FP8_NAMES = frozenset(
    {
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e4m3",
        "float8_e3m4",
        "float8_e4m3b11fnuz",
    }
)


@dataclasses.dataclass(frozen=True)
class FormatInfo:
    """Static description of a floating-point format.

    Attributes:
      name: dtype name, e.g. ``"float8_e4m3fn"``.
      dtype: the numpy/jax dtype.
      bits: storage width in bits.
      max: largest finite value.
      min_normal: smallest positive normal value (``2^emin``).
      min_subnormal: smallest positive subnormal value (``2^(emin - mantissa_bits)``).
      mantissa_bits: explicit fraction bits ``m``; unit roundoff is ``2^-(m+1)``.
      exponent_bits: exponent field width.
      emax: exponent of ``max``, ``floor(log2(max))`` (8 for E4M3, 15 for E5M2); the
        ``emax_elem`` of the OCP MX specification.
      has_inf: whether the format encodes +-inf (E4M3/fnuz formats do not).
    """

    name: str
    dtype: np.dtype
    bits: int
    max: float
    min_normal: float
    min_subnormal: float
    mantissa_bits: int
    exponent_bits: int
    emax: int
    has_inf: bool

    @property
    def eps(self) -> float:
        """Distance from 1 to the next value, ``2^-mantissa_bits``."""
        return 2.0 ** -self.mantissa_bits

    @property
    def unit_roundoff(self) -> float:
        """Max relative error of round-to-nearest in the normal range, ``2^-(m+1)``."""
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def dynamic_range(self) -> float:
        """``max / min_subnormal``: ratio of largest to smallest nonzero magnitude."""
        return self.max / self.min_subnormal

    @property
    def normal_range(self) -> float:
        """``max / min_normal``: ratio spanned at full relative precision."""
        return self.max / self.min_normal


def _canonical_dtype(dtype) -> np.dtype:
    try:
        return jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(
            f"{dtype!r} is not a dtype; pass e.g. jnp.float8_e4m3fn or 'float8_e4m3fn'."
        ) from e


_CACHE: dict[np.dtype, FormatInfo] = {}


def format_info(dtype) -> FormatInfo:
    """Return the :class:`FormatInfo` of a floating dtype (values from ``ml_dtypes.finfo``).

    Raises:
      TypeError: if ``dtype`` is not a floating-point dtype.
    """
    dt = _canonical_dtype(dtype)
    if dt in _CACHE:
        return _CACHE[dt]
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(
            f"format_info expects a floating dtype, got {dt}. Supported: "
            f"{', '.join(SUPPORTED_FORMATS)}."
        )
    fi = ml_dtypes.finfo(dt)
    with np.errstate(all="ignore"):
        has_inf = bool(np.isinf(np.array(np.inf, np.float32).astype(dt).astype(np.float32)))
    info = FormatInfo(
        name=dt.name,
        dtype=dt,
        bits=int(fi.bits),
        max=float(fi.max),
        min_normal=float(fi.tiny),
        min_subnormal=float(fi.smallest_subnormal),
        mantissa_bits=int(fi.nmant),
        exponent_bits=int(fi.nexp),
        emax=int(math.floor(math.log2(float(fi.max)))),
        has_inf=has_inf,
    )
    _CACHE[dt] = info
    return info


def is_fp8(dtype) -> bool:
    """True for 8-bit floating *element* formats (E4M3, E5M2 and variants).

    ``float8_e8m0fnu`` (scale-only, used for MX block scales) returns False.
    """
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        return False
    return dt.name in _FP8_NAMES


@eager_jit(static_argnames=("dtype", "inf_saturates"))
def saturating_cast(x: jax.Array, dtype, inf_saturates: bool = False) -> jax.Array:
    """Cast ``x`` to ``dtype`` with round-to-nearest-even and saturation.

    ``y = RNE(clip(x, -max, max))`` where ``max`` is the largest finite value of ``dtype``:

    * finite values beyond the range clamp to ``+-max`` (never inf, never NaN — a plain
      ``astype(float8_e4m3fn)`` turns overflow into NaN);
    * ``+-inf`` clamps to ``+-max`` when ``dtype`` has no infinity (E4M3, fnuz), and
      stays ``+-inf`` when it has one (E5M2, float16, bfloat16, float32);
    * NaN stays NaN.

    Rounding is IEEE round-to-nearest, ties-to-even (XLA ``convert``), applied once:
    inputs narrower than float32 are first widened exactly to float32, so the clamp bound
    is exact and there is no double rounding. Values below the smallest subnormal
    round to (signed) zero.

    ``inf_saturates=True``, for a ``dtype`` with an infinity: ``+-inf`` clamps to ``+-max``
    too, and the clamp follows the cast, in ``dtype``: ``y = clamp(-max, convert(x), max)``
    (a value that overflows ``dtype`` converts to inf, which the clamp brings back), one
    elementwise op on the narrow result, which XLA fuses with the cast as it does a plain
    convert. For a ``dtype`` without one it changes nothing.
    """
    info = format_info(dtype)
    x = jnp.asarray(x)
    if inf_saturates and info.has_inf:
        top = jnp.asarray(info.max, info.dtype)
        return jax.lax.clamp(-top, x.astype(info.dtype), top)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize < 4:
        x = x.astype(jnp.float32)
    src_max = float(jnp.finfo(x.dtype).max)
    if src_max <= info.max:
        # Target range covers the source range: only inf may need handling.
        if not info.has_inf:
            x = jnp.where(jnp.isinf(x), jnp.sign(x) * info.max, x)
        return x.astype(info.dtype)
    y = jnp.clip(x, -info.max, info.max)
    if info.has_inf:
        y = jnp.where(jnp.isinf(x), x, y)
    return y.astype(info.dtype)
