"""Flax's own attention modules, unchanged, with their masks (they mask with finfo.min).

float32: the scalified output equals plain JAX (1e-5). float16 compute: no worse than
plain float16 against the float32 reference. The bound is 2x plain's error plus 2^-10:
both carry a handful of float16 roundings (2^-11 each) that fall differently in two
evaluation orders; a flushed or dragged mask gives errors of order 1.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import scalify

B, T, H, D = 2, 6, 2, 8


def _inputs(scale_exp=0):
    rng = np.random.RandomState(0)
    x = rng.randn(B, T, H * D).astype(np.float32)
    tokens = np.ones((B, T), np.int32)
    tokens[1, -2:] = 0  # padding in the second sequence
    return x * np.float32(2.0**scale_exp), tokens


def _masks(tokens):
    causal = nn.make_causal_mask(tokens)
    padding = nn.make_attention_mask(tokens > 0, tokens > 0)
    return nn.combine_masks(causal, padding)


@pytest.fixture
def matmul_precision(request):
    """float32 runs keep the suite's "highest" (model invariance); float16 runs use JAX's
    default (with "highest" set globally, XLA:CPU rejects jitted float16 dots as the
    unsupported algorithm F16_F16_F32)."""
    old = jax.config.jax_default_matmul_precision
    dtype = request.node.callspec.params.get("dtype", jnp.float32)
    jax.config.update("jax_default_matmul_precision", old if dtype == jnp.float32 else None)
    yield
    jax.config.update("jax_default_matmul_precision", old)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _value(out):
    return np.asarray(scalify.asarray(out), np.float32)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("scale_exp", [-20, 0, 20])
def test_linen_dot_product_attention_with_mask_float32(scale_exp, jit):
    x, tokens = _inputs(scale_exp)
    q = x.reshape(B, T, H, D)
    mask = _masks(tokens)
    fn = lambda q: nn.dot_product_attention(q, q, q, mask=mask)  # noqa: E731
    sfn = scalify.scalify(fn)
    out = (jax.jit(sfn) if jit else sfn)(scalify.as_scaled_array(q))
    np.testing.assert_allclose(_value(out), fn(q), rtol=1e-5, atol=1e-6 * 2.0**scale_exp)


def _linen_model(dtype):
    return nn.SelfAttention(num_heads=H, qkv_features=H * D, dtype=dtype, deterministic=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["float32", "float16"])
def test_linen_self_attention_with_causal_and_padding_mask(dtype, matmul_precision):
    x, tokens = _inputs()
    mask = _masks(tokens)
    model = _linen_model(dtype)
    params = model.init(jax.random.PRNGKey(0), x, mask=mask)
    fwd = lambda p, x: model.apply(p, x, mask=mask)  # noqa: E731
    ref = np.asarray(jax.jit(lambda p, x: _linen_model(jnp.float32).apply(p, x, mask=mask))(params, x))
    xs = x.astype(dtype)
    out = _value(jax.jit(scalify.scalify(fwd))(scalify.as_scaled_array(params), scalify.as_scaled_array(xs)))
    plain = np.asarray(jax.jit(fwd)(params, xs), np.float32)
    assert np.isfinite(out).all()
    if dtype == jnp.float32:
        np.testing.assert_allclose(out, plain, rtol=1e-5, atol=1e-6)
    else:
        assert _rel(out, ref) <= 2 * _rel(plain, ref) + 2.0**-10


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["float32", "float16"])
def test_nnx_multihead_attention_with_mask(dtype, matmul_precision):
    if dtype == jnp.float16 and jax.default_backend() == "cpu":
        pytest.skip("backend: nnx attention asks for float16 x float16 -> float32 logits, a dot "
                    "XLA:CPU does not implement (F16_F16_F32); runs on GPU")
    x, tokens = _inputs()
    mask = _masks(tokens)

    def make(dt):
        return nnx.MultiHeadAttention(
            num_heads=H, in_features=H * D, qkv_features=H * D, dtype=dt, decode=False,
            rngs=nnx.Rngs(0),
        )

    graphdef, state = nnx.split(make(dtype))
    ref_graphdef, _ = nnx.split(make(jnp.float32))

    def fwd(state, x, gd=graphdef):
        return nnx.merge(gd, state)(x, mask=mask, deterministic=True)

    ref = np.asarray(fwd(state, x, ref_graphdef))
    xs = x.astype(dtype)
    plain = np.asarray(jax.jit(fwd)(state, xs), np.float32)
    out = _value(jax.jit(scalify.scalify(fwd))(scalify.as_scaled_array(state), scalify.as_scaled_array(xs)))
    assert np.isfinite(out).all()
    if dtype == jnp.float32:
        np.testing.assert_allclose(out, plain, rtol=1e-5, atol=1e-6)
    else:
        assert _rel(out, ref) <= 2 * _rel(plain, ref) + 2.0**-10
