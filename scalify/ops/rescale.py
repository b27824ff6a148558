"""Dynamic and delayed rescaling: choose a scale from the statistics of the data.

Dynamic (just-in-time) rescaling, inside `scalify`:

    dynamic_rescale_<norm>(x) = ScaledArray(x.data * s / s', s'),  s' = pow2_round(s * n)

with `n` the norm of the data: mean |data| (l1), sqrt(mean data^2) (l2, RMS) or max |data|
(max), computed in float32 (or wider). The data then has unit l1-mean / RMS / max-abs (in
[1, 2) with the default round-down mode). Where the norm is 0, inf or nan, or the new scale
would under- or overflow, the scale is kept (so zeros, infinities and nan stay as they are).
Outside scalify these ops are the identity; their derivative is the identity.

`dynamic_rescale_<norm>_grad(x)` is the identity in the forward pass and applies the same
dynamic rescale to the gradient in the backward pass: under `scalify(jax.grad(f))` the
cotangent of `x` is rescaled (it becomes scaled if it was not). It is a linear primitive
whose transpose is `dynamic_rescale_<norm>` (rather than a `jax.custom_vjp`), so that it needs
no scale rule for custom_vjp calls and works under `jax.vmap`.

Under `jax.vmap`, norms are taken per example (the scale gets a batch dimension).

Delayed rescaling (TransformerEngine-style, statistics of the previous steps kept in state):

    state = delayed_scaling_init(history_len=16)
    y, state = delayed_rescale(x, state)   # y: x with the scale chosen from earlier steps

The scale used at a step comes from the max-abs history of the previous steps, so no
reduction of `x` sits on the critical path before `x` is used.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad, batching

from scalify.core.config import get_config
from scalify.core.errors import ScaleError
from scalify.core.pow2 import pow2_round, pow2_round_down, pow2_round_up
from scalify.core.scaled_array import ScaledArray, compute_dtype
from scalify.core.scale_flow import known_max_abs, note_max_abs
from scalify.core.guards import delayed_estimate
from scalify.quant.formats import saturating_cast
from scalify.core.registry import register_scale_rule
from scalify.ops._common import check_float, check_pow2, define_primitive, scalified
from scalify.ops.scaling import set_scaling, stop_scaling
from scalify.rules.common import scalar_scale

__all__ = [
    "dynamic_rescale_l1",
    "dynamic_rescale_l2",
    "dynamic_rescale_max",
    "dynamic_rescale_l1_grad",
    "dynamic_rescale_l2_grad",
    "dynamic_rescale_max_grad",
    "DelayedScalingState",
    "delayed_scaling_init",
    "delayed_rescale",
    "dynamic_rescale_p",
    "dynamic_rescale_grad_p",
]

_NORMS = ("l1", "l2", "max")


def _aval(x, **_):
    return jax.core.ShapedArray(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False))


def _identity(x, **_):
    return x


def _batch(prim):
    """Under vmap the norm is per example: the batch axis joins `batch_axes`."""

    def rule(args, dims, *, norm, batch_axes):
        (x,), (bx,) = args, dims
        x = jnp.moveaxis(x, bx, 0)
        axes = (0,) + tuple(a + 1 for a in batch_axes)
        return prim.bind(x, norm=norm, batch_axes=axes), 0

    return rule


dynamic_rescale_p = define_primitive("dynamic_rescale", _identity, _aval)
ad.defjvp(dynamic_rescale_p, lambda g, x, **_: g)
batching.primitive_batchers[dynamic_rescale_p] = _batch(dynamic_rescale_p)

dynamic_rescale_grad_p = define_primitive("dynamic_rescale_grad", _identity, _aval)
batching.primitive_batchers[dynamic_rescale_grad_p] = _batch(dynamic_rescale_grad_p)


def _grad_jvp(primals, tangents, **params):
    # Forward: the identity (no op left in the primal graph). Tangent: this linear op, whose
    # transpose rescales the cotangent.
    (x,), (t,) = primals, tangents
    if type(t) is ad.Zero:
        return x, t
    return x, dynamic_rescale_grad_p.bind(t, **params)


def _grad_transpose(ct, x, **params):
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    return [dynamic_rescale_p.bind(ct, **params)]


ad.primitive_jvps[dynamic_rescale_grad_p] = _grad_jvp
ad.primitive_transposes[dynamic_rescale_grad_p] = _grad_transpose


def _dynamic(prim, x, norm: str, op: str):
    check_float(x, op)
    if isinstance(x, ScaledArray):
        return scalified(_BOUND[prim, norm])(x)
    return prim.bind(jnp.asarray(x), norm=norm, batch_axes=())


def dynamic_rescale_l1(x):
    """Rescale x so that its data has unit mean absolute value (inside scalify); identity
    outside. See the module docstring."""
    return _dynamic(dynamic_rescale_p, x, "l1", "dynamic_rescale_l1")


def dynamic_rescale_l2(x):
    """Rescale x so that its data has unit RMS (inside scalify); identity outside."""
    return _dynamic(dynamic_rescale_p, x, "l2", "dynamic_rescale_l2")


def dynamic_rescale_max(x):
    """Rescale x so that its data has unit max-abs (inside scalify); identity outside."""
    return _dynamic(dynamic_rescale_p, x, "max", "dynamic_rescale_max")


def dynamic_rescale_l1_grad(x):
    """Identity forward; `dynamic_rescale_l1` on the gradient of x in the backward pass."""
    return _dynamic(dynamic_rescale_grad_p, x, "l1", "dynamic_rescale_l1_grad")


def dynamic_rescale_l2_grad(x):
    """Identity forward; `dynamic_rescale_l2` on the gradient of x in the backward pass."""
    return _dynamic(dynamic_rescale_grad_p, x, "l2", "dynamic_rescale_l2_grad")


def dynamic_rescale_max_grad(x):
    """Identity forward; `dynamic_rescale_max` on the gradient of x in the backward pass."""
    return _dynamic(dynamic_rescale_grad_p, x, "max", "dynamic_rescale_max_grad")


_BOUND = {
    (dynamic_rescale_p, "l1"): dynamic_rescale_l1,
    (dynamic_rescale_p, "l2"): dynamic_rescale_l2,
    (dynamic_rescale_p, "max"): dynamic_rescale_max,
    (dynamic_rescale_grad_p, "l1"): dynamic_rescale_l1_grad,
    (dynamic_rescale_grad_p, "l2"): dynamic_rescale_l2_grad,
    (dynamic_rescale_grad_p, "max"): dynamic_rescale_max_grad,
}


# ---------------------------------------------------------------------------------------
# Scale rules
# ---------------------------------------------------------------------------------------
def _may_overflow(dtype, cdt, size: int, power: int) -> bool:
    """Whether a sum of `size` |data|^power can overflow the compute dtype."""
    return power * math.log2(float(jnp.finfo(dtype).max)) + math.log2(max(size, 1)) >= math.log2(
        float(jnp.finfo(cdt).max)
    )


def _norm(v, axes, norm: str, safe: bool, amax=None):
    """(norm, max-abs) of `v` over `axes`: the l1-mean, RMS or max-abs (keepdims), and the
    max-abs (reduced axes dropped) where it was measured or given (`amax`, e.g. a guard's
    earlier measurement), else None. With `safe`, v is first divided by the power of two of
    its max-abs, so sums of large float32 values cannot overflow.
    (The reductions drop the reduced axes and the result is reshaped at the end: XLA:GPU
    failed to compile a `mean` over every axis of a 3-d gradient kept as shape (1, 1, 1),
    its 1/n constant rewritten with the wrong shape.)"""
    keep = tuple(1 if i in axes else d for i, d in enumerate(v.shape))
    a = jnp.abs(v)
    if amax is None and (norm == "max" or safe):
        amax = jnp.max(a, axis=axes, initial=0.0)
    if norm == "max":
        return amax.reshape(keep), amax
    m = jnp.ones(tuple(d for i, d in enumerate(v.shape) if i not in axes), v.dtype)
    if safe:
        m = pow2_round_down(amax)
        m = jnp.where(jnp.isfinite(m) & (m > 0), m, 1)
        a = a / m.reshape(keep)
    if norm == "l1":
        return (m * jnp.mean(a, axis=axes)).reshape(keep), amax
    return (m * jnp.sqrt(jnp.mean(a * a, axis=axes))).reshape(keep), amax


def rms(v, axes, safe: bool = False):
    """sqrt(mean(v^2)) over `axes` (kept as size 1); with `safe`, taken relative to the power
    of two of max|v| so that the squares cannot overflow (`_norm`)."""
    return _norm(v, tuple(axes), "l2", safe)[0]


def unit_scale(scale, norm):
    """The power of two `pow2_round(scale * norm)` in the scale dtype that gives data of
    norm `norm` at `scale` unit norm; `scale` itself where that is 0 or not finite. No
    gradient flows into it."""
    sdtype = get_config().scale_dtype
    new = pow2_round(lax.stop_gradient(scale * norm).astype(sdtype))
    return jnp.where(jnp.isfinite(new) & (new > 0), new, jnp.asarray(scale).astype(sdtype))


def unit_rescale(x: ScaledArray, norm: str, batch_axes=()) -> ScaledArray:
    """`x` with a power-of-two scale that gives its data unit l1-mean / RMS / max-abs.

    Norms are over all axes but `batch_axes` (the output scale keeps those axes, size 1
    elsewhere). The scale is kept where the norm is 0, inf or nan or the new scale is not a
    finite positive number. No gradient flows into the choice of the scale.

    With one scale and no batch axes, a max-abs of the data that a guard already measured
    (`known_max_abs`) is used instead of measuring it again, and the output's max-abs (the
    input's times the power-of-two ratio of the scales, rounded as the data) is recorded
    for the guards that read the output (the power guard of Adam's `g * g` after a gradient
    rescale). Under delayed statistics (`scalify.core.statistics`) such a norm comes from
    the previous step's record and the data saturate at the dtype's largest value.
    """
    if norm not in _NORMS:
        raise ValueError(f"norm must be one of {_NORMS}, got {norm!r}.")
    sdtype = get_config().scale_dtype
    cdt = compute_dtype(x.dtype)
    axes = tuple(a for a in range(x.ndim) if a not in batch_axes)
    s = jnp.asarray(x.scale).astype(cdt)
    v = x.data.astype(cdt)
    whole = scalar_scale(x) and not batch_axes
    if scalar_scale(x):
        s_ref = s.reshape(())
    else:
        # Several scales: measure the data relative to the largest one (exact ratios).
        s_ref = jnp.max(jnp.broadcast_to(s, x.shape), axis=axes, keepdims=True)
        v = v * (s / s_ref)
    size = math.prod(x.shape[a] for a in axes)
    power = {"l1": 1, "l2": 2, "max": 0}[norm]
    known = known_max_abs(x.data) if whole else None
    n, amax = _norm(lax.stop_gradient(v), axes, norm, _may_overflow(x.dtype, cdt, size, power),
                    None if known is None else known.astype(cdt))
    delayed = False
    if whole and known is None:  # under delayed statistics: the norm of the previous step
        estimate, delayed = delayed_estimate(lambda: n.reshape(()), s_ref)
        if delayed:
            n = estimate.astype(cdt).reshape(n.shape)
    new = unit_scale(s_ref, n)
    if not batch_axes:
        new = new.reshape(())
    ratio = s_ref / new.astype(cdt)
    data = v * ratio
    # delayed: a norm that grew past the estimate saturates rather than overflows
    data = saturating_cast(data, x.dtype) if delayed else data.astype(x.dtype)
    if whole and amax is not None and not delayed:
        note_max_abs(data, lax.stop_gradient(amax * ratio).astype(x.dtype).astype(jnp.float32))
    return ScaledArray(data, new)


@register_scale_rule(dynamic_rescale_p, always=True)
def _dynamic_rescale_rule(x: ScaledArray, *, norm, batch_axes):
    """dynamic_rescale(x): scale s' = pow2_round(s * norm(x.data)) (s kept where the norm is
    0/inf/nan); data x.data * s / s' (unit l1-mean / RMS / max-abs)."""
    return unit_rescale(x, norm, batch_axes)


@register_scale_rule(dynamic_rescale_grad_p)
def _dynamic_rescale_grad_rule(x: ScaledArray, **_):
    """dynamic_rescale_grad(x) in the forward pass: the identity (scale and data unchanged)."""
    return x


# ---------------------------------------------------------------------------------------
# Delayed rescaling
# ---------------------------------------------------------------------------------------
class DelayedScalingState(NamedTuple):
    """State of `delayed_rescale`: statistics of the previous steps (plain arrays)."""

    amax_history: jax.Array  # shape=(history_len,), float32; most recent first
    scale: jax.Array  # shape=(), scale dtype; power of two used by the next call


def delayed_scaling_init(history_len: int = 16, scale=1.0) -> DelayedScalingState:
    """Initial `DelayedScalingState`: an empty (zero) amax history and `scale` for step one.

    Args:
      history_len: number of previous steps whose max-abs is kept.
      scale: power of two used by the first call (default 1).
    """
    if history_len < 1:
        raise ValueError(f"history_len must be >= 1, got {history_len}.")
    check_pow2(scale, "scale", "delayed_scaling_init")
    return DelayedScalingState(
        amax_history=jnp.zeros((history_len,), jnp.float32),
        scale=jnp.asarray(scale, get_config().scale_dtype),
    )


def delayed_rescale(x, state: DelayedScalingState, *, target: float = 1.0, margin: int = 0):
    """Set x's scale from the statistics of previous steps; record x's max-abs for the next.

    TransformerEngine's "delayed scaling" recipe with power-of-two scales:

        y = set_scaling(x, state.scale)
        amax_history <- [max|x|, amax_history[:-1]]
        next scale = 2^margin * pow2_round_up(max(amax_history) / target)

    so that |data| <= target while the max-abs does not grow (e.g. `target=448.0` to fill
    the E4M3 range, with `margin=1` for headroom). A zero or non-finite history keeps the
    previous scale. Outside scalify `y` is `x`; the state is updated all the same. The
    gradient of `y` is the identity; no gradient flows into the state.

    Args:
      x: a floating-point array (or ScaledArray).
      state: a `DelayedScalingState` of plain arrays (from `delayed_scaling_init`).
      target: max-abs the data should have.
      margin: extra power-of-two headroom (scale multiplied by 2^margin).
    Returns:
      `(y, new_state)`.
    """
    check_float(x, "delayed_rescale")
    if isinstance(state.scale, ScaledArray) or isinstance(state.amax_history, ScaledArray):
        raise ScaleError(
            "scalify.delayed_rescale: the state must hold plain arrays, got ScaledArray. Keep "
            "the DelayedScalingState out of `as_scaled_array`."
        )
    y = set_scaling(x, state.scale)
    amax = jnp.max(jnp.abs(stop_scaling(x, jnp.float32)), initial=0.0)
    amax = lax.stop_gradient(amax)
    history = jnp.roll(state.amax_history, 1).at[0].set(amax)
    wanted = jnp.max(history) / jnp.asarray(target, jnp.float32)
    scale = pow2_round_up(wanted.astype(state.scale.dtype)) * jnp.asarray(
        2.0**margin, state.scale.dtype
    )
    scale = jnp.where(jnp.isfinite(scale) & (scale > 0), scale, state.scale)
    return y, DelayedScalingState(amax_history=history, scale=scale)
