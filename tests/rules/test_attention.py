"""`jax.nn.dot_product_attention` under scalify (scalify/rules/attention.py).

Implementation None / "xla": traced to ordinary primitives; float32 values and gradients
equal plain JAX exactly at any power-of-two scales of q, k, v (2^-20 .. 2^20), causal and
with a padding mask, GQA; the output takes v's scale.

Implementation "cudnn": its forward/backward primitives have rules. On CPU (no cuDNN) the
kernels are replaced by a reference lowering in float32 (`_reference_cudnn`, checked against
the "xla" implementation), so the rules' scale algebra is tested with the same kernels on
both sides: bfloat16 values and gradients equal plain ones bit for bit, float16 stays finite
and accurate where plain float16 overflows. `test_cudnn_on_gpu` runs the real kernels.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import mlir

import scalify
from scalify import ScaledArray, scaled_array

B, T, N, KV, H = 2, 8, 4, 2, 16  # GQA: 4 query heads share 2 key/value heads


def _qkvw(seed=0, t=T, h=H):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, t, N, h)).astype(np.float32)
    k = rng.standard_normal((B, t, KV, h)).astype(np.float32)
    v = rng.standard_normal((B, t, KV, h)).astype(np.float32)
    w = rng.standard_normal((B, t, N, h)).astype(np.float32)  # a loss weight
    return q, k, v, w


def _value(x) -> np.ndarray:
    if isinstance(x, ScaledArray):
        return np.asarray(x.data, np.float32) * np.asarray(x.scale, np.float32)
    return np.asarray(x, np.float32)


def _padding_mask(t=T):
    """(B, 1, T, T): the second sequence has 5 valid keys."""
    lengths = np.array([t, 5])
    mask = np.arange(t)[None, None, None, :] < lengths[:, None, None, None]
    return jnp.asarray(np.broadcast_to(mask, (B, 1, t, t)))


def _runs(f, w, q, k, v, scales, dtype, outer=True):
    """(plain, scalify, outer) for each (sq, sk, sv) in `scales` (one tuple: no list):
    (output, grads wrt q, k, v) of `f` and of `sum(f * w)`, plain and scalified; `outer`:
    the grads of `jax.grad` of a scalified call (None with `outer=False`). All under
    `jax.jit`, compiled once for all the scales (they are traced)."""
    def loss(*a):
        return jnp.sum(f(*a).astype(jnp.float32) * w)

    def outer_loss(*a):
        return jnp.sum(scalify.scalify(f)(*a).to_array().astype(jnp.float32) * w)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    plain_fn = jax.jit(lambda *a: (f(*a), grad(*a)))
    scaled_fn = jax.jit(lambda *a: (scalify.scalify(f)(*a), scalify.scalify(grad)(*a)))
    outer_fn = jax.jit(jax.grad(outer_loss, argnums=(0, 1, 2))) if outer else lambda *a: None
    runs = []
    for sc in [scales] if isinstance(scales[0], float) else scales:
        with np.errstate(over="ignore"):  # plain float16 may overflow: tested
            plain_args = [jnp.asarray(x * s, dtype) for x, s in zip((q, k, v), sc)]
        scaled_args = [scaled_array(jnp.asarray(x, dtype), s) for x, s in zip((q, k, v), sc)]
        runs.append((plain_fn(*plain_args), scaled_fn(*scaled_args), outer_fn(*scaled_args)))
    return runs[0] if isinstance(scales[0], float) else runs


def _plain_runs(f, w, q, k, v, scales, dtype):
    """(output, grads wrt q, k, v) of plain `f` on `(q sq, k sk, v sv)` (a reference)."""
    grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w), argnums=(0, 1, 2))
    args = [jnp.asarray(x * s, dtype) for x, s in zip((q, k, v), scales)]
    return jax.jit(lambda *a: (f(*a), grad(*a)))(*args)


def _close(actual, desired, tol):
    """|actual - desired| <= tol * max|desired| elementwise (tol 0: bit for bit)."""
    desired = _value(desired)
    np.testing.assert_allclose(_value(actual), desired, rtol=0, atol=tol * np.abs(desired).max())


def _assert_equal(plain, scaled, outer, tol=0.0):
    (out_p, g_p), (out_s, g_s) = plain, scaled
    _close(out_s, out_p, tol)
    for i, (a, b) in enumerate(zip(g_p, g_s)):
        _close(b, a, tol)
        if outer is not None:
            _close(outer[i], a, tol)


# float32 programs compiled separately: XLA fuses and orders their reductions differently
# (eagerly they are bit for bit equal), so values agree to a few float32 ulps of the largest.
F32_TOL = 2.0**-20


# ---------------------------------------------------------------------------------------
# implementation None / "xla"
# ---------------------------------------------------------------------------------------
# (sq, sk, sv). sq * sk stays within [2^-40, 2^2]: larger logits saturate the softmax, and
# its gradient then cancels (P (dP - D) with P ~ 1), so that two float32 programs differ far
# above rounding whatever the scales.
SCALES = [(1.0, 1.0, 1.0), (2.0**-20, 2.0**20, 2.0**10), (2.0**20, 2.0**-18, 2.0**-20),
          (2.0**-20, 2.0**-20, 2.0**20)]


@pytest.mark.parametrize("implementation,masking", [(None, "causal"), ("xla", "padding+causal")])
def test_xla_float32_equals_plain(implementation, masking, arguments_as_given):
    q, k, v, w = _qkvw()
    mask = _padding_mask() if masking == "padding+causal" else None

    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                            implementation=implementation)

    runs = _runs(f, w, q, k, v, SCALES, jnp.float32, outer=implementation is None)
    for scales, (plain, scaled, outer) in zip(SCALES, runs):
        assert isinstance(scaled[0], ScaledArray)
        assert float(scaled[0].scale) == scales[2]  # softmax rows sum to 1: v's scale
        # Power-of-two scales commute with every product and sum of float32 attention.
        _assert_equal(plain, scaled, outer, F32_TOL)


def test_xla_explicit_scale_and_bias(arguments_as_given):
    q, k, v, w = _qkvw(1)
    bias = jnp.asarray(np.random.default_rng(2).standard_normal((1, N, T, T)), jnp.float32)

    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, bias=bias, scale=0.5, implementation="xla")

    _assert_equal(*_runs(f, w, q, k, v, (2.0**8, 2.0**-3, 2.0**5), jnp.float32, outer=False), F32_TOL)


def test_xla_bfloat16_no_worse_than_plain(arguments_as_given):
    """bfloat16 data at scales where plain bfloat16 is exact up to rounding: the scalified
    values are as close to the float32 result as the plain bfloat16 ones."""
    q, k, v, w = _qkvw(3)
    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    scales = (2.0**-12, 2.0**9, 2.0**14)
    (out_p, g_p), (out_s, g_s), _ = _runs(f, w, q, k, v, scales, jnp.bfloat16, outer=False)
    out_r, g_r = _plain_runs(f, w, q, k, v, scales, jnp.float32)
    for p, s, r in zip((out_p, *g_p), (out_s, *g_s), (out_r, *g_r)):
        r = _value(r)
        err_p = np.abs(_value(p) - r).max() / np.abs(r).max()
        err_s = np.abs(_value(s) - r).max() / np.abs(r).max()
        # No worse than plain, up to a factor 1.5 for where the roundings fall or bfloat16's
        # own rounding (2^-8 of the largest value) when plain is luckier.
        assert err_s <= max(1.5 * err_p, 2.0**-8), (err_s, err_p)


# ---------------------------------------------------------------------------------------
# implementation "cudnn": the rules, with reference kernels on CPU
# ---------------------------------------------------------------------------------------
ON_GPU = jax.default_backend() == "gpu"
# Bit for bit with the reference kernels. The real cuDNN kernels are compared at bfloat16
# rounding (1e-2 of the largest value): nothing documents that their rounding is invariant
# under power-of-two factors of q, k and v.
BIT_EXACT = 0.0 if not ON_GPU else 1e-2


def _reference_logits(q, k, bias, scale, mask_type, has_bias):
    """float32 logits (B, N, T, S) of cuDNN's BTNH layout, GQA and causal mask."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if has_bias:
        s = s + bias.astype(jnp.float32)
    if mask_type in (fa.MaskType.CAUSAL, fa.MaskType.PADDING_CAUSAL):
        t, s_len = s.shape[-2:]
        s = jnp.where(np.arange(t)[:, None] >= np.arange(s_len)[None, :], s, -jnp.inf)
    return s


def _reference_fwd(q, k, v, bias, *_, scale, mask_type, variadic_args, is_training, layout, **__):
    from jax._src.cudnn import fused_attention_stablehlo as fa

    assert layout == fa.AttentionLayout.BTNH.value
    s = _reference_logits(q, k, bias, scale, mask_type, variadic_args[0])
    lse = jax.nn.logsumexp(s, axis=-1)
    vv = jnp.repeat(v, q.shape[2] // v.shape[2], axis=2).astype(jnp.float32)
    o = jnp.einsum("bnts,bsnh->btnh", jnp.exp(s - lse[..., None]), vv).astype(q.dtype)
    return (o, lse) if is_training else (o,)


def _reference_bwd(q, k, v, bias, *rest, scale, mask_type, variadic_args, **_):
    """The flash-attention backward from the saved output and log-sum-exp:
    dS = P (dO V^T - rowsum(dO O)), dQ = c dS K, dK = c dS^T Q, dV = P^T dO."""
    lse, o, do = (x.astype(jnp.float32) for x in rest[-3:])
    g = q.shape[2] // k.shape[2]
    p = jnp.exp(_reference_logits(q, k, bias, scale, mask_type, variadic_args[0]) - lse[..., None])
    kk, vv = (jnp.repeat(x, g, axis=2).astype(jnp.float32) for x in (k, v))
    ds = p * (jnp.einsum("btnh,bsnh->bnts", do, vv) - jnp.einsum("btnh,btnh->bnt", do, o)[..., None])
    dq = scale * jnp.einsum("bnts,bsnh->btnh", ds, kk)
    dk = scale * jnp.einsum("bnts,btnh->bsnh", ds, q.astype(jnp.float32))
    dv = jnp.einsum("bnts,btnh->bsnh", p, do)
    grouped = lambda x: x.reshape(*x.shape[:2], k.shape[2], g, x.shape[-1]).sum(3)  # noqa: E731
    out = [dq.astype(q.dtype), grouped(dk).astype(k.dtype), grouped(dv).astype(v.dtype)]
    if variadic_args[1]:
        axes = tuple(i for i in range(4) if bias.shape[i] == 1)
        out.append(ds.sum(axes, keepdims=True).astype(bias.dtype))
    return tuple(out)


_REFERENCE_INSTALLED = []


@pytest.fixture
def cudnn(monkeypatch):
    """cuDNN attention runnable here: real kernels on a GPU; on CPU, the reference kernels as
    the CPU lowering of cuDNN's primitives and a cuDNN version for its checks."""
    if ON_GPU:
        return
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 90800)
    if not _REFERENCE_INSTALLED:
        for prim, fn in ((fa._dot_product_attention_fwd_p, _reference_fwd),
                         (fa._dot_product_attention_bwd_p, _reference_bwd)):
            mlir.register_lowering(prim, mlir.lower_fun(fn, multiple_results=True), platform="cpu")
        _REFERENCE_INSTALLED.append(True)


def _cudnn_fn(**kwargs):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kwargs)


@pytest.mark.skipif(ON_GPU, reason="checks the CPU reference kernels")
def test_reference_kernels_match_xla(cudnn):
    """bfloat16 reference kernels vs float32 "xla" attention: bfloat16 rounding apart."""
    q, k, v, w = _qkvw(5)
    xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    plain_x = _plain_runs(xla, w, q, k, v, (1.0, 1.0, 1.0), jnp.float32)
    plain_c = _plain_runs(_cudnn_fn(is_causal=True), w, q, k, v, (1.0, 1.0, 1.0), jnp.bfloat16)
    for a, b in zip((plain_x[0], *plain_x[1]), (plain_c[0], *plain_c[1])):
        _close(b, a, 2e-2)  # bfloat16 inputs and outputs: 8 bits of mantissa


@pytest.mark.parametrize("options", ["causal", "mask+scale"])
def test_cudnn_bfloat16_equals_plain(cudnn, options, arguments_as_given):
    """Power-of-two scales moved into the data: the kernels see the same logits, and every
    output is a power of two times the plain one (bit for bit with the reference kernels)."""
    kwargs = dict(is_causal=True) if options == "causal" else dict(mask=_padding_mask(), scale=0.3)
    q, k, v, w = _qkvw(6)
    f = _cudnn_fn(**kwargs)
    all_scales = [(2.0**-10, 2.0**10, 2.0**12), (2.0**5, 2.0**-9, 2.0**-14)]
    runs = _runs(f, w, q, k, v, all_scales, jnp.bfloat16, outer=options == "causal")
    for scales, (plain, scaled, outer) in zip(all_scales, runs):
        assert float(scaled[0].scale) == scales[2]
        _assert_equal(plain, scaled, outer, BIT_EXACT)


def test_cudnn_float16_where_plain_overflows(cudnn, arguments_as_given):
    """q at 2^15 and k at 2^-13: plain float16 cannot hold q (max 65504), scalify keeps q.k
    (the exponent of sq*sk split in halves) and is as accurate as float16 allows."""
    q, k, v, w = _qkvw(7)
    scales = (2.0**15, 2.0**-13, 2.0**-16)
    plain, scaled, outer = _runs(_cudnn_fn(is_causal=True), w, q, k, v, scales, jnp.float16)
    xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    out_r, g_r = _plain_runs(xla, w, q, k, v, scales, jnp.float32)
    assert not np.all(np.isfinite(_value(plain[0])))  # plain float16: inf/nan
    for s, r in zip((scaled[0], *scaled[1], *outer), (out_r, *g_r, *g_r)):
        _close(s, r, 2e-2)  # float16 rounding of q', k', v, P and the gradients


def test_cudnn_per_head_scales_and_jit(cudnn, arguments_as_given):
    """A per-head scale of q (shape (1, 1, N, 1)) is folded at its largest entry; under jit."""
    q, k, v, w = _qkvw(8)
    sq = 2.0 ** np.arange(N, dtype=np.float32).reshape(1, 1, N, 1)
    f = _cudnn_fn(is_causal=True)
    args = [scaled_array(jnp.asarray(q, jnp.bfloat16), sq),
            scaled_array(jnp.asarray(k, jnp.bfloat16), 2.0**-4),
            scaled_array(jnp.asarray(v, jnp.bfloat16), 2.0**6)]
    out = jax.jit(scalify.scalify(f))(*args)
    _close(out, f(*[a.to_array() for a in args]), BIT_EXACT)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cudnn_on_gpu(dtype, arguments_as_given):
    """Real cuDNN kernels: scalified = plain cuDNN up to the kernels' own rounding (the pow2
    factors leave the logits unchanged); a GPT-like shape (head dim 64, 128 tokens)."""
    q, k, v, w = _qkvw(9, t=128, h=64)
    all_scales = [(1.0, 1.0, 1.0), (2.0**-6, 2.0**5, 2.0**8)]
    for plain, scaled, outer in _runs(_cudnn_fn(is_causal=True), w, q, k, v, all_scales, dtype):
        (out_p, g_p), (out_s, g_s) = plain, scaled
        for p, s in zip((out_p, *g_p, *g_p), (out_s, *g_s, *outer)):
            _close(s, p, 1e-2)
