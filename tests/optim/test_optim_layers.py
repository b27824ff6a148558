"""StableEmbedding (Dettmers et al. 2022): Xavier uniform init, LayerNorm on the output."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalify.optim as so


def test_stable_embedding_init_and_normalised_output():
    layer = so.StableEmbedding(num_embeddings=500, features=64)
    ids = jnp.array([[0, 3, 499], [7, 7, 1]])
    variables = jax.jit(layer.init)(jax.random.key(0), ids)
    table = variables["params"]["embedding"]
    bound = np.sqrt(6.0 / (500 + 64))
    assert table.shape == (500, 64)
    assert float(jnp.max(jnp.abs(table))) <= bound
    assert float(jnp.max(jnp.abs(table))) > 0.9 * bound  # uniform up to the bound
    assert set(variables["params"]["norm"]) == {"scale", "bias"}
    out = jax.jit(layer.apply)(variables, ids)
    assert out.shape == (2, 3, 64)
    np.testing.assert_allclose(np.asarray(out.mean(-1)), 0.0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.var(-1)), 1.0, rtol=5e-3)  # epsilon=1e-5 vs var ~3e-3
    logits = jax.eval_shape(lambda v, o: layer.apply(v, o, method=so.StableEmbedding.attend), variables, out)
    assert logits.shape == (2, 3, 500)


def test_stable_embedding_dtype_and_errors():
    layer = so.StableEmbedding(num_embeddings=10, features=8, dtype=jnp.bfloat16)
    variables = jax.eval_shape(layer.init, jax.random.key(1), jnp.zeros((2,), jnp.int32))
    assert variables["params"]["embedding"].dtype == jnp.float32
    assert jax.eval_shape(layer.apply, variables, jnp.array([1, 2])).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="integer token ids"):
        jax.eval_shape(layer.apply, variables, jnp.ones((2,)))


def test_stable_embedding_params_get_8bit_moments():
    """bitsandbytes keeps tensors of >= 4096 elements in 8 bits: a 64 x 64 table does."""

    class Model(nn.Module):
        @nn.compact
        def __call__(self, ids):
            return nn.Dense(4)(so.StableEmbedding(64, 64)(ids)).mean(1)

    params = jax.eval_shape(Model().init, jax.random.key(4), jnp.zeros((2, 5), jnp.int32))
    state = jax.eval_shape(so.adamw_8bit(1e-2).init, params)
    stored = [x for x in jax.tree.leaves(state, is_leaf=so.is_stored_leaf) if so.is_stored_leaf(x)]
    assert len(stored) == 2 and all(isinstance(x, so.BlockwiseArray) for x in stored)
    assert stored[0].shape == (64, 64)
