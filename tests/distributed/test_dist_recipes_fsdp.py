"""scalify.recipes.FSDP: a recipe's step with its state sharded over 8 devices computes the
one-device step's values and compiles once; `fp8_gather` moves the FP8 kernels as 1-byte
words with the same values."""
import re

import chex
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


def _losses(train, state, batch):
    losses = []
    for _ in range(STEPS):
        state, metrics = train.step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state


def _fp8_kernels(params):
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, TransposedKernel))
    return [k for k in leaves if isinstance(k, TransposedKernel)]


def test_fsdp_fp8_step_matches_one_device_and_can_gather_kernels_as_bytes(mesh8):
    loss_fn, params, batch = _llama_problem()
    # SGD: the update is linear in the gradient, so the comparison is not the sign of
    # near-zero gradient entries (Adam's first steps are lr * sign(g)).
    tx = optax.sgd(0.1)
    one = R.FP8.train_step(loss_fn, tx)
    fsdp = R.FSDP(mesh8)
    sharded = R.FP8.train_step(loss_fn, tx, fsdp=fsdp)
    s8 = sharded.init(params)
    # The state is cut over the devices: every FP8 kernel along one dimension, its scale replicated.
    kernels = _fp8_kernels(s8.params)
    assert kernels
    for k in kernels:
        assert isinstance(k.out_in, ScaledArray)
        assert "data" in k.out_in.data.sharding.spec and k.out_in.scale.sharding.is_fully_replicated
    placed = fsdp.place_batch(batch)
    l1, _ = _losses(one, one.init(params), batch)
    l8, s8 = _losses(sharded, s8, placed)
    # The same values up to the order of the cross-device sums (float32 gradients within a
    # few ulps); an E5M2 gradient (2 mantissa bits) can round such a difference to the
    # neighbouring value, 2^-2 of one element, so the losses agree to 1e-4, not bit for bit.
    np.testing.assert_allclose(l8, l1, rtol=1e-4)
    assert l8[-1] < l8[0]
    # Shardings kept from step to step: one compilation.
    assert sharded.step._cache_size() == 1
    assert all("data" in k.out_in.data.sharding.spec for k in _fp8_kernels(s8.params))

    # fp8_gather: every FP8 kernel crosses the wire as E4M3 words (u8 all-gathers of a
    # whole kernel), with the values of XLA's own plan (whose partitioned matmuls may sum
    # in another order: the tolerance above).
    forced = R.FP8.train_step(loss_fn, tx, fsdp=R.FSDP(mesh8, fp8_gather=True))
    state = forced.init(params)
    compiled = forced.step.lower(state, placed).compile()  # one compile, for the steps and the HLO
    lg = []
    for _ in range(STEPS):
        state, metrics = compiled(state, placed)
        lg.append(float(metrics["loss"]))
    np.testing.assert_allclose(lg, l8, rtol=1e-4)
    hlo = compiled.as_text()
    gathered = {tuple(int(d) for d in m.split(",")) for m in re.findall(r"u8\[([\d,]+)\]\{[^}]*\} all-gather", hlo)}
    shapes = {tuple(k.out_in.data.shape) for k in kernels}
    assert shapes <= gathered, (shapes, gathered)


def test_fsdp_refuses_a_batch_it_cannot_split(mesh8):
    fsdp = R.FSDP(mesh8)
    with pytest.raises(ValueError, match="multiple of 8"):
        fsdp.place_batch(np.zeros((12, 4), np.int32))
    with pytest.raises(ValueError, match="not 'model'"):
        R.FSDP(mesh8, axis="model")


def test_host_copy_puts_back_each_shard_on_its_device(mesh42):
    """The host copy that measuring calls restore the state from (`_HostCopy`): arrays
    sharded along one mesh axis and replicated along the other, fully replicated and
    single-device come back with their values, shardings and dtypes (float8 included),
    after the originals are deleted (as a donating step deletes them)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from scalify.recipes.train_step import _HostCopy

    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    tree = {
        "sharded": jax.device_put(x, NamedSharding(mesh42, P("data", None))),
        "both": jax.device_put(x, NamedSharding(mesh42, P("data", "model"))),
        "replicated": jax.device_put(x.astype(jnp.float8_e4m3fn), NamedSharding(mesh42, P())),
        "one": jax.device_put(np.float32(3.0), jax.devices()[1]),
        "static": 7,
    }
    want = jax.device_get(tree)
    shardings = {k: v.sharding for k, v in tree.items() if isinstance(v, jax.Array)}
    kept = _HostCopy(tree)
    for v in jax.tree_util.tree_leaves(tree):
        if isinstance(v, jax.Array):
            v.delete()
    back = kept.restore()
    chex.assert_trees_all_equal(jax.device_get(back), want)
    for k, s in shardings.items():
        assert back[k].sharding == s and back[k].dtype == want[k].dtype, k
