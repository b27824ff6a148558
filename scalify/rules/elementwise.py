"""Scale rules of elementwise primitives.

Unit-scaling assumption (Blake et al. 2023): inputs are independent with unit-variance
data, so a rule picks the output scale that keeps the output data near unit variance.
Every output scale is rounded to a power of two (ScalifyConfig rounding mode).
"""
from __future__ import annotations

import jax
from jax.extend.core import primitives as jprims
import jax.numpy as jnp
from jax import lax

from scalify.core.scaled_array import ScaledArray
from scalify.interpreter import register_scale_rule
from scalify.rules.common import (
    materialize,
    max_scale,
    rescale,
    round_scale,
    to_common_scale,
    unit_scale_like,
    with_scale,
)


# -- additive -----------------------------------------------------------------------------


def _make_additive(prim):
    def rule(a: ScaledArray, b: ScaledArray, **params):
        sa, sb = jnp.asarray(a.scale), jnp.asarray(b.scale)
        hi, lo = jnp.maximum(sa, sb), jnp.minimum(sa, sb)
        scale = round_scale(hi * jnp.sqrt(1 + (lo / hi) ** 2))
        return with_scale(prim.bind(rescale(a, scale), rescale(b, scale), **params), scale)

    rule.__doc__ = (
        f"{prim.name}: scale s = sqrt(sa^2 + sb^2) (as max*sqrt(1+(min/max)^2)); "
        "data = a.data*(sa/s) op b.data*(sb/s)."
    )
    rule.__name__ = f"_{prim.name.replace('-', '_')}_rule"
    rule.__module__ = __name__
    return rule


for _p in (lax.add_p, lax.sub_p, jprims.add_jaxvals_p):
    register_scale_rule(_p)(_make_additive(_p))


# -- multiplicative -----------------------------------------------------------------------
@register_scale_rule(lax.mul_p)
def _mul_rule(a: ScaledArray, b: ScaledArray, **params):
    """a * b: scale sa*sb; data a.data*b.data."""
    return with_scale(lax.mul_p.bind(a.data, b.data, **params), jnp.asarray(a.scale) * jnp.asarray(b.scale))


@register_scale_rule(lax.div_p)
def _div_rule(a: ScaledArray, b: ScaledArray, **params):
    """a / b: scale sa/sb; data a.data/b.data."""
    return with_scale(lax.div_p.bind(a.data, b.data, **params), jnp.asarray(a.scale) / jnp.asarray(b.scale))


# -- sign and magnitude -------------------------------------------------------------------
def _make_same_scale(prim):
    def rule(x: ScaledArray, **params):
        return ScaledArray(prim.bind(x.data, **params), x.scale)

    rule.__doc__ = f"{prim.name}(x): scale unchanged; data {prim.name}(x.data)."
    rule.__name__ = f"_{prim.name}_rule"
    rule.__module__ = __name__
    return rule


for _p in (lax.neg_p, lax.abs_p):
    register_scale_rule(_p)(_make_same_scale(_p))


def _make_common_scale_binary(prim):
    def rule(*xs, **params):
        floats = [x for x in xs if isinstance(x, ScaledArray)]
        scale = max_scale(*floats)
        args = [rescale(x, scale) if isinstance(x, ScaledArray) else x for x in xs]
        return with_scale(prim.bind(*args, **params), scale)

    rule.__doc__ = f"{prim.name}: scale = largest input scale; inputs rescaled to it."
    rule.__name__ = f"_{prim.name}_rule"
    rule.__module__ = __name__
    return rule


for _p in (lax.max_p, lax.min_p, lax.select_n_p, lax.clamp_p):
    register_scale_rule(_p)(_make_common_scale_binary(_p))


# -- unscaled-output functions ------------------------------------------------------------
def _make_unscaled(prim):
    def rule(*xs, **params):
        args = [materialize(x) if isinstance(x, ScaledArray) else x for x in xs]
        out = prim.bind(*args, **params)
        dtype = xs[0].dtype
        return unit_scale_like(out.astype(dtype))

    rule.__doc__ = (
        f"{prim.name}(x): computed on the materialised value in float32 (or wider); "
        "output scale 1."
    )
    rule.__name__ = f"_{prim.name}_rule"
    rule.__module__ = __name__
    return rule


for _p in (lax.exp_p, lax.log_p, lax.tanh_p, lax.logistic_p):
    register_scale_rule(_p)(_make_unscaled(_p))


@register_scale_rule(lax.convert_element_type_p)
def _convert_element_type_rule(x: ScaledArray, *, new_dtype, **params):
    """convert(x): float -> float keeps the scale and converts data; float -> int/bool
    materialises first (the output is unscaled)."""
    if jnp.issubdtype(new_dtype, jnp.floating):
        return ScaledArray(lax.convert_element_type_p.bind(x.data, new_dtype=new_dtype, **params), x.scale)
    return lax.convert_element_type_p.bind(materialize(x), new_dtype=new_dtype, **params)
