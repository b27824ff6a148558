import functools

import jax
import jax.numpy as jnp
import numpy as np

import scalify
from scalify.nn import Dense, LayerNorm, gelu
from scalify.ops.fp8 import E4M3, E5M2

RNG = np.random.default_rng(0)
FP8 = functools.partial(
    Dense, input_dtype=E4M3, kernel_dtype=E4M3, grad_dtype=E5M2, output_dtype=jnp.float32
)


def test_fp8_dense_in_gpt_under_scalify():
    """The nanogpt model takes Dense and LayerNorm as injected classes: an FP8 GPT step runs
    under scalify and its loss matches the float32 model's."""
    from experiments.nanogpt.model import GPT, cross_entropy_loss, get_config

    common = dict(d_model=32, n_heads=2, n_layers=1, seq_len=8, vocab_size=64)
    fp8_cfg = get_config(
        "tiny", **common, dense_cls=FP8,
        layernorm_cls=functools.partial(LayerNorm, grad_rescale="l2"), activation=gelu,
    )
    ref_cfg = get_config("tiny", **common)
    tokens = jnp.asarray(RNG.integers(0, 64, (2, 9)), jnp.int32)
    params = GPT(ref_cfg).init(jax.random.PRNGKey(0), tokens[:, :-1])["params"]

    def loss(cfg):
        return lambda p, t: cross_entropy_loss(GPT(cfg).apply({"params": p}, t[:, :-1]), t[:, 1:])

    ref = loss(ref_cfg)(params, tokens)
    value, grads = jax.jit(scalify.scalify(jax.value_and_grad(loss(fp8_cfg))))(
        scalify.as_scaled_array(params), tokens
    )
    assert abs(float(scalify.asarray(value)) - float(ref)) < 0.05 * float(ref)
    for g in jax.tree.leaves(scalify.asarray(grads)):
        assert np.isfinite(np.asarray(g)).all()
