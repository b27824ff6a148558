"""Activations with scale rules: `relu`, `gelu`, `silu`.

Each is `f(x) = x * g(x)` with a bounded gate `g` (in [0, 1]), so the output keeps the input
scale: the rule computes `g` on the materialised value in float32 and multiplies the data by
it (no overflow possible in any data dtype). Outside scalify they equal `jax.nn.relu`,
`jax.nn.gelu`, `jax.nn.silu`, special values included (gelu(-inf) and silu(-inf) are nan in
both, as in JAX).

The derivative is given by a `jax.custom_jvp` as `t * f'(x)`, where `f'` is itself a
`custom_scale` function: its rule computes the (bounded) derivative on the materialised value
in float32 with output scale 1, so under `scalify(jax.grad(f))` the backward pass needs only
the `mul` rule and keeps the cotangent's scale. `f'` is JAX's own derivative of the plain
function (`jax.jvp`), so gradients equal those of `jax.nn.*` outside scalify.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify.core.scaled_array import ScaledArray
from scalify.ops.custom_scale import custom_scale
from scalify.rules.common import materialize, unit_scale_like

__all__ = ["relu", "gelu", "silu"]


def _gelu_tanh_gate(v):
    # Same expression as jax.nn.gelu(approximate=True) = x * gate(x).
    c = np.sqrt(2 / np.pi).astype(v.dtype)
    return 0.5 * (1.0 + jnp.tanh(c * (v + 0.044715 * (v**3))))


def _gelu_erf_gate(v):
    # jax.nn.gelu(approximate=False) = 0.5 * x * erfc(-x / sqrt(2)); 0.5 moves exactly.
    return 0.5 * lax.erfc(-v * np.sqrt(0.5).astype(v.dtype))


def _derivative(name: str, plain):
    """`plain'(x)` elementwise as a custom_scale function (unscaled output, scale 1)."""

    def prime(x):
        return jax.jvp(plain, (x,), (jnp.ones_like(x),))[1]

    prime.__name__ = prime.__qualname__ = f"{name}_derivative"
    cs = custom_scale(prime)

    @cs.defscale
    def _prime_scale(x: ScaledArray):
        """f'(x): bounded; computed on the materialised value in float32; output scale 1."""
        # The barrier keeps XLA from sharing the activation's materialised float32 input
        # (the same expression) between this and the forward rule: XLA would then store
        # that float32 tensor for the backward pass instead of recomputing it from the
        # 16-bit data.
        data = lax.optimization_barrier(x.data)
        return unit_scale_like(prime(materialize(ScaledArray(data, x.scale))).astype(x.dtype))

    return cs


def _activation(name: str, plain, scale_rule):
    """A custom_scale activation whose JVP is `t * plain'(x)` with a custom_scale `plain'`."""
    derivative = _derivative(name, plain)

    def fn(x):
        return plain(x)

    fn.__name__ = fn.__qualname__ = name
    fn = jax.custom_jvp(fn)
    act = custom_scale(fn)
    act.defscale(scale_rule)

    @fn.defjvp
    def _fn_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return act(x), t * derivative(x)

    return act


def _gated_rule(gate):
    def rule(x: ScaledArray) -> ScaledArray:
        """x * g(x): scale unchanged; data x.data * g(value), g in [0, 1] computed in float32."""
        g = gate(materialize(x))
        return ScaledArray((x.data.astype(g.dtype) * g).astype(x.dtype), x.scale)

    return rule


def _relu_rule(x: ScaledArray) -> ScaledArray:
    """relu(x): scale unchanged (> 0); data relu(x.data) (exact)."""
    return ScaledArray(jax.nn.relu(x.data), x.scale)


_relu = _activation("relu", jax.nn.relu, _relu_rule)
_silu = _activation("silu", jax.nn.silu, _gated_rule(jax.nn.sigmoid))
_gelu_tanh = _activation(
    "gelu_tanh", functools.partial(jax.nn.gelu, approximate=True), _gated_rule(_gelu_tanh_gate)
)
_gelu_erf = _activation(
    "gelu_erf", functools.partial(jax.nn.gelu, approximate=False), _gated_rule(_gelu_erf_gate)
)


def _check(x, op):
    x = x if isinstance(x, ScaledArray) else jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"scalify.ops.{op} expects a floating-point array, got {x.dtype}.")
    return x


def relu(x):
    """max(x, 0) (as `jax.nn.relu`, derivative 0 at 0); inside scalify keeps x's scale."""
    return _relu(_check(x, "relu"))


def silu(x):
    """x * sigmoid(x) (as `jax.nn.silu`); inside scalify keeps x's scale."""
    return _silu(_check(x, "silu"))


def gelu(x, approximate: bool = True):
    """GELU (as `jax.nn.gelu`, tanh approximation by default); inside scalify keeps x's scale.

    Args:
      x: a floating-point array.
      approximate: tanh approximation (True) or the exact erf form (False).
    """
    return (_gelu_tanh if approximate else _gelu_erf)(_check(x, "gelu"))
