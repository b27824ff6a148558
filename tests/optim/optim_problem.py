"""The small real problem of the optimizer tests and of benchmarks/optim_memory.py.

Teacher-student regression: 1024 Gaussian inputs in 16 dimensions are labelled by a fixed
random network `y = sin(1.5 x A) B` (A: 16x32, B: 32x4) plus 1% noise; a float32 student
MLP (16 -> 128 tanh -> 4, 2,692 params, fewer than the 4,096 targets, so the loss
converges to a well-defined approximation error instead of fitting the noise) is trained
full-batch with mean squared error for 300 steps of AdamW (lr 1e-2, weight decay 1e-4).
A whole run is one `jax.jit`-compiled `lax.scan`, so a trajectory costs one compile.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import scalify.optim as so

STEPS = 300
LR = 1e-2
IN, HIDDEN, OUT, N = 16, 128, 4, 1024


def data(seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (N, IN))
    a = jax.random.normal(k[1], (IN, 32)) / jnp.sqrt(IN)
    b = jax.random.normal(k[2], (32, OUT)) / jnp.sqrt(32)
    y = jnp.sin(1.5 * x @ a) @ b
    return x, y + 0.01 * jax.random.normal(k[3], y.shape)


def init_params(seed: int = 1):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "l1": {"w": jax.random.normal(k1, (IN, HIDDEN)) / jnp.sqrt(IN), "b": jnp.zeros(HIDDEN)},
        "l2": {"w": jax.random.normal(k2, (HIDDEN, OUT)) / jnp.sqrt(HIDDEN), "b": jnp.zeros(OUT)},
    }


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["l1"]["w"] + params["l1"]["b"])
    out = h @ params["l2"]["w"] + params["l2"]["b"]
    return jnp.mean((out - y) ** 2)


def train_step(tx, params, opt_state, key, x, y, rounding="nearest"):
    """One step; `params` may be scaled master weights (ScaledArray leaves)."""
    loss, grads = jax.value_and_grad(loss_fn)(so.values(params), x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    key, sub = jax.random.split(key)
    params = so.apply_updates(params, updates, rounding=rounding, key=sub)
    return params, opt_state, key, loss


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _run(tx, params, opt_state, steps, rounding, key, x, y):
    def body(carry, _):
        p, s, k = carry
        p, s, k, loss = train_step(tx, p, s, k, x, y, rounding)
        return (p, s, k), loss

    return jax.lax.scan(body, (params, opt_state, key), None, length=steps)


def run(tx, steps=STEPS, master_dtype=None, rounding="nearest", params=None, opt_state=None, key=None):
    """Train (from scratch, or from `params`/`opt_state`/`key`).

    Returns ((params, opt_state, key), losses[steps]). `master_dtype`: None for float32
    params, else params held as `scaled_params(params, master_dtype)`.
    """
    if params is None:
        params = init_params()
        if master_dtype is not None:
            params = jax.jit(so.scaled_params, static_argnums=1)(params, master_dtype)
    if opt_state is None:
        opt_state = jax.jit(tx.init)(params)  # one compile instead of many eager op compiles
    key = jax.random.key(7) if key is None else key
    # Committed arrays everywhere (a restored checkpoint is committed): one jit cache entry.
    args = jax.device_put((params, opt_state, key, *data()), jax.devices()[0])
    return _run(tx, *args[:2], steps, rounding, *args[2:])
