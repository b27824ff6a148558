"""scalify.recipes.FSDP: a recipe's step with its state sharded over 8 devices computes the
one-device step's values, gathers the FP8 matmul kernels as 1-byte words and compiles once."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scalify.recipes as R
from scalify.core.scaled_array import ScaledArray
from scalify.recipes.kernel_layout import TransposedKernel

from experiments.llama import model as llama

STEPS = 3


def _llama_problem():
    cfg = llama.get_config("tiny", d_model=64, n_layers=1, seq_len=16)
    model = llama.Llama(cfg, dtype=jnp.float32)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, cfg.seq_len + 1)).astype(np.int32)
    batch = (tokens[:, :-1], tokens[:, 1:])
    params = jax.jit(model.init)(jax.random.key(0), batch[0])

    def loss_fn(p, b):
        x, y = b
        logits = model.apply(p, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss_fn, params, batch


def test_fsdp_fp8_step_matches_one_device_and_gathers_kernels_as_bytes(mesh8):
    loss_fn, params, batch = _llama_problem()
    # SGD: the update is linear in the gradient, so the comparison is not the sign of
    # near-zero gradient entries (Adam's first steps are lr * sign(g)).
    tx = optax.sgd(0.1)
    one = R.FP8.train_step(loss_fn, tx)
    fsdp = R.FSDP(mesh8)
    sharded = R.FP8.train_step(loss_fn, tx, fsdp=fsdp)
    s1, s8 = one.init(params), sharded.init(params)
    # The state is cut over the devices: every FP8 kernel along one dimension, its scale replicated.
    kernels = [k for k in jax.tree_util.tree_leaves(s8.params, is_leaf=lambda x: isinstance(x, TransposedKernel))
               if isinstance(k, TransposedKernel)]
    assert kernels
    for k in kernels:
        assert isinstance(k.out_in, ScaledArray)
        assert "data" in k.out_in.data.sharding.spec and k.out_in.scale.sharding.is_fully_replicated
    placed = fsdp.place_batch(batch)
    l1, l8 = [], []
    for _ in range(STEPS):
        s1, m1 = one.step(s1, batch)
        s8, m8 = sharded.step(s8, placed)
        l1.append(float(m1["loss"]))
        l8.append(float(m8["loss"]))
    # The same values up to the order of the cross-device sums (float32 gradients within a
    # few ulps); an E5M2 gradient (2 mantissa bits) can round such a difference to the
    # neighbouring value, 2^-2 of one element, so the losses agree to 1e-4, not bit for bit.
    np.testing.assert_allclose(l8, l1, rtol=1e-4)
    assert l8[-1] < l8[0]
    # Shardings kept from step to step: one compilation.
    assert sharded.step._cache_size() == 1
    for k in jax.tree_util.tree_leaves(s8.params, is_leaf=lambda x: isinstance(x, TransposedKernel)):
        if isinstance(k, TransposedKernel):
            assert "data" in k.out_in.data.sharding.spec
    # The FP8 kernels cross the wire as E4M3 bytes (u8 all-gathers of a whole kernel).
    hlo = sharded.step.lower(s8, placed).compile().as_text()
    gathered = {tuple(int(d) for d in m.split(",")) for m in re.findall(r"u8\[([\d,]+)\]\{[^}]*\} all-gather", hlo)}
    shapes = {tuple(k.out_in.data.shape) for k in kernels}
    assert shapes <= gathered, (shapes, gathered)


def test_fsdp_refuses_a_batch_it_cannot_split(mesh8):
    fsdp = R.FSDP(mesh8)
    with pytest.raises(ValueError, match="multiple of 8"):
        fsdp.place_batch(np.zeros((12, 4), np.int32))
    with pytest.raises(ValueError, match="not 'model'"):
        R.FSDP(mesh8, axis="model")
