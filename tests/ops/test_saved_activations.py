"""FP8-saved activations (scalify.ops.saved_activations): storage formats, exact forward,
gradients within FP8 error of float32, residuals really FP8, inside and outside scalify."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalify
from scalify.ops import saved_activations as SA
from scalify.ops.saved_activations import (
    GROUP16,
    GROUP128,
    PER_TENSOR,
    POLICIES,
    PROBS_BOUND,
    ResidualPolicy,
    SaveSpec,
    dequantize_saved,
    fp8_saved_attention,
    fp8_saved_dense,
    fp8_saved_gelu,
    fp8_saved_layer_norm,
    quantize_saved,
    save_in_fp8,
)
from scalify.quant import E8M0, format_info

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
U = format_info(E4M3).unit_roundoff  # 2^-4: relative rounding error of E4M3
G16_F32 = SaveSpec(group_size=16, scale_format="float32")
SPECS = [PER_TENSOR, GROUP16, GROUP128, G16_F32, SaveSpec(group_size=24)]


def _data(shape, seed=0, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _roundtrip(x, spec):
    return jax.jit(lambda x: dequantize_saved(quantize_saved(x, spec), spec, x.dtype))(x)


def _residuals(f, *args):
    """[(aval, description)] of what autodiff saves for the backward of f."""
    from jax._src.ad_checkpoint import saved_residuals

    return [(a, d) for a, d in saved_residuals(f, *args)
            if "argument" not in d and "constant" not in d]


# -- specs and policies ----------------------------------------------------------------------
@pytest.mark.parametrize("text,want", [
    ("tensor", PER_TENSOR), ("g16", GROUP16), ("g128", GROUP128), ("g16:float32", G16_F32),
    ("e5m2:g16", SaveSpec(jnp.float8_e5m2, 16)), ("tensor:margin1", SaveSpec(margin=1)),
    ("tensor:bound1", PROBS_BOUND), ("bound0.5", SaveSpec(amax_bound=0.5)), ("none", None),
])
def test_save_spec_parse(text, want):
    assert SaveSpec.parse(text) == want
    if want is not None:
        assert SaveSpec.parse(str(want)) == want


def test_policy_parse_presets_and_fields():
    assert ResidualPolicy.parse("coat") == POLICIES["coat"]
    p = ResidualPolicy.parse("coat-nonlinear,act=g128,probs=g16:float32")
    assert p.norm == GROUP16 and p.activation == GROUP128 and p.attention_probs == G16_F32
    assert p.linear is None and p.spec("attention_qkv") is None
    assert ResidualPolicy.parse(str(POLICIES["all"])) == POLICIES["all"]
    assert ResidualPolicy.parse("none") is None and ResidualPolicy.parse(None) is None
    with pytest.raises(ValueError, match="Unknown layer type"):
        ResidualPolicy.parse("conv=g16")
    with pytest.raises(ValueError, match="Cannot parse"):
        SaveSpec.parse("g16:fp7")


def test_bytes_per_element():
    assert PER_TENSOR.bytes_per_element() == 1
    assert GROUP16.bytes_per_element() == 1 + 1 / 16
    assert G16_F32.bytes_per_element() == 1 + 4 / 16
    assert SA.residual_bytes((4, 32), GROUP16, jnp.float16) == 128 + 8
    assert SA.residual_bytes((4, 32), None, jnp.float16) == 256


# -- quantisation ------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_quantize_saved_is_fp8_with_expected_scales(spec):
    x = _data((3, 5, 48), 1)
    s = jax.jit(lambda x: quantize_saved(x, spec))(x)
    assert s.data.dtype == E4M3 and s.data.shape == x.shape
    if spec.per_tensor:
        assert s.scale.shape == () and s.scale.dtype == jnp.float32
        assert scalify.is_pow2(np.asarray(s.scale))
    else:
        assert s.scale.shape == (3, 5, -(-48 // spec.group_size))
        assert s.scale.dtype == (E8M0 if spec.scale_format == "e8m0" else jnp.float32)
    # Nothing saturates: every group's absmax is representable.
    np.testing.assert_array_less(np.abs(np.asarray(s.data, np.float32)), format_info(E4M3).max + 1e-6)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_roundtrip_error_within_e4m3_rounding(spec):
    x = _data((4, 96), 2)
    rt = np.asarray(_roundtrip(x, spec))
    xa = np.asarray(x)
    big = np.abs(xa) > 0.05 * np.abs(xa).max()  # normal range of every scaling choice
    assert np.all(np.abs(rt - xa)[big] <= U * np.abs(xa)[big] * (1 + 1e-6))
    assert _rel(rt, xa) < U


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_roundtrip_keeps_dtype_and_zeros(dtype):
    x = _data((2, 32), 3).astype(dtype).at[0].set(0)
    for spec in (PER_TENSOR, GROUP16):
        rt = _roundtrip(x, spec)
        assert rt.dtype == dtype
        assert np.all(np.asarray(rt[0], np.float32) == 0)
        assert _rel(rt.astype(jnp.float32), x.astype(jnp.float32)) < U


def test_per_group_error_with_outliers_below_per_tensor():
    """COAT Fig. 4a: with outlier channels, finer groups give a lower quantisation error
    (per-tensor scaling pushes the ordinary values into E4M3's subnormals)."""
    x = np.array(_data((64, 256), 4))
    x[:, [3, 60]] *= 2.0**14  # two outlier channels, both in the first group of 128
    x = jnp.asarray(x)

    def err(spec):  # mean relative error of the elements
        rt = np.asarray(_roundtrip(x, spec), np.float64)
        return float(np.mean(np.abs(rt - np.asarray(x)) / np.abs(np.asarray(x))))

    e_tensor, e128, e16 = err(PER_TENSOR), err(GROUP128), err(GROUP16)
    assert e16 < e128 < e_tensor
    assert e16 < U and e_tensor > 4 * e16


# -- the generic wrapper: forward exact, backward = VJP at the FP8 input -----------------------
def _ln(x, g, b):
    xf = x.astype(jnp.float32)
    c = xf - xf.mean(-1, keepdims=True)
    return (c * jax.lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-6) * g + b).astype(x.dtype)


@pytest.mark.parametrize("spec", [PER_TENSOR, GROUP16, G16_F32], ids=str)
def test_save_in_fp8_forward_exact_backward_is_vjp_at_fp8_input(spec):
    x, g, b, ct = _data((4, 64), 5), _data((64,), 6), _data((64,), 7), _data((4, 64), 8)
    f = save_in_fp8(_ln, spec)
    y, vjp = jax.vjp(jax.jit(f), x, g, b)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(_ln)(x, g, b)))
    got = vjp(ct)
    xq = _roundtrip(x, spec)
    want = jax.jit(lambda *a: jax.vjp(_ln, *a)[1](ct))(xq, g, b)
    for a, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_save_in_fp8_none_spec_is_identity_and_other_args_kept():
    f = lambda x, w: jnp.tanh(x @ w)  # noqa: E731
    assert save_in_fp8(f, None) is f
    x, w = _data((8, 32), 9), _data((32, 16), 10)
    res = _residuals(lambda x, w: jnp.sum(save_in_fp8(f, GROUP16)(x, w)), x, w)
    dtypes = sorted(str(a.dtype) for a, _ in res)
    assert dtypes == ["float8_e4m3fn", "float8_e8m0fnu"], res  # w is an argument: not copied


def test_amax_bound_spec():
    """A known bound on |x| gives the scale without a reduction: fp8_scale(bound)."""
    x = jax.nn.softmax(_data((8, 64), 13, scale=4.0), axis=-1)
    saved = quantize_saved(x, PROBS_BOUND)
    assert saved.data.dtype == E4M3 and float(saved.scale) == 2.0**-8  # 448 * 2^-8 >= 1
    back = _roundtrip(x, PROBS_BOUND)
    big = np.asarray(x) >= 2.0**-14  # E4M3 normals x 2^-8: relative error <= U
    np.testing.assert_array_less(np.abs(np.asarray(back) - np.asarray(x))[big], U * np.asarray(x)[big] + 1e-12)
    jaxpr = str(jax.make_jaxpr(lambda x: quantize_saved(x, PROBS_BOUND))(x))
    assert "reduce_max" not in jaxpr and "fp8_amax" not in jaxpr
    for bad in (dict(amax_bound=0.0), dict(amax_bound=float("inf")), dict(group_size=16, amax_bound=1.0)):
        with pytest.raises(ValueError, match="amax_bound"):
            SaveSpec(**bad)


def test_amax_bound_inside_scalify_bounds_the_value():
    """Inside scalify the bound is on the value data * scale: same FP8 value as outside."""
    x = jax.nn.softmax(_data((8, 64), 14, scale=4.0), axis=-1)
    want = _roundtrip(x, PROBS_BOUND)
    f = scalify.scalify(lambda x: dequantize_saved(quantize_saved(x, PROBS_BOUND), PROBS_BOUND, x.dtype))
    out = jax.jit(f)(_scaled(x, 2.0**-3))
    np.testing.assert_array_equal(np.asarray(out.to_array()), np.asarray(want))


# -- layers: gradients within FP8 error of float32 ----------------------------------------------
def _block(x, p, policy: ResidualPolicy | None):
    """A small pre-LN transformer block (LN -> attention -> LN -> dense-GELU-dense)."""
    pol = policy or ResidualPolicy()
    b, t, d = x.shape
    h = fp8_saved_layer_norm(x, p["g1"], p["b1"], pol.norm)
    qkv = fp8_saved_dense(h, p["wqkv"], None, pol.linear).reshape(b, t, 3, 2, d // 2)
    mask = jnp.tril(jnp.ones((t, t), bool))
    att = fp8_saved_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], mask,
                              qkv_spec=pol.attention_qkv, probs_spec=pol.attention_probs)
    x = x + fp8_saved_dense(att.reshape(b, t, d), p["wo"], None, pol.linear)
    h = fp8_saved_layer_norm(x, p["g2"], p["b2"], pol.norm)
    h = fp8_saved_gelu(fp8_saved_dense(h, p["w1"], None, pol.linear), pol.activation)
    return x + fp8_saved_dense(h, p["w2"], None, pol.linear)


def _block_params(d=32, seed=20):
    ks = iter(range(seed, seed + 10))
    return {
        "g1": 1 + 0.1 * _data((d,), next(ks)), "b1": 0.1 * _data((d,), next(ks)),
        "wqkv": _data((d, 3 * d), next(ks)) / np.sqrt(d), "wo": _data((d, d), next(ks)) / np.sqrt(d),
        "g2": 1 + 0.1 * _data((d,), next(ks)), "b2": 0.1 * _data((d,), next(ks)),
        "w1": _data((d, 4 * d), next(ks)) / np.sqrt(d), "w2": _data((4 * d, d), next(ks)) / np.sqrt(4 * d),
    }


_COS = np.cos(np.arange(2 * 16 * 32, dtype=np.float32)).reshape(2, 16, 32)  # loss weights


def _block_loss(policy):
    def loss(x, p):
        return jnp.sum(_block(x, p, policy) * _COS)

    return loss


def _plain_block_loss(x, p):
    """The same block in plain JAX (reference for the explicit attention backward)."""
    from experiments.nanogpt.model import causal_attention

    b, t, d = x.shape
    h = _ln(x, p["g1"], p["b1"])
    qkv = (h @ p["wqkv"]).reshape(b, t, 3, 2, d // 2)
    att = causal_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], jnp.tril(jnp.ones((t, t), bool)))
    x = x + att.reshape(b, t, d) @ p["wo"]
    h = jax.nn.gelu(_ln(x, p["g2"], p["b2"]) @ p["w1"]) @ p["w2"]
    return jnp.sum((x + h) * _COS)


X_BLOCK, P_BLOCK = _data((2, 16, 32), 11), _block_params()


@functools.cache
def _reference_grads():
    return jax.jit(jax.grad(_block_loss(None), argnums=(0, 1)))(X_BLOCK, P_BLOCK)


def test_block_without_fp8_equals_plain_jax():
    """No policy: the explicit attention backward equals JAX's autodiff."""
    want = jax.jit(jax.grad(_plain_block_loss, argnums=(0, 1)))(X_BLOCK, P_BLOCK)
    got = _reference_grads()
    for a, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=2e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["coat", "all", "coat-attention-bound"])
def test_block_gradients_within_fp8_error_of_float32(name):
    policy = POLICIES[name]
    loss = _block_loss(policy)
    ref = _reference_grads()
    val, got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(X_BLOCK, P_BLOCK)
    assert float(val) == float(jax.jit(_block_loss(None))(X_BLOCK, P_BLOCK))  # forward exact
    for path, a in jax.tree_util.tree_flatten_with_path(got)[0]:
        w = jax.tree_util.tree_flatten_with_path(ref)[0]
        w = dict((jax.tree_util.keystr(p), v) for p, v in w)[jax.tree_util.keystr(path)]
        # Each saved tensor is off by <= U relative; its gradient by the same order.
        assert _rel(a, w) < U, (jax.tree_util.keystr(path), _rel(a, w))


def test_block_residuals_are_fp8():
    """What autodiff keeps of the block's activations: FP8 data and scales only."""
    res = _residuals(_block_loss(POLICIES["all"]), X_BLOCK, P_BLOCK)
    act = [(a, d) for a, d in res if a.size >= X_BLOCK.size]  # activation-sized
    assert act and all(a.dtype == E4M3 for a, _ in act), act
    small = {str(a.dtype) for a, _ in res if a.size < X_BLOCK.size}
    assert small <= {"float8_e4m3fn", "float8_e8m0fnu", "float32", "bool"}, small
    base = _residuals(_block_loss(None), X_BLOCK, P_BLOCK)
    nbytes = lambda r: sum(a.size * a.dtype.itemsize for a, _ in r)  # noqa: E731
    assert nbytes(base) > 3.5 * nbytes(res)  # float32 -> E4M3 (+ scales)


def test_compiled_memory_is_lower():
    """XLA's temporary memory of a jitted gradient shrinks with FP8-saved GELU inputs."""
    ws = [_data((128, 128), 30 + i) / 12 for i in range(6)]
    x = _data((256, 128), 40)

    def temp(spec):
        def f(ws, x):
            for w in ws:
                x = fp8_saved_gelu(x @ w, spec)
            return jnp.sum(x)

        c = jax.jit(jax.grad(f, argnums=(0, 1))).lower(ws, x).compile()
        return c.memory_analysis().temp_size_in_bytes

    assert temp(GROUP16) < 0.8 * temp(None)


# -- inside scalify ----------------------------------------------------------------------------
def _scaled(x, scale):
    return scalify.ScaledArray(jnp.asarray(x / scale, x.dtype), jnp.float32(scale))


@pytest.mark.parametrize("spec", [PER_TENSOR, GROUP16, G16_F32], ids=str)
@pytest.mark.parametrize("scale", [2.0**-5, 2.0**7])
def test_quantize_rule_matches_plain(spec, scale):
    x = _data((4, 48), 12, scale=scale)
    want = _roundtrip(x, spec)

    def f(x):
        s = quantize_saved(x, spec)
        return dequantize_saved(s, spec, x.dtype), s.data

    out, data = jax.jit(scalify.scalify(f))(_scaled(x, scale))
    assert isinstance(out, scalify.ScaledArray) and data.dtype == E4M3
    assert float(out.scale) == scale  # the tensor's scale comes back
    np.testing.assert_allclose(np.asarray(out.to_array()), np.asarray(want), rtol=1e-6)


@pytest.mark.parametrize("spec", [PER_TENSOR, GROUP16], ids=str)
def test_quantize_rule_with_per_row_scales(spec):
    x = _data((4, 32), 17)
    rows = jnp.asarray([[2.0**-3], [2.0**5], [1.0], [2.0**9]], jnp.float32)
    xs = scalify.ScaledArray(x, rows)  # value x * rows
    want = _roundtrip(x * rows, spec)
    f = lambda x: dequantize_saved(quantize_saved(x, spec), spec, x.dtype)  # noqa: E731
    got = jax.jit(scalify.scalify(f))(xs).to_array()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_attention_and_dense_gradients_inside_scalify_equal_plain():
    """scalify(jax.grad(f)) with power-of-two scales != 1 gives the gradients of plain JAX
    (the same FP8 values are saved: the quantisers work on the data)."""
    q, k, v = (_data((2, 16, 2, 8), 50 + i) for i in range(3))
    w = _data((16, 16), 53) / 4
    mask = jnp.tril(jnp.ones((16, 16), bool))

    def loss(q, k, v, w):
        att = fp8_saved_attention(q, k, v, mask).reshape(2, 16, 16)
        return jnp.sum(fp8_saved_dense(att, w) * _COS[:, :, :16])

    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, w)
    args = [_scaled(q, 2.0**-5), _scaled(k, 2.0**7), _scaled(v, 2.0**-3), _scaled(w, 2.0**4)]
    got = jax.jit(scalify.scalify(jax.grad(loss, argnums=(0, 1, 2, 3))))(*args)
    for a, w_ in zip(got, want):
        assert isinstance(a, scalify.ScaledArray)
        w_ = np.asarray(w_)
        np.testing.assert_allclose(np.asarray(a.to_array()), w_, rtol=1e-5, atol=1e-5 * np.abs(w_).max())


def test_grad_of_scalify_uses_the_fp8_backward():
    f = lambda x: jnp.sum(fp8_saved_gelu(x, GROUP16) ** 2)  # noqa: E731
    x = _data((4, 64), 13)
    want = jax.jit(jax.grad(f))(x)
    got = jax.jit(jax.grad(scalify.scalify(f)))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_float16_data_at_extreme_scale_stays_in_range():
    """Values ~2^20 overflow float16; inside scalify the FP8-saved LayerNorm + GELU keep
    float16 data near unit scale and the gradients are those of float32 (FP8 error)."""
    scale = 2.0**20
    x = _data((4, 64), 14)
    g, b = 1 + 0.1 * _data((64,), 15), 0.1 * _data((64,), 16)

    def loss(x, g, b):
        y = fp8_saved_gelu(fp8_saved_layer_norm(x, g, b, GROUP16), GROUP16)
        return jnp.sum(y * jnp.linspace(-1, 1, y.size, dtype=y.dtype).reshape(y.shape))

    want = jax.jit(jax.grad(loss))(x * scale, g, b)  # float32: d/dx at values ~2^20
    f16 = [v.astype(jnp.float16) for v in (x * scale, g, b)]
    assert not np.all(np.isfinite(np.asarray(jax.jit(jax.grad(loss))(*f16), np.float32)))
    xs = scalify.ScaledArray(x.astype(jnp.float16), jnp.float32(scale))
    gs, bs = (scalify.as_scaled_array(v.astype(jnp.float16)) for v in (g, b))
    got = jax.jit(scalify.scalify(jax.grad(loss)))(xs, gs, bs)
    assert got.dtype == jnp.float16
    assert _rel(got.to_array(jnp.float32), want) < U


# -- Flax modules and the NanoGPT model option -------------------------------------------------
def test_module_call_gradients_are_vjp_at_fp8_input():
    import flax.linen as nn

    class M(nn.Module):
        spec: SaveSpec | None

        @nn.compact
        def __call__(self, x):
            return SA.fp8_saved_module_call(nn.LayerNorm(name="ln"), x, self.spec)

    x, ct = _data((4, 32), 60), _data((4, 32), 61)
    params = M(None).init(jax.random.PRNGKey(0), x)
    assert jax.tree_util.tree_structure(M(GROUP16).init(jax.random.PRNGKey(0), x)) == \
        jax.tree_util.tree_structure(params)

    def grads(spec, x):
        return jax.jit(lambda p, x: jax.vjp(M(spec).apply, p, x)[1](ct))(params, x)

    got = grads(GROUP16, x)
    want = grads(None, _roundtrip(x, GROUP16))
    for a, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_gpt_saved_activations_option():
    from experiments.nanogpt.model import GPT, cross_entropy_loss, get_config, init_params

    with pytest.raises(ValueError, match="residual policy"):
        get_config("tiny", saved_activations="bogus")
    small = dict(n_layers=1, d_model=32, n_heads=2, seq_len=16, vocab_size=64)
    base = get_config("tiny", **small)
    cfg = base.replace(saved_activations="all")
    params = init_params(base, jax.random.PRNGKey(0))
    tok = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 17)), jnp.int32)

    def loss(cfg):
        return lambda p: cross_entropy_loss(GPT(cfg).apply({"params": p}, tok[:, :-1]), tok[:, 1:])

    assert float(jax.jit(loss(base))(params)) == float(jax.jit(loss(cfg))(params))
    res = _residuals(loss(cfg), params)
    b, t, d = 2, 16, 32
    # A broadcast of a constant (the zeros of the loss's target mask) is not stored by XLA.
    wide = [a for a, desc in res if a.dtype.itemsize > 1 and a.size >= b * t * d
            and "broadcast_in_dim" not in desc]
    # Only the tied head keeps wide tensors: its input, the transposed embedding, and the
    # softmax numerator exp(logits - max) of the loss.
    assert len(wide) == 3, wide
    assert len([a for a, _ in _residuals(loss(base), params) if a.size >= b * t * d]) > 15
