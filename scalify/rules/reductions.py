"""Scale rules of reductions: reduce_*, argmax/argmin, cumulative ops, reduce_window_*.

Unit-scaling assumption: the N reduced terms are independent with unit variance, so a sum
has standard deviation sqrt(N) and its scale is s*sqrt(N) (rounded to a power of two);
max/min/arg* keep the scale; products multiply scales exactly.

Non-scalar scales: when the scale varies along a reduced axis, the data are first rescaled
(in float32 or wider) to the largest scale along that axis, which is constant there; the
scale then loses that axis. Sums and products accumulate in float32 or wider and are cast
to the data's dtype once at the end.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify.core.lax_utils import astype, div, is_static, mul
from scalify.core.registry import register_scale_rule
from scalify.core.scale_flow import scale_exponent, scale_from_exponent
from scalify.core.scaled_array import ScaledArray, compute_dtype
from scalify.rules.common import align_scale, is_one, named_rule, round_scale_times, scale_at_rank, with_scale
from scalify.rules.elementwise import make_unscaled_rule


def _full_rank_scale(x: ScaledArray):
    """x's scale at the data's rank (`scale_at_rank`), or None when it is a scalar."""
    return None if np.size(x.scale) == 1 else scale_at_rank(x)


def _align(x: ScaledArray, varying):
    """Make x's scale constant along the axes for which `varying(axis)` is True.

    Returns (data, scale): data in float32 or wider when it had to be rescaled (else x.data),
    and the scale (scalar, or of data's rank with size 1 on those axes). The scale is the
    largest along the axes among non-zero elements (`align_scale`): exact up to underflow of
    the smaller terms.
    """
    s = _full_rank_scale(x)
    if s is None:
        return x.data, x.scale if is_static(x.scale) else jnp.asarray(x.scale)
    axes = tuple(a for a in range(x.ndim) if s.shape[a] != 1 and varying(a))
    if not axes:
        return x.data, s
    return align_scale(x, axes, compute_dtype(x.dtype))


def _drop_axes(scale, axes):
    """Remove the reduced `axes` (size 1 in a full-rank scale) from a scale."""
    if np.ndim(scale) == 0:
        return scale
    return jnp.squeeze(scale, axis=tuple(axes))


def _count(shape, axes) -> int:
    return int(np.prod([shape[a] for a in axes], dtype=np.int64))


# ---------------------------------------------------------------------------------------
# Sums
# ---------------------------------------------------------------------------------------
def _sum_like(x: ScaledArray, n: int, varying, compute, drop=()):
    """Shared math of sums over n terms: s' = round(s*sqrt(n)), data = sum(d)*(s/s')."""
    data, s = _align(x, varying)
    cdt = compute_dtype(x.dtype)
    out_s = round_scale_times(s, math.sqrt(max(n, 1)))
    total = compute(astype(data, cdt))
    ratio = div(astype(s, out_s.dtype), out_s)
    if not is_one(ratio):
        total = mul(total, astype(_drop_axes(ratio, drop), cdt))
    return with_scale(total.astype(x.dtype), _drop_axes(out_s, drop))


@register_scale_rule(lax.reduce_sum_p)
def _reduce_sum_rule(x: ScaledArray, *, axes, **params):
    """reduce_sum(x) over N terms: scale s*sqrt(N) rounded to a power of two; data
    sum(d) * (s / s'), accumulated in float32 or wider."""
    return _sum_like(
        x,
        _count(x.shape, axes),
        lambda a: a in axes,
        lambda d: lax.reduce_sum_p.bind(d, axes=axes, **params),
        drop=axes,
    )


@register_scale_rule(lax.cumsum_p)
def _cumsum_rule(x: ScaledArray, *, axis, reverse):
    """cumsum(x) along an axis of size N: scale s*sqrt(N) rounded (the scale of the last,
    largest partial sum); data cumsum(d) * (s / s'), accumulated in float32 or wider."""
    return _sum_like(
        x,
        x.shape[axis],
        lambda a: a == axis,
        lambda d: lax.cumsum_p.bind(d, axis=axis, reverse=reverse),
    )


def _window_varying(params):
    """Axes along which a reduce_window mixes or moves elements (the scale must be constant
    there); an axis with window 1, stride 1, no padding and no dilation is left alone."""

    def varying(a):
        return not (
            params["window_dimensions"][a] == 1
            and params["window_strides"][a] == 1
            and tuple(params["padding"][a]) == (0, 0)
            and params["base_dilation"][a] == 1
            and params["window_dilation"][a] == 1
        )

    return varying


@register_scale_rule(lax.reduce_window_sum_p)
def _reduce_window_sum_rule(x: ScaledArray, **params):
    """reduce_window_sum(x) with a window of W elements: scale s*sqrt(W) rounded; data
    window sums of d times s/s' (float32 or wider accumulation)."""
    return _sum_like(
        x,
        int(np.prod(params["window_dimensions"])),
        _window_varying(params),
        lambda d: lax.reduce_window_sum_p.bind(d, **params),
    )


# ---------------------------------------------------------------------------------------
# Order statistics: scale unchanged
# ---------------------------------------------------------------------------------------
def _make_order(prim, varying_of, drop_of):
    def rule(x: ScaledArray, **params):
        data, s = _align(x, varying_of(params))
        out = prim.bind(data, **params).astype(x.dtype)
        return with_scale(out, _drop_axes(s, drop_of(params)))

    return named_rule(prim, rule, (
        f"{prim.name}(x): scale unchanged (rescaled first to the largest scale along the "
        "reduced axes when it varies there); data the same op on data."
    ))


for _p in (lax.reduce_max_p, lax.reduce_min_p):
    register_scale_rule(_p)(
        _make_order(_p, lambda ps: (lambda a: a in ps["axes"]), lambda ps: ps["axes"])
    )
for _p in (lax.cummax_p, lax.cummin_p):
    register_scale_rule(_p)(_make_order(_p, lambda ps: (lambda a: a == ps["axis"]), lambda ps: ()))
for _p in (lax.reduce_window_max_p, lax.reduce_window_min_p):
    register_scale_rule(_p)(_make_order(_p, _window_varying, lambda ps: ()))


def _make_arg(prim):
    def rule(x: ScaledArray, *, axes, **params):
        data, _ = _align(x, lambda a: a in axes)
        return prim.bind(data, axes=axes, **params)

    return named_rule(prim, rule, (
        f"{prim.name}(x): unscaled integer output computed on data (the scale is positive; "
        "where it varies along the axis, on data rescaled to a common scale in float32+)."
    ))


for _p in (lax.argmax_p, lax.argmin_p):
    register_scale_rule(_p)(_make_arg(_p))


# ---------------------------------------------------------------------------------------
# Products: exact scale arithmetic on exponents
# ---------------------------------------------------------------------------------------
def _exponents(x: ScaledArray, axes):
    """Integer exponents of x's scale, broadcast along `axes` to the data's sizes there."""
    e = scale_exponent(x.scale)
    e = jnp.reshape(e, (1,) * (x.ndim - e.ndim) + tuple(e.shape))
    shape = tuple(x.shape[a] if a in axes else e.shape[a] for a in range(x.ndim))
    return jnp.broadcast_to(e, shape)


@register_scale_rule(lax.reduce_prod_p)
def _reduce_prod_rule(x: ScaledArray, *, axes, **params):
    """reduce_prod(x): scale prod(s_i) = 2^(sum of exponents) (exact; s^N for a scalar
    scale); data prod(d) in float32 or wider. Where the scale would over/underflow it is
    clipped and the remainder multiplied into data (what materialising would give)."""
    cdt = compute_dtype(x.dtype)
    e_sum = jnp.sum(_exponents(x, axes), axis=tuple(axes))
    scale, factor = scale_from_exponent(e_sum, cdt)
    data = lax.reduce_prod_p.bind(x.data.astype(cdt), axes=axes, **params) * factor
    if np.ndim(scale) and np.size(scale) == 1:
        scale = jnp.reshape(scale, ())
    return with_scale(data.astype(x.dtype), scale)


@register_scale_rule(lax.cumprod_p)
def _cumprod_rule(x: ScaledArray, *, axis, reverse):
    """cumprod(x): partial product i has scale prod_{j<=i} s_j = 2^(cumsum of exponents)
    (exact), so the output scale varies along the axis (shape 1 elsewhere for a scalar
    scale); data cumprod(d) in float32 or wider (clipped like reduce_prod)."""
    cdt = compute_dtype(x.dtype)
    e_cum = lax.cumsum(_exponents(x, (axis,)), axis=axis, reverse=reverse)
    scale, factor = scale_from_exponent(e_cum, cdt)
    data = lax.cumprod_p.bind(x.data.astype(cdt), axis=axis, reverse=reverse) * factor
    return with_scale(data.astype(x.dtype), scale)


# cumlogsumexp: log-domain output, computed on the materialised value, scale 1.
_cumlogsumexp_rule = make_unscaled_rule(lax.cumlogsumexp_p)
_cumlogsumexp_rule.__module__ = __name__
register_scale_rule(lax.cumlogsumexp_p)(_cumlogsumexp_rule)

# reduce_and / reduce_or / reduce_xor take bool/int inputs, which are never scaled: no rule.
# The generic `reduce_window_p` and `reduce_p` (user computation) have no rule: their
# computation's scale behaviour is unknown; wrap such code in `scalify.custom_scale`.
