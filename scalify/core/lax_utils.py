"""`jnp.where` / `jnp.clip` equivalents that emit plain lax ops.

`jnp.where` and `jnp.clip` are jitted functions: each call adds a nested `jit` equation to
the jaxpr. Scale rules call them on every equation of a scalified step (thousands of times
for a GPT step), and each nested jit costs tracing and lowering time. These helpers emit
the same math as `select_n` / `clamp` directly.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def select(pred, on_true, on_false):
    """`jnp.where(pred, on_true, on_false)` (broadcasting, dtype promotion) as `lax.select`."""
    pred, on_true, on_false = jnp.asarray(pred), jnp.asarray(on_true), jnp.asarray(on_false)
    dtype = jnp.result_type(on_true, on_false)
    shape = jnp.broadcast_shapes(pred.shape, on_true.shape, on_false.shape)
    return lax.select(
        jnp.broadcast_to(pred, shape),
        jnp.broadcast_to(on_true.astype(dtype), shape),
        jnp.broadcast_to(on_false.astype(dtype), shape),
    )


def clip(x, lo, hi):
    """`jnp.clip(x, lo, hi)` for scalar bounds, as `lax.clamp` in x's dtype."""
    x = jnp.asarray(x)
    return lax.clamp(jnp.asarray(lo, x.dtype), x, jnp.asarray(hi, x.dtype))
