import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalify
import scalify.ops
from scalify.nn import LayerNorm, gelu, layer_norm, normalize, relu, silu

RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.standard_normal((4, 8, 32)) * 3 + 1, jnp.float32)
G = jnp.asarray(RNG.standard_normal((4, 8, 32)), jnp.float32)
VARS = LayerNorm().init(jax.random.PRNGKey(0), X)
VARS = jax.tree.map(lambda p: p + jnp.asarray(RNG.standard_normal(p.shape) * 0.1, p.dtype), VARS)


def _loss(module):
    return lambda v, x: jnp.sum(module.apply(v, x).astype(jnp.float32) * G)


def test_matches_flax_layernorm():
    np.testing.assert_allclose(LayerNorm().apply(VARS, X), fnn.LayerNorm().apply(VARS, X), atol=2e-6)
    ref = jax.grad(_loss(fnn.LayerNorm()), argnums=(0, 1))(VARS, X)
    got = jax.grad(_loss(LayerNorm()), argnums=(0, 1))(VARS, X)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)
    # Outside scalify the gradient rescale is the identity.
    g2 = jax.grad(_loss(LayerNorm(grad_rescale="max")), argnums=1)(VARS, X)
    np.testing.assert_array_equal(g2, got[1])


def test_bf16_dtype_and_axes():
    y = LayerNorm(dtype=jnp.bfloat16).apply(VARS, X)
    assert y.dtype == jnp.bfloat16
    ref = fnn.LayerNorm(dtype=jnp.bfloat16).apply(VARS, X)
    np.testing.assert_allclose(y.astype(jnp.float32), ref.astype(jnp.float32), atol=2e-2)
    z = normalize(X, axes=(1, 2))
    np.testing.assert_allclose(jnp.mean(z, axis=(1, 2)), 0.0, atol=1e-5)
    np.testing.assert_allclose(jnp.var(z, axis=(1, 2)), 1.0, atol=1e-4)
    with pytest.raises(ValueError, match="grad_rescale"):
        normalize(X, grad_rescale="rms")


@pytest.mark.parametrize("scale", [2.0**-20, 2.0**-7, 2.0**20])
@pytest.mark.parametrize("rescale", [None, "l2"])
def test_scalified_layernorm_equals_plain(scale, rescale):
    """Model invariance: same value (eps acts on the value), output scale 1, same gradient."""
    xs = X * scale
    sx = scalify.as_scaled_array(xs, scale=jnp.float32(scale))
    f = jax.value_and_grad(_loss(LayerNorm(grad_rescale=rescale)), argnums=1)
    ref_v, ref_g = f(VARS, xs)
    v, g = jax.jit(scalify.scalify(f))(VARS, sx)
    np.testing.assert_allclose(scalify.asarray(v), ref_v, rtol=1e-5)
    np.testing.assert_allclose(scalify.asarray(g), ref_g, rtol=1e-5, atol=1e-6 * float(jnp.abs(ref_g).max()))
    y = jax.jit(scalify.scalify(lambda x: LayerNorm().apply(VARS, x)))(sx)
    assert isinstance(y, scalify.ScaledArray)
    np.testing.assert_allclose(scalify.asarray(y), LayerNorm().apply(VARS, xs), atol=3e-6)
    if rescale:  # the gradient data has unit RMS in [1, 2) (round-down mode)
        rms = float(jnp.sqrt(jnp.mean(g.data.astype(jnp.float32) ** 2)))
        assert 1.0 <= rms < 2.0
    else:  # gradient scale = g's scale / u: tiny for scale 2^20 (1/sigma ~ 2^-20)
        assert float(g.scale) != 1.0


def test_float16_data_at_extreme_scale():
    """float16 data of value ~2^20 (beyond float16's 65504): plain float16 overflows,
    scalified float16 keeps the normalisation and its gradient accurate."""
    scale = 2.0**20
    x16 = X.astype(jnp.float16)
    sx = scalify.scaled_array(x16, jnp.float32(scale))
    plain = LayerNorm(dtype=jnp.float16).apply(VARS, (X * scale).astype(jnp.float16))
    assert not np.isfinite(np.asarray(plain, np.float32)).all()
    f = jax.grad(lambda x: jnp.sum(layer_norm(x, grad_rescale="l2").astype(jnp.float32) * G))
    g = jax.jit(scalify.scalify(f))(sx)
    assert g.data.dtype == jnp.float16
    ref = jax.grad(lambda x: jnp.sum(layer_norm(x) * G))(X * scale)
    np.testing.assert_allclose(scalify.asarray(g, jnp.float32), ref, rtol=2e-2, atol=2e-3 * float(jnp.abs(ref).max()))
    y = jax.jit(scalify.scalify(lambda x: layer_norm(x)))(sx)
    np.testing.assert_allclose(scalify.asarray(y, jnp.float32), layer_norm(X * scale), atol=5e-3)


def test_activations_are_the_ops_ones():
    assert gelu is scalify.ops.gelu and relu is scalify.ops.relu and silu is scalify.ops.silu
