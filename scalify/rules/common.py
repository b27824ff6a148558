"""Helpers shared by the scale rules: rescaling data, common scales, safe unscaled compute."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from scalify.core.config import get_config
from scalify.core.pow2 import pow2_round
from scalify.core.scaled_array import ScaledArray, compute_dtype


def rescale(x: ScaledArray, scale):
    """Data of `x` expressed in the power-of-two `scale`: `x.data * (x.scale / scale)`.

    Exact (a power-of-two ratio) unless the result under- or overflows `x.dtype`.
    """
    ratio = jnp.asarray(x.scale) / jnp.asarray(scale)
    if isinstance(ratio, jax.Array) and not isinstance(ratio, jax.core.Tracer):
        if ratio.size == 1 and float(ratio.reshape(())) == 1.0:
            return x.data
    cdt = compute_dtype(x.dtype)
    return (x.data.astype(cdt) * ratio.astype(cdt)).astype(x.dtype)


def max_scale(*xs: ScaledArray):
    """Largest scale among `xs` (elementwise when scales are arrays)."""
    out = jnp.asarray(xs[0].scale)
    for x in xs[1:]:
        out = jnp.maximum(out, jnp.asarray(x.scale))
    return out


def to_common_scale(*xs: ScaledArray):
    """Rescale `xs` to their largest scale; returns (list of data, scale)."""
    scale = max_scale(*xs)
    return [rescale(x, scale) for x in xs], scale


def round_scale(scale):
    """Round a positive float scale to a power of two (active ScalifyConfig mode)."""
    return pow2_round(jnp.asarray(scale, get_config().scale_dtype))


def with_scale(data, scale) -> ScaledArray:
    """A ScaledArray from data and a (power-of-two) scale, in the configured scale dtype."""
    return ScaledArray(data, jnp.asarray(scale).astype(get_config().scale_dtype))


def unit_scale_like(data) -> ScaledArray:
    """`data` with scale 1."""
    return ScaledArray(data, jnp.ones((), get_config().scale_dtype))


def materialize(x: ScaledArray, dtype=None):
    """`data * scale` computed in at least float32 and returned in `dtype` (default: float32
    or wider). Used by rules whose output is not scaled (exp, log, tanh, ...)."""
    cdt = compute_dtype(x.dtype)
    return (x.data.astype(cdt) * jnp.asarray(x.scale).astype(cdt)).astype(dtype or cdt)


def scalar_scale(x: ScaledArray) -> bool:
    """Whether x's scale is a single value (shape () or all ones)."""
    return int(np.prod(np.shape(x.scale))) == 1


def full_scale(x: ScaledArray):
    """x's scale broadcast to the data's shape (for rules that move elements around)."""
    return jnp.broadcast_to(jnp.asarray(x.scale), x.shape)
