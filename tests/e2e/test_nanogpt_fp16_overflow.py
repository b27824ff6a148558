"""Regression: the `fp16` recipe (paper #1) must not overflow FP16 in the attention logits.

With float32 master weights re-scaled to unit RMS after each update (the former
``param_rescale="l2"``), a weight tensor whose energy sits in a few entries has data up to
sqrt(fan) there; on a residual stream with a massive dimension (LayerNorm data up to
sqrt(d)) the q and k data grow to ~sqrt(d)*sqrt(fan)/16 each, and the raw FP16 product
``q @ k`` sums d_head such products coherently: it overflowed to inf, and the softmax's
``logits - max`` made the loss NaN (the NaN validation loss of the `small` model on the
H100). With unit max-abs masters (``param_rescale="max"``) the same values have data <= 2.
The cuDNN flash attention (GPU) takes the q and k scales into the float16 q/k data; it must
stay finite on the same weights.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalify
from experiments.nanogpt import configs as C
from experiments.nanogpt import step as S

MODEL = dict(n_layers=1, d_model=256, n_heads=1, vocab_size=256, seq_len=8)


def _peaked_params(gpt):
    """Float32 GPT parameters with a massive residual dimension (token embedding column 0)
    read by a rank-one q/k direction (row 0 of the q and k kernels), small biases: the
    shape of trained attention weights, in miniature."""
    plain = C.get_recipe("fp32-plain")
    raw = S.init_state(plain, gpt, S.make_optimizer(plain, S.OptimConfig()), seed=0).params
    rng = np.random.default_rng(1)
    raw = jax.tree_util.tree_map_with_path(
        lambda path, v: 1e-3 * rng.standard_normal(v.shape) if "bias" in str(path[-1]) else np.array(v),
        raw)
    d = gpt.d_model
    raw["token_embed"]["embedding"][:, 0] = 2.0
    qkv = raw["block_0"]["attn"]["qkv"]["kernel"]
    qkv *= 0.1
    qkv[0, : 2 * d] = 0.1  # q and k of every token point the same way: logits ~ 20
    return jax.tree_util.tree_map(lambda v: jnp.asarray(v, jnp.float32), raw)


@pytest.mark.parametrize("attention", [
    "softmax",
    pytest.param("cudnn", marks=pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")),
])
def test_fp16_recipe_eval_stays_finite_on_peaked_attention(attention):
    recipe = C.get_recipe("fp16")
    gpt = S.gpt_config(recipe, "small", **MODEL, attention=attention)
    raw = _peaked_params(gpt)
    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(rng.integers(0, 256, (1, 8)), jnp.int32) for _ in range(2))
    # the float32 loss of the same values (jitted: one program rather than one per eager op)
    expected = float(jax.jit(S.make_loss_fn(S.gpt_config(C.get_recipe("fp32-plain"), "small", **MODEL)))(raw, {}, x, y))

    # One update with a zero learning rate: the values stay, the recipe re-scales the masters.
    tx = S.make_optimizer(recipe, S.OptimConfig(lr=0.0, warmup_steps=1, total_steps=2, weight_decay=0.0))
    state = S.init_state(recipe, gpt, tx)._replace(params=scalify.as_scaled_array(raw, scale=1.0))
    state, loss = S.make_train_step(recipe, gpt, tx)(state, x, y)
    assert np.isfinite(float(loss))
    valid = float(S.make_eval_step(recipe, gpt)(state.params, state.extra, x, y))
    assert np.isfinite(valid), valid  # was NaN: inf in the FP16 q @ k, then inf - inf
    np.testing.assert_allclose(valid, expected, rtol=2e-3)
    for leaf in jax.tree_util.tree_leaves(state.params, is_leaf=lambda v: isinstance(v, scalify.ScaledArray)):
        amax = float(np.max(np.abs(np.asarray(leaf.data, np.float32))))
        assert amax == 0.0 or 1.0 <= amax < 2.0, amax  # unit max-abs float32 masters
