"""LayerNorm with a scaled rule: normalise the data, output scale 1; optional dynamic
rescale of its input gradient.

    y = (x - mean(x)) / sqrt(var(x) + eps) * scale + bias

Scale rule (inside scalify, x = data * s with a power-of-two s, constant along the
normalised axes): the normalisation is computed on the data, with the epsilon expressed in
data units, so the output is the same value with scale 1:

    (x - mean x) / sqrt(var x + eps) = (d - mean d) * r / sqrt(var(d) r^2 + eps / u^2)

with u = max(s, 2^floor(log2 sqrt(eps))) and r = s / u (both powers of two, r <= 1,
eps / u^2 <= 1: nothing over- or underflows in float32 whatever s is). The residual
1/sigma is kept as a ScaledArray (data rsqrt(var(d) r^2 + eps/u^2), scale 1/u).

With `fast_variance` (flax.linen.LayerNorm's `use_fast_variance`, its default), the variance
is `max(mean(d^2) - mean(d)^2, 0)`, both means from one pass over the data, rather than
`mean((d - mean d)^2)`, which needs the mean first; float32 cancellation can then lose the
variance of a row whose mean is far above its spread, so the output is clipped to the
bound below, which the exact variance guarantees.

The normalised output is bounded, |y| <= sqrt(D) over D normalised elements (a row of mean
0 and mean square at most 1 has no element above sqrt(D - 1)), and declares it
(`custom_scale.defbounds`): its products with the affine weight, `y * scale` and, in the
backward pass, the weight gradient's `y * g`, are placed at the other factor's scale times
that bound, with no measurement (`scalify.core.value_bounds`).

Backward: `dx = (1/sigma) (g - mean(g) - y mean(g y))`, with a scale rule that computes
it on the gradient's data (scale: g's scale / u). With `grad_rescale` ("l2", "max", "l1"
or True for "l2") the input gradient is then dynamically rescaled to unit RMS / max /
mean-abs (`scalify.ops.rescale.unit_rescale`), the "LayerNorm backward rescale" of the
scalify paper's FP16 configuration. For "l2" on float16 gradients the norm comes from row
moments taken in the same pass as the backward's own row means (`_l2_rescaled_grad`), so
dx is written once, in its output dtype. Outside scalify all of this is plain math and the
rescale is the identity.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from scalify.core.config import get_config
from scalify.core.pow2 import pow2_round_down
from scalify.core.scale_flow import product_scale
from scalify.core.scaled_array import ScaledArray
from scalify.ops.custom_scale import custom_scale
from scalify.ops.rescale import rms, unit_rescale, unit_scale
from scalify.rules.common import align_scale, materialize

__all__ = ["LayerNorm", "layer_norm", "normalize"]

_F32 = jnp.float32
_RESCALE = {None: None, False: None, True: "l2", "l2": "l2", "max": "max", "l1": "l1"}


def _canon_axes(ndim: int, axes) -> tuple[int, ...]:
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    return tuple(sorted(a % ndim for a in axes))


# -- forward: normalisation ------------------------------------------------------------------
def _centred_variance(d, axes, fast: bool):
    """(d - mean d, variance of d over `axes`): two passes, or with `fast` one pass
    (`max(mean(d^2) - mean(d)^2, 0)`)."""
    mean = jnp.mean(d, axis=axes, keepdims=True)
    c = d - mean
    if fast:
        return c, jnp.maximum(jnp.mean(d * d, axis=axes, keepdims=True) - mean * mean, 0.0)
    return c, jnp.mean(c * c, axis=axes, keepdims=True)


def _output_bound(shape, axes) -> float:
    """sqrt(D), D the normalised size: the bound of the normalised output (module doc)."""
    return math.sqrt(max(math.prod(shape[a] for a in axes), 1))


def _bounded(y, axes, fast: bool):
    """y clipped to +-sqrt(D) with `fast` (a variance lost to cancellation), else y."""
    if not fast:
        return y
    bound = _output_bound(y.shape, axes)
    return jnp.clip(y, -bound, bound)


def _normalize_plain(x, axes, eps, fast):
    c, var = _centred_variance(x.astype(_F32), axes, fast)
    inv = jax.lax.rsqrt(var + eps)
    return _bounded(c * inv, axes, fast).astype(x.dtype), inv


_normalize = custom_scale(_normalize_plain, static_argnums=(1, 2, 3))


def _constant_over(x: ScaledArray, axes):
    """(data in float32, scale in float32 at the data's rank) with the scale made constant
    along `axes`: the largest among non-zero elements (`align_scale`)."""
    d, s = align_scale(x, axes, _F32)
    return d, s.astype(_F32)


@_normalize.defscale
def _normalize_scale(x: ScaledArray, axes, eps, fast):
    """normalize(x): data normalised with eps in data units; y scale 1, 1/sigma scale 1/u."""
    d, s = _constant_over(x, axes)
    # at most 2^126, so that 1/u is a normal float32 (exact: u is only the unit of the data)
    u = jnp.clip(s, pow2_round_down(jnp.sqrt(jnp.float32(eps))), jnp.float32(2.0**126))
    r = s / u
    c, var = _centred_variance(d, axes, fast)
    inv_d = jax.lax.rsqrt(var * (r * r) + eps / (u * u))
    sdtype = get_config().scale_dtype
    y = ScaledArray(_bounded(c * (r * inv_d), axes, fast).astype(x.dtype), jnp.ones((), sdtype))
    inv_scale = (1.0 / u).astype(sdtype)
    if inv_scale.size == 1:
        inv_scale = inv_scale.reshape(())
    return y, ScaledArray(inv_d, inv_scale)


@_normalize.defbounds
def _normalize_bounds(x, axes, eps, fast):
    """|y| <= sqrt(D) (D the normalised size): a row of D values with mean 0 and mean square
    at most 1 has no element above sqrt(D - 1). 1/sigma is unbounded."""
    return _output_bound(x.shape, axes), None


# -- backward ------------------------------------------------------------------------------------
def _normalize_grad_plain(g, y, inv, axes, rescale, dtype):
    del rescale  # the identity outside scalify
    gf, yf = g.astype(_F32), y.astype(_F32)
    core = gf - jnp.mean(gf, axis=axes, keepdims=True) - yf * jnp.mean(gf * yf, axis=axes, keepdims=True)
    return (inv.astype(_F32) * core).astype(dtype)


_normalize_grad = custom_scale(_normalize_grad_plain, static_argnums=(3, 4, 5))


@_normalize_grad.defscale
def _normalize_grad_scale(g: ScaledArray, y: ScaledArray, inv: ScaledArray, axes, rescale, dtype):
    """dx = (1/sigma)(g - mean g - y mean(g y)) on g's data: scale g.scale * inv.scale
    (`product_scale`: clamped to the scale range, the rest multiplied into the data, so a
    zero gradient whose scale shrank to the range's bottom never gets a zero scale); then,
    with `rescale`, a dynamic rescale of dx to unit norm."""
    gd, sg = _constant_over(g, axes)
    yv = materialize(y, _F32)
    mg = jnp.mean(gd, axis=axes, keepdims=True)
    mgy = jnp.mean(gd * yv, axis=axes, keepdims=True)
    scale, factor = product_scale(sg, jnp.asarray(inv.scale).astype(_F32))
    inv_d = inv.data.astype(_F32) * factor
    size = math.prod(gd.shape[a] for a in axes)
    if rescale == "l2" and scale.size == 1 and _l2_from_moments_ok(g.dtype, size):
        return _l2_rescaled_grad(gd, yv, mg, mgy, inv_d, scale.reshape(()), axes, size, dtype)
    data = inv_d * (gd - mg - yv * mgy)
    if scale.size == 1:
        scale = scale.reshape(())
    out = ScaledArray(data, scale.astype(get_config().scale_dtype))
    if rescale is not None:
        out = unit_rescale(out, rescale)
    return ScaledArray(out.data.astype(dtype), out.scale)


def _l2_from_moments_ok(dtype, size: int) -> bool:
    """Whether sums of `size` squares of `dtype` data stay far below float32's max (float16
    data: any realistic row length)."""
    return float(jnp.finfo(dtype).max) ** 2 * size < float(jnp.finfo(_F32).max) / 16


def _l2_rescaled_grad(gd, yv, mg, mgy, inv_d, scale, axes, size, dtype):
    """dx = inv_d (gd - mg - y mgy) (scale `scale`) rescaled to unit RMS, with the norm from
    row moments computed in the same pass as mg and mgy, so that dx is never stored in
    float32 and nothing reads gd and y twice before the output is written. Per row (D
    elements, Sg = D mg, Sgy = D mgy, Sgg, Sy, Syy the sums of g, g y, g^2, y, y^2):

        sum(core^2) = Sgg - D mg^2 - 2 mgy (Sgy - mg Sy) + mgy^2 Syy

    Float32 cancellation makes this uncertain by at most (D + 16) eps times the sum of the
    terms' magnitudes; a row whose value falls below that bound takes the bound (an upper
    estimate: its data comes out smaller, never larger). Then
    RMS = sqrt(mean_i inv_i^2 sum_i(core^2) / D) (relative to the largest row, no
    overflow), new scale = pow2_round(scale * RMS) (kept where 0 or not finite), data =
    gd a - (mg a + y mgy a) with a = inv_d scale / new scale."""
    sgg = jnp.sum(gd * gd, axis=axes, keepdims=True)
    sy = jnp.sum(yv, axis=axes, keepdims=True)
    syy = jnp.sum(yv * yv, axis=axes, keepdims=True)
    sgy = mgy * size
    terms = (sgg, -size * mg * mg, -2 * mgy * (sgy - mg * sy), mgy * mgy * syy)
    est = sum(terms)
    bound = (size + 16) * float(jnp.finfo(_F32).eps) * sum(jnp.abs(t) for t in terms)
    q = lax.stop_gradient(jnp.maximum(est, bound))
    r = lax.stop_gradient(inv_d) * jnp.sqrt(q / size)  # RMS of each row of dx
    norm = rms(r, tuple(range(r.ndim)), safe=True).reshape(())
    new = unit_scale(scale, norm)
    a = inv_d * (scale / new.astype(_F32))
    data = gd * a - (mg * a + yv * (mgy * a))
    return ScaledArray(data.astype(dtype), new)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _normalize_vjp(x, axes, eps, fast, rescale):
    return _normalize(x, axes, eps, fast)[0]


def _normalize_fwd(x, axes, eps, fast, rescale):
    y, inv = _normalize(x, axes, eps, fast)
    return y, (y, inv)


def _normalize_bwd(axes, eps, fast, rescale, res, g):
    y, inv = res
    return (_normalize_grad(g, y, inv, axes, rescale, jnp.dtype(y.dtype)),)


_normalize_vjp.defvjp(_normalize_fwd, _normalize_bwd)


def normalize(x, axes: int | Sequence[int] = -1, epsilon: float = 1e-6, grad_rescale=None,
              fast_variance: bool = False):
    """`(x - mean) / sqrt(var + epsilon)` over `axes` (statistics in float32, output in
    x's dtype), with the scaled rules and optional gradient rescale of the module doc.

    Args:
      x: float array.
      axes: normalised axes.
      epsilon: added to the variance.
      grad_rescale: None/False, True or "l2", "max", "l1": dynamic rescale of d(x)
        inside scalify (the identity outside).
      fast_variance: the variance as `mean(x^2) - mean(x)^2`, in one pass over x (module
        doc); False: `mean((x - mean x)^2)`.
    """
    if grad_rescale not in _RESCALE:
        raise ValueError(f"grad_rescale must be None, False, True, 'l2', 'max' or 'l1', got {grad_rescale!r}.")
    x = jnp.asarray(x)
    return _normalize_vjp(x, _canon_axes(x.ndim, axes), float(epsilon), bool(fast_variance), _RESCALE[grad_rescale])


def layer_norm(x, scale=None, bias=None, *, axes=-1, epsilon=1e-6, grad_rescale=None, dtype=None,
               fast_variance=False):
    """Functional LayerNorm: `normalize(x) * scale + bias` in `dtype` (default x's dtype).

    `scale` and `bias` broadcast against x (e.g. shape (features,) for axes=-1).
    """
    dtype = jnp.dtype(dtype or x.dtype)
    y = normalize(x, axes, epsilon, grad_rescale, fast_variance).astype(dtype)
    if scale is not None:
        y = y * jnp.asarray(scale).astype(dtype)
    if bias is not None:
        y = y + jnp.asarray(bias).astype(dtype)
    return y


class LayerNorm(nn.Module):
    """LayerNorm with scaled rules (same fields as flax.linen.LayerNorm's common ones).

    Attributes:
      epsilon: added to the variance.
      dtype: output dtype (default: the input's).
      param_dtype: dtype of scale and bias.
      use_bias, use_scale: learnable bias / scale.
      bias_init, scale_init: their initialisers.
      reduction_axes: normalised axes.
      feature_axes: axes of the scale and bias parameters.
      grad_rescale: dynamic rescale of the input gradient inside scalify (None, True,
        "l2", "max", "l1").
    """

    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: Any = nn.initializers.zeros_init()
    scale_init: Any = nn.initializers.ones_init()
    reduction_axes: Any = -1
    feature_axes: Any = -1
    grad_rescale: Any = None

    @nn.compact
    def __call__(self, x):
        """Normalise `x` over `reduction_axes`, then scale and shift."""
        x = jnp.asarray(x)
        feat = _canon_axes(x.ndim, self.feature_axes)
        pshape = tuple(x.shape[a] for a in feat)
        bshape = tuple(x.shape[a] if a in feat else 1 for a in range(x.ndim))
        scale = bias = None
        if self.use_scale:
            scale = self.param("scale", self.scale_init, pshape, self.param_dtype).reshape(bshape)
        if self.use_bias:
            bias = self.param("bias", self.bias_init, pshape, self.param_dtype).reshape(bshape)
        dtype = self.dtype or jnp.result_type(x, *(p for p in (scale, bias) if p is not None))
        return layer_norm(
            x, scale, bias, axes=self.reduction_axes, epsilon=self.epsilon,
            grad_rescale=self.grad_rescale, dtype=dtype,
        )

