"""One-line FP8 for unchanged flax.linen models: `scalify.nn.fp8_everywhere` and
`scalify.nn.fp8_dot_general`.

Error bound used below. Round-to-nearest E4M3 (3 mantissa bits, relative step 2^-3) has a
relative rounding error of at most u = 2^-4 and RMS at most u/sqrt(3) (uniform in the
half-step). A quantised product a_i*b_i then carries an error of RMS <= sqrt(2/3)*u*|a_i b_i|.
The worst case over a length-K dot grows like sqrt(K) relative to the result (sum of |a_i b_i|
against a sum of random-sign terms), but the errors are independent and zero-mean, so they
add in quadrature like the products do: the normwise relative error of one FP8 matmul is
about sqrt(2/3)*2^-4 = 0.051 whatever K, and L matmuls in sequence compound to
sqrt(L)*0.051. The backward matmuls have one E5M2 operand (u = 2^-3): sqrt(1/3)*sqrt(2^-6 +
2^-8) = 0.081 per matmul.
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scalify
from scalify.nn import Fp8DotGeneral, fp8_dot_general, fp8_everywhere
from _jaxpr_testing import equations

FWD_ERR = math.sqrt(2 / 3) * 2.0**-4  # one E4M3 x E4M3 matmul (module docstring)
BWD_ERR = math.sqrt(1 / 3) * math.sqrt(2.0**-6 + 2.0**-8)  # one E5M2 x E4M3 matmul


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class MLP(nn.Module):  # a stock linen MLP: nothing FP8 in it
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(8)(x)


class Block(nn.Module):  # a stock transformer block: attention and a Dense MLP
    @nn.compact
    def __call__(self, x):
        x = x + nn.SelfAttention(num_heads=2, qkv_features=16)(x)
        return x + nn.Dense(16)(nn.gelu(nn.Dense(32)(x)))


class Heads(nn.Module):  # DenseGeneral (multi-axis) and Einsum (batch letter, '...')
    @nn.compact
    def __call__(self, x):
        h = nn.DenseGeneral((2, 8), axis=-1)(x)                       # (b, t, 2, 8)
        h = nn.Einsum((2, 8, 4), "...hd,hdk->...hk")(h)               # (b, t, 2, 4)
        return nn.DenseGeneral(8, axis=(-2, -1))(nn.Einsum((16, 2, 4), "btd,dhk->bthk")(x) + h)


X_MLP = jax.random.normal(jax.random.PRNGKey(1), (16, 16))
X_BLOCK = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 16))


def _fp8_dots(jaxpr):
    """(lhs dtype, rhs dtype) of every dot_general on FP8 operands, sub-jaxprs included."""
    dots = (tuple(str(v.aval.dtype) for v in e.invars) for e in equations(jaxpr) if e.primitive.name == "dot_general")
    return [dts for dts in dots if all(d.startswith("float8") for d in dts)]


def test_mlp_forward_and_gradient_within_fp8_bound():
    model = MLP()
    v = jax.jit(model.init)(jax.random.PRNGKey(0), X_MLP)

    def per_layer(**kw):  # the same MLP with the contraction given per layer
        class PerLayer(nn.Module):
            @nn.compact
            def __call__(self, x):
                x = nn.relu(nn.Dense(32, **kw)(x))
                x = nn.relu(nn.Dense(32, **kw)(x))
                return nn.Dense(8, **kw)(x)

        return PerLayer()

    def loss(p, x):
        y = model.apply({"params": p}, x)
        return jnp.mean(y**2), y

    @jax.jit
    def run(p, x):
        ref = jax.value_and_grad(loss, has_aux=True)(p, x)
        with fp8_everywhere():
            fp8 = jax.value_and_grad(loss, has_aux=True)(p, x)
        as_fn = per_layer(dot_general=fp8_dot_general).apply({"params": p}, x)
        as_cls = per_layer(dot_general_cls=Fp8DotGeneral).apply({"params": p}, x)
        return ref, fp8, as_fn, as_cls

    ((_, y_ref), g_ref), ((_, y), g), as_fn, as_cls = run(v["params"], X_MLP)
    # 3 matmuls in sequence (module docstring).
    assert 0 < _rel(y, y_ref) < math.sqrt(3) * FWD_ERR
    # The last layer's kernel gradient: one backward matmul (an FP8 input times an E5M2
    # output gradient) after the 3-matmul forward that produced both.
    assert _rel(g["Dense_2"]["kernel"], g_ref["Dense_2"]["kernel"]) < math.sqrt(
        3 * FWD_ERR**2 + BWD_ERR**2)
    np.testing.assert_array_equal(as_fn, y)
    np.testing.assert_array_equal(as_cls, y)


def test_layer_with_its_own_dot_general_is_left_alone():
    calls = []
    own = lambda *a, **k: calls.append(1) or jax.lax.dot_general(*a, **k)  # noqa: E731
    layer = nn.Dense(4, dot_general=own)
    lv = jax.jit(layer.init)(jax.random.PRNGKey(0), X_MLP)
    ref = jax.jit(nn.Dense(4).apply)(lv, X_MLP)
    with fp8_everywhere():
        np.testing.assert_array_equal(jax.jit(layer.apply)(lv, X_MLP), ref)
    assert calls


def test_rejects_delayed_scaling_and_foreign_layers():
    with pytest.raises(ValueError, match="delayed scaling"):
        Fp8DotGeneral(scaling="delayed")
    with pytest.raises(ValueError, match="subclasses of"):
        scalify.nn.fp8_interceptor(layers=(nn.Conv,))


def test_dense_general_and_einsum_swap_same_parameters():
    """Under the swap the model has the same parameters (names, shapes, values: flax's own
    bias shapes for the Einsums) and its 4 layers run in FP8: 2 contractions in sequence on
    the longest path, within the bound of float32."""
    model = Heads()
    key = jax.random.PRNGKey(0)

    @jax.jit
    def run(x):
        v = model.init(key, x)
        with fp8_everywhere():
            v8 = model.init(key, x)
            y8 = model.apply(v, x)
        return v, v8, model.apply(v, x), y8

    v, v8, y, y8 = run(X_BLOCK)
    assert jax.tree.map(jnp.shape, v)["params"]["Einsum_0"] == {"bias": (2, 4), "kernel": (2, 8, 4)}
    assert jax.tree.map(jnp.shape, v)["params"]["Einsum_1"] == {"bias": (2, 4), "kernel": (16, 2, 4)}
    jax.tree.map(np.testing.assert_array_equal, v8, v)
    assert 0 < _rel(y8, y) < math.sqrt(3) * FWD_ERR
    with fp8_everywhere():
        jaxpr = jax.make_jaxpr(model.apply)(v, X_BLOCK)
    assert str(jaxpr).count("fp8_scaled_matmul") == 4


@pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated")
def test_transformer_block_scalified_train_step():
    """The unchanged block under scalify with ScaledArray params: its 6 swapped layers (q,
    k, v, out, two Dense) give 18 FP8 GEMMs in the jaxpr (E4M3 x E4M3 forward, one E5M2
    operand in each backward), the output is within the FP8 bound of float32, every
    gradient leaf flows, and Adam steps decrease the loss."""
    model = Block()

    @jax.jit
    def init_and_apply(key, x):  # float32 parameters and output
        v = model.init(key, x)
        return v, model.apply(v, x)

    v, ref = init_and_apply(jax.random.PRNGKey(0), X_BLOCK)
    target = jax.random.normal(jax.random.PRNGKey(2), X_BLOCK.shape)

    def loss(p, x, y):
        with fp8_everywhere():
            out = model.apply({"params": p}, x)
        return jnp.mean((out - y) ** 2), out

    grad_fn = scalify.scalify(jax.value_and_grad(loss, has_aux=True))
    traced = jax.jit(grad_fn).trace(scalify.as_scaled_array(v["params"]), X_BLOCK, target)
    dots = _fp8_dots(traced.jaxpr.jaxpr)
    assert len(dots) == 18, dots
    assert sum("float8_e5m2" in d for d in dots) == 12  # 2 backward GEMMs per layer
    grad_step = traced.lower().compile()
    tx = optax.adam(1e-2)

    @jax.jit
    def adam(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state, losses = v["params"], tx.init(v["params"]), []
    for i in range(4):
        (value, out), grads = grad_step(scalify.as_scaled_array(params), X_BLOCK, target)
        grads = scalify.asarray(grads)
        losses.append(float(scalify.asarray(value)))
        if i == 0:
            # 4 matmuls deep: q/k/v, out, Dense, Dense.
            assert 0 < _rel(scalify.asarray(out), ref) < 2 * FWD_ERR
            for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
                name = jax.tree_util.keystr(path)
                if name == "['SelfAttention_0']['key']['bias']":
                    continue  # softmax is shift-invariant along keys: q.b_k has no gradient
                assert np.isfinite(g).all() and np.abs(g).max() > 0, name
        params, opt_state = adam(grads, opt_state, params)
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.skipif(not scalify.inspect.runs_fp8_gemms(), reason="FP8 GEMMs need an NVIDIA GPU of compute capability >= 8.9")
def test_swapped_step_compiles_to_fp8_gemms():
    """On Hopper every swapped matmul is one FP8 GEMM: 3 per layer (forward, d input, d
    kernel), with and without scalify. At these sizes XLA (jax 0.11) emits them as Triton
    GEMM fusions that read the FP8 operands (larger ones become cuBLASLt FP8 calls); both
    count. Dimensions are multiples of 16 (cuBLASLt)."""
    model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(32)])
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 48))
    params = jax.jit(model.init)(jax.random.PRNGKey(0), x)["params"]

    def loss(p, x):
        with fp8_everywhere():
            return jnp.mean(model.apply({"params": p}, x) ** 2)

    grad = jax.grad(loss, argnums=(0, 1))  # d x too: else XLA drops the first d input
    plain = jax.jit(grad).lower(params, x).compile().as_text()
    scaled = jax.jit(scalify.scalify(grad)).lower(
        scalify.as_scaled_array(params), x).compile().as_text()
    assert scalify.inspect.count_fp8_gemms(plain) == 6
    assert scalify.inspect.count_fp8_gemms(scaled) == 6


def test_float16_compute_model_does_not_overflow_inside_scalify():
    """FP8 operands filled to the format's max (the swap's just-in-time scaling) multiply to
    up to 448^2 * K: a float16 output overflowed when the raw product left the dot in float16.
    The product now accumulates in float32 and leaves at unit max-abs data."""
    model = nn.Dense(64, dtype=jnp.float16)
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 256))
    params = model.init(jax.random.PRNGKey(1), x)

    def fwd(p, x):
        with fp8_everywhere():
            return model.apply(p, x)

    out = jax.jit(scalify.scalify(fwd))(scalify.as_scaled_array(params), x)
    assert out.dtype == jnp.float16
    value = np.asarray(out.to_array(), np.float32)
    ref = np.asarray(nn.Dense(64).apply(params, x))
    assert np.isfinite(value).all()
    # E4M3 operands: relative step 2^-3, rounding error <= 2^-4 per operand, independent
    # errors in quadrature over K terms: ~sqrt(2/3) * 2^-4 of the output's RMS (see above).
    assert np.sqrt(np.mean((value - ref) ** 2)) <= 0.08 * np.sqrt(np.mean(ref**2))
