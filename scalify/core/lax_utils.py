"""Small lax-level helpers: `jnp.where` / `jnp.clip` equivalents that emit plain lax ops,
and `widen`, the FP8-safe up-cast.

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


def widen(x, dtype):
    """``x`` converted to a wider float ``dtype``, keeping the rounding of FP8 data.

    FP8 data first passes a ``lax.optimization_barrier``: XLA's GPU compiler folds
    ``convert(convert(v, f8), f32)`` into ``v`` (measured on an H100 with jax 0.11.2 by
    ``tools/fp8_convert_probe.py``: every value came back unrounded), which silently drops
    the FP8 quantisation wherever a value is quantised and dequantised in one jitted
    function (and, for FP8 matmuls, keeps XLA from forming the FP8 GEMM).
    """
    x = jnp.asarray(x)
    if x.dtype.itemsize == 1 and jnp.issubdtype(x.dtype, jnp.floating):
        x = lax.optimization_barrier(x)
    return x.astype(dtype)
