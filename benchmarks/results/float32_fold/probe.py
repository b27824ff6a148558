"""HLO instructions of the 2-layer MLP + Adam step (tests/core/test_hlo_size.py) and of the
NanoGPT `tiny` fp32 / fp16 / fp8 steps, scalified and plain, on this backend.

    python benchmarks/results/float32_fold/probe.py                 # as committed
    git apply benchmarks/results/float32_fold/fold.patch
    STATIC32=1 python benchmarks/results/float32_fold/probe.py      # float32 scales folded
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import scalify
from experiments.nanogpt import configs as C
from experiments.nanogpt import step as S
from scalify.inspect import hlo_instruction_count


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.gelu(nn.Dense(32)(x)))


def mlp_adam():
    model, x, y = _MLP(), jnp.ones((8, 16)), jnp.zeros((8, 1))
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    tx = optax.adam(1e-3)

    def step(p, s, x, y):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    state = tx.init(params)
    plain = jax.jit(step).lower(params, state, x, y).compile()
    scaled = jax.jit(scalify.scalify(step)).lower(scalify.as_scaled_array(params), state, x, y).compile()
    out = jax.jit(scalify.scalify(step))(scalify.as_scaled_array(params), state, x, y)
    ref = jax.jit(step)(params, state, x, y)
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(jax.tree.leaves(scalify.asarray(out)), jax.tree.leaves(ref)))
    return hlo_instruction_count(plain), hlo_instruction_count(scaled), err


if __name__ == "__main__":
    p, s, err = mlp_adam()
    print(f"MLP + Adam: plain {p:,}, scalified {s:,} ({s / p:.2f}x), max |difference| {err:.2g}")
    for recipe in ("fp32", "fp16", "fp8"):
        pair = S.abstract_step_pair(C.get_recipe(recipe), "tiny", seq_len=64, batch_size=8)
        n = hlo_instruction_count(pair.scaled().lower(*pair.args).compile())
        m = hlo_instruction_count(pair.plain().lower(*pair.plain_args).compile())
        print(f"NanoGPT tiny {recipe}: plain {m:,}, scalified {n:,} ({n / m:.2f}x)", flush=True)
