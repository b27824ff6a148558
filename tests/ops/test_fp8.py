import importlib.util
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import scalify
from scalify.ops import fp8
from scalify.ops.casts import cast
from scalify.ops.fp8 import (
    E4M3,
    E5M2,
    DelayedScaling,
    JitScaling,
    StaticScaling,
    amax,
    fp8_dot_general,
    scaled_matmul_p,
    fp8_scale,
    init_amax_history,
    mx_dequantize_scaled,
    mx_quantize_scaled,
    quantize,
    scaling_policy,
    update_amax_history,
)
from scalify.inspect import count_fp8_gemms
from scalify.quant import E8M0, format_info
from _jaxpr_testing import equations


def _load_patterns():
    """benchmarks/fp8_patterns.py: the candidate data paths the FP8 GEMM benchmark times."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_patterns.py"
    spec = importlib.util.spec_from_file_location("fp8_patterns", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PATTERNS = _load_patterns()

DN = (((1,), (0,)), ((), ()))
POLICIES = ["static", "jit", "delayed"]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _data(shape, seed):
    # NumPy's generator: jax.random compiles a kernel per shape, slow on small CI machines.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


X, W, G = _data((32, 64), 0), _data((64, 48), 1), _data((32, 48), 2)
HIST = (init_amax_history(4),) * 3


# -- formats --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_roundtrip_error_of_unit_normal_within_format_precision(dtype):
    info = format_info(dtype)
    x = np.asarray(_data((8192,), 3))
    rt = np.asarray(cast(x, dtype).astype(jnp.float32))
    err = np.abs(rt - x)
    normal = np.abs(x) >= info.min_normal
    # Round to nearest: relative error <= 2^-(m+1) in the normal range, absolute error
    # <= half the subnormal spacing below it.
    assert np.all(err[normal] <= info.unit_roundoff * np.abs(x[normal]))
    assert np.all(err[~normal] <= info.min_subnormal / 2)
    # And the RMS relative error is of the order of the unit roundoff (not saturated).
    assert _rel(rt, x) < info.unit_roundoff


def test_policy_parsing():
    assert isinstance(scaling_policy("jit"), JitScaling)
    assert isinstance(scaling_policy(None), StaticScaling)
    assert scaling_policy(DelayedScaling(8, 1)).history_length == 8
    with pytest.raises(ValueError, match="Unknown scaling policy"):
        scaling_policy("tensorwise")
    with pytest.raises(ValueError, match="history_length"):
        DelayedScaling(0)


# -- statistics and the scale formula ---------------------------------------------------------
@pytest.mark.parametrize(
    "a, dtype, margin, expected",
    [
        (1.0, E4M3, 0, 2.0**-8),  # floor(log2(448)) = 8
        (1.0, E4M3, 2, 2.0**-6),
        (448.0, E4M3, 0, 1.0),
        (449.0, E4M3, 0, 2.0),
        (3e-5, E4M3, 0, 2.0**-23),
        (1.0, E5M2, 0, 2.0**-15),
        (0.0, E4M3, 0, 1.0),
        (np.inf, E4M3, 0, 1.0),
        (np.nan, E4M3, 0, 1.0),
        (3e38, E4M3, 0, 2.0**120),
    ],
)
def test_fp8_scale_formula(a, dtype, margin, expected):
    s = float(fp8_scale(jnp.float32(a), dtype, margin))
    assert s == expected
    if np.isfinite(a) and a > 0:
        assert a / s <= format_info(dtype).max / 2.0**margin


def test_fp8_scale_history_and_fallback():
    hist = jnp.array([0.5, 3.0, 0.0, 0.0])
    assert float(fp8_scale(hist, E4M3)) == float(fp8_scale(jnp.float32(3.0), E4M3))
    empty = init_amax_history(4)
    assert float(fp8_scale(empty, E4M3, fallback=jnp.float32(3.0))) == float(
        fp8_scale(jnp.float32(3.0), E4M3)
    )
    new = update_amax_history(hist, jnp.float32(7.0))
    np.testing.assert_array_equal(new, [7.0, 0.5, 3.0, 0.0])


def test_amax_and_quantize_inside_scalify_equal_plain():
    sx = scalify.scaled_array(_data((16, 8), 4), jnp.float32(2.0**-20))
    x = sx.to_array()

    def f(v):
        s = fp8_scale(amax(v), E4M3)
        return amax(v), s, quantize(v, s, E4M3)

    a_ref, s_ref, q_ref = f(x)
    a, s, q = jax.jit(scalify.scalify(f))(sx)
    assert float(a) == float(a_ref) and float(s) == float(s_ref)
    assert isinstance(q, scalify.ScaledArray)
    np.testing.assert_array_equal(np.asarray(scalify.asarray(q), np.float32), np.asarray(q_ref, np.float32))
    # x / s fills the E4M3 range without overflow: amax(q) in (224, 448].
    assert 224 < float(jnp.max(jnp.abs(q_ref.astype(jnp.float32)))) <= 448


def test_quantize_saturates_never_nan():
    x = jnp.array([1.0, 1e6, -1e30, jnp.inf, -jnp.inf, jnp.nan])
    q = np.asarray(quantize(x, jnp.float32(0.5), E4M3).astype(jnp.float32))
    np.testing.assert_array_equal(q[:5], [2.0, 448.0, -448.0, 448.0, -448.0])
    assert np.isnan(q[5])


# -- the FP8 dot ----------------------------------------------------------------------------------
def _loss_fn(policy, out_dtype=jnp.float32, pattern=None):
    def loss(x, w, hist):
        y = fp8_dot_general(
            x, w, DN, preferred_element_type=out_dtype, scaling=policy, amax_history=hist,
            pattern=pattern,
        )
        return jnp.sum(y.astype(jnp.float32) * G), y

    return loss


@pytest.mark.parametrize("policy", POLICIES)
def test_fp8_matmul_of_unit_scale_data_matches_float32(policy):
    grad_fn = jax.jit(jax.value_and_grad(_loss_fn(policy), argnums=(0, 1, 2), has_aux=True))
    (_, y), (dx, dw, _) = grad_fn(X, W, HIST)
    assert y.dtype == jnp.float32 and dx.dtype == jnp.float32 and dw.dtype == jnp.float32
    # E4M3 operands (unit roundoff 2^-4) and E5M2 gradients (2^-3), errors averaged over K.
    assert _rel(y, X @ W) < 0.06
    assert _rel(dx, G @ W.T) < 0.1
    assert _rel(dw, X.T @ G) < 0.1


@pytest.mark.parametrize("scale", [2.0**-12, 2.0**12])
def test_scalify_keeps_fp8_matmul_accurate_at_extreme_scales(scale):
    """Static FP8: plain JAX under/overflows E4M3 at 2^-12 / 2^12; scalify keeps the error."""
    loss = _loss_fn("static")
    plain_y = jax.jit(loss)(X * scale, W, HIST)[1]
    assert _rel(plain_y, scale * (X @ W)) > 0.5  # E4M3 flushes to 0 / saturates at 448

    sx = scalify.as_scaled_array(X * scale, scale=jnp.float32(scale))
    sw = scalify.as_scaled_array(W)
    grad_fn = jax.jit(scalify.scalify(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)))
    (_, y), (dx, dw) = grad_fn(sx, sw, HIST)
    assert isinstance(y, scalify.ScaledArray) and y.data.dtype == jnp.float32
    assert _rel(scalify.asarray(y), scale * (X @ W)) < 0.06
    assert _rel(scalify.asarray(dx), G @ W.T) < 0.1
    assert _rel(scalify.asarray(dw), scale * (X.T @ G)) < 0.1


@pytest.mark.parametrize("scale", [2.0**-12, 2.0**12])
def test_jit_scaling_is_accurate_without_scalify(scale):
    y = jax.jit(_loss_fn("jit"))(X * scale, W, HIST)[1]
    assert _rel(y, scale * (X @ W)) < 0.06


def test_delayed_scaling_history_gradient_is_the_update():
    loss = _loss_fn("delayed")
    hist = tuple(h.at[1].set(0.25) for h in HIST)  # a previous step saw amax 0.25
    _, (_, _, new) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(X, W, hist)
    for h, ref in zip(new, (X, W, G)):
        assert float(h[0]) == float(jnp.max(jnp.abs(ref)))  # current amax recorded first
        assert float(h[2]) == 0.25  # the history shifted by one
    # The step used the history (max 0.25), so X / s saturates: the output is off.
    y = jax.jit(loss)(X, W, hist)[1]
    assert _rel(y, X @ W) > 0.3


@pytest.mark.parametrize("policy", POLICIES)
def test_out_in_kernel_gradient_is_the_in_out_one_with_no_wide_transpose(policy):
    """An (out, in) kernel: the weight gradient is dot(g, x), which comes out in the kernel's
    own (N, K) order, so no transpose of the wide GEMM output is in the graph (XLA can then
    fold the output's scale and cast into the GEMM); its values are the (in, out) layer's,
    transposed (the same products; the two GEMMs may add them in another order, so up to
    float32 rounding of a 32-term sum)."""
    dn_out_in = (((1,), (1,)), ((), ()))

    def loss(x, w_t, hist):
        y = fp8_dot_general(x, w_t, dn_out_in, preferred_element_type=jnp.float32, scaling=policy,
                            amax_history=hist)
        return jnp.sum(y * G), y

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, y), (dx, dw_t) = grad(X, W.T, HIST)
    (_, y_ref), (dx_ref, dw_ref) = jax.jit(jax.value_and_grad(_loss_fn(policy), argnums=(0, 1),
                                                              has_aux=True))(X, W, HIST)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(dx, dx_ref)
    np.testing.assert_allclose(dw_t, dw_ref.T, rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(dw_ref))))
    assert _rel(dw_t, (X.T @ G).T) < 0.1
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: loss(x, w, HIST)[0], argnums=1))(X, W.T).jaxpr
    for e in jaxpr.eqns:  # only FP8 operands are transposed (to cuBLASLt's "TN" layout)
        if e.primitive is jax.lax.transpose_p:
            assert "float8" in str(e.invars[0].aval.dtype), e


@pytest.mark.parametrize("pattern", sorted(PATTERNS.FP8_DOT_PATTERNS))
def test_plain_patterns_agree(pattern):
    a = cast(X * 8, E4M3)
    b = cast(W * 8, E4M3)
    sa, sb = jnp.float32(2.0**-3), jnp.float32(2.0**-3)
    ref = PATTERNS.dot_dequant_f32(a, b, sa, sb, DN, jnp.float32)
    out = PATTERNS.FP8_DOT_PATTERNS[pattern](a, b, sa, sb, DN, jnp.bfloat16)
    if pattern == "raw":
        out = out.astype(jnp.float32) * (sa * sb)
    assert out.dtype == jnp.bfloat16 or pattern == "raw"
    assert _rel(out.astype(jnp.float32), ref) < 1e-2


def test_general_dimension_numbers_gradients():
    # Batched contraction over two dims, with batch dims not leading in the output layout.
    x, w = _data((3, 4, 5, 6), 5), _data((3, 6, 5, 7), 6)
    dn = (((2, 3), (2, 1)), ((0,), (0,)))
    ref = jax.grad(lambda a, b: jnp.sum(jax.lax.dot_general(a, b, dn) ** 2), argnums=(0, 1))(x, w)
    got = jax.jit(jax.grad(
        lambda a, b: jnp.sum(
            fp8_dot_general(a, b, dn, lhs_dtype=jnp.float32, rhs_dtype=jnp.float32,
                            grad_dtype=jnp.float32) ** 2
        ),
        argnums=(0, 1),
    ))(x, w)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_scalified_fp8_linear_layer_jaxpr_pattern():
    """What XLA needs to form one FP8 GEMM per matmul: each of the three dot_generals takes
    FP8 operands (E4M3 x E4M3 forward, E5M2 x E4M3 backward), gives a wide output, and only
    a multiply by a constant power of two touches its output before use."""
    loss = _loss_fn("static", out_dtype=jnp.bfloat16)
    f = scalify.scalify(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    sx, sw = scalify.as_scaled_array(X), scalify.as_scaled_array(W)
    jaxpr = jax.make_jaxpr(f)(sx, sw, HIST).jaxpr
    dots = [e for e in jaxpr.eqns if e.primitive is jax.lax.dot_general_p]
    assert len(dots) == 3
    operand_dtypes = sorted(tuple(sorted(str(v.aval.dtype) for v in e.invars)) for e in dots)
    assert operand_dtypes == [
        ("float8_e4m3fn", "float8_e4m3fn"),
        ("float8_e4m3fn", "float8_e5m2"),
        ("float8_e4m3fn", "float8_e5m2"),
    ]
    out_types = sorted(str(e.params["preferred_element_type"]) for e in dots)
    assert out_types == ["bfloat16", "float32", "float32"]
    # The operands come straight from the saturating casts (no dequantise before the dot),
    # at most through the transpose to "contracting dims minor" (cuBLASLt FP8's layout)
    # behind an optimization_barrier (see ScalifyConfig.fp8_operand_layout); the weight
    # from its cast in both layouts (`cast_transpose`), with no transpose of its own.
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    layout_ops = (jax.lax.transpose_p, jax.lax.optimization_barrier_p)

    def source(v):
        e = producers[v]
        return source(e.invars[0]) if e.primitive in layout_ops else e

    for e in dots:
        for v in e.invars:
            assert source(v).primitive.name in ("scalify_cast", "fp8_quantize", "fp8_cast_transpose")
        # contracting dims are the minor dims of both operands
        (ca, cb), _ = e.params["dimension_numbers"]
        for c, v in zip((ca, cb), e.invars):
            assert tuple(c) == tuple(range(v.aval.ndim - len(c), v.aval.ndim))
    weight_copies = [e for e in jaxpr.eqns if e.primitive.name == "fp8_cast_transpose"]
    assert len(weight_copies) == 1
    forward_rhs = [e.invars[1] for e in dots if str(e.invars[1].aval.dtype) == "float8_e4m3fn"
                   and str(e.invars[0].aval.dtype) == "float8_e4m3fn"]
    assert [producers[v] for v in forward_rhs] == weight_copies
    # Only FP8 operands are transposed: the weight gradient comes out of its GEMM in the
    # kernel's own dim order (a transpose of the wide output would be a separate kernel).
    for e in jaxpr.eqns:
        if e.primitive is jax.lax.transpose_p:
            assert "float8" in str(e.invars[0].aval.dtype), e
    # Users of each dot output: one multiply by a literal power of two (the sqrt(K) factor).
    for e in dots:
        users = [u for u in jaxpr.eqns if e.outvars[0] in u.invars]
        assert len(users) == 1 and users[0].primitive is jax.lax.mul_p
        lit = [v for v in users[0].invars if isinstance(v, jax.extend.core.Literal)]
        assert len(lit) == 1 and scalify.is_pow2(np.asarray(lit[0].val, np.float64))
    # The lowered HLO keeps the FP8 dots: compiled, 3 FP8 GEMMs (forward, d input, d kernel)
    # where the device has them, none elsewhere (XLA computes them in a wider type).
    lowered = jax.jit(f).lower(sx, sw, HIST)
    text = lowered.as_text()
    assert text.count("f8E4M3FN") > 0 and "dot_general" in text
    assert count_fp8_gemms(lowered.compile().as_text()) == (3 if scalify.inspect.runs_fp8_gemms() else 0)


def test_plain_jit_policy_uses_the_tn_data_path():
    loss = _loss_fn("jit", out_dtype=jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x, w: loss(x, w, HIST))(X, W)
    text = str(jaxpr)
    assert "fp8_scaled_matmul" in text and "pattern=None" in text  # dot_scaled_tn
    hlo = jax.jit(lambda x, w: loss(x, w, HIST)).lower(X, W).as_text()
    # The FP8 operands reach the dot as they are (no up-cast in front of it).
    assert re.search(r"stablehlo.dot_general.*tensor<[0-9x]+xf8E4M3FN>", hlo)


@pytest.mark.parametrize("pattern", [None, "dequant_f32", "alpha_f32", "alpha_out"])
@pytest.mark.parametrize("dn", [(((1,), (0,)), ((), ())), (((1,), (1,)), ((), ())),
                                (((2,), (1,)), ((0,), (0,)))])
def test_scaled_matmul_patterns_agree(pattern, dn):
    rng = np.random.default_rng(3)
    (ca, cb), (ba, bb) = dn
    a_shape = (3, 8, 16) if ba else (8, 16)
    b_shape = (3, 16, 4) if bb else ((16, 4) if cb == (0,) else (4, 16))
    a = fp8.cast(jnp.asarray(rng.standard_normal(a_shape), jnp.float32), fp8.E4M3)
    b = fp8.cast(jnp.asarray(rng.standard_normal(b_shape), jnp.float32), fp8.E4M3)
    sa, sb = jnp.float32(0.5), jnp.float32(4.0)
    ref = jax.lax.dot_general(a.astype(jnp.float32) * sa, b.astype(jnp.float32) * sb, dn)
    fn = None if pattern is None else PATTERNS.FP8_DOT_PATTERNS[pattern]
    out = jax.jit(lambda a, b: fp8.scaled_matmul(a, b, sa, sb, dn, jnp.float32, pattern=fn))(a, b)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("out_dtype", [jnp.float16, jnp.bfloat16])
def test_alpha_tn_large_raw_product_does_not_overflow_narrow_outputs(out_dtype):
    # Operands at E4M3's max with small scales: the raw product (448^2 * 64 ~ 1.3e7) is far
    # beyond float16's range, the scaled result (1.3e7 * 2^-16 ~ 196) is not.
    a = fp8.cast(jnp.full((4, 64), 448.0), fp8.E4M3)
    b = fp8.cast(jnp.full((64, 8), 448.0), fp8.E4M3)
    sa = sb = jnp.float32(2.0**-8)
    out = fp8.scaled_matmul(a, b, sa, sb, (((1,), (0,)), ((), ())), out_dtype)
    assert out.dtype == jnp.dtype(out_dtype)
    np.testing.assert_allclose(np.asarray(out, np.float32), 448.0**2 * 64 * 2.0**-16, rtol=1e-2)


def test_pattern_must_be_a_function():
    a = cast(X, E4M3)
    with pytest.raises(TypeError, match="benchmarks/fp8_patterns.py"):
        fp8.scaled_matmul(a, a.T, 1.0, 1.0, DN, jnp.float32, pattern="alpha_tn")




# -- MX block scaling ------------------------------------------------------------------------------
@pytest.mark.parametrize("scale_dtype", [jnp.float32, E8M0])
def test_mx_scaled_array(scale_dtype):
    x = _data((4, 64), 7) * jnp.logspace(-3, 3, 64)  # blocks with very different ranges
    sx = mx_quantize_scaled(x, E4M3, 32, axis=-1, scale_dtype=scale_dtype)
    assert isinstance(sx, scalify.ScaledArray)
    assert sx.data.shape == (4, 2, 32) and sx.data.dtype == E4M3
    assert sx.scale.shape == (4, 2, 1) and sx.scale.dtype == jnp.dtype(scale_dtype)
    back = mx_dequantize_scaled(sx, axis=-1)
    np.testing.assert_array_equal(back, fp8.mx_roundtrip(x, E4M3, 32, -1))
    # Per-block error: E4M3 rounding relative to the block's scale X; the spec puts the block
    # amax in [2^8, 2^9) X, so values above 448 X saturate to +-448 X.
    xb = np.asarray(x).reshape(4, 2, 32)
    X = np.asarray(sx.scale, np.float32)
    q = np.asarray(sx.data.astype(jnp.float32))
    err = np.abs(np.asarray(back).reshape(4, 2, 32) - xb)
    assert np.all(np.abs(q) <= 448)
    Xb = np.broadcast_to(X, xb.shape)
    bound = np.maximum(np.abs(xb) * 2.0**-4, Xb * 2.0**-10)
    bound = np.maximum(bound, np.abs(xb) - 448 * Xb)  # saturation
    assert np.all(err <= bound)
    # Along another axis.
    sy = mx_quantize_scaled(x.T, E5M2, 32, axis=0)
    assert sy.data.shape == (2, 32, 4) and sy.scale.shape == (2, 1, 4)
    np.testing.assert_array_equal(mx_dequantize_scaled(sy, axis=0), fp8.mx_roundtrip(x.T, E5M2, 32, 0))
    assert float(ml_dtypes.finfo(E4M3).max) == 448.0


def test_benchmark_script_cpu_smoke(tmp_path, monkeypatch):
    """benchmarks/fp8_gemm.py runs at tiny sizes, reports its FP8 GEMMs (0 on CPU), writes JSON."""
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_gemm.py"
    monkeypatch.syspath_prepend(str(path.parent))  # as when run as a script
    spec = importlib.util.spec_from_file_location("fp8_gemm_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--out", str(tmp_path), "--sizes", "32", "--iters", "1", "--batches", "1"])
    assert {r["case"] for r in rows} >= {"bf16", "raw", "dequant_f32", "scalify", "scalify_fp8_static"}
    assert all(r["error"] is None for r in rows)
    if not scalify.inspect.runs_fp8_gemms():
        assert all(r["f8_gemms"] == 0 for r in rows)
    else:
        assert {r["case"] for r in rows if r["f8_gemms"]} >= {"raw", "scalify_fp8_static"}
    saved = json.loads((tmp_path / "fp8_gemm.json").read_text())
    assert len(saved["rows"]) == len(rows) and (tmp_path / "hlo").is_dir()


def test_scalified_dot_with_fp8_output_saturates_never_nan():
    """FP8 operands with no preferred_element_type give an FP8 output: the linalg rule's FP8
    path accumulates in float32, scales by 1/sqrt(K) and saturates (E4M3 has no inf)."""
    a = scalify.scaled_array(cast(X * 4, E4M3), jnp.float32(2.0**-2))
    b = scalify.scaled_array(cast(W, E4M3), jnp.float32(2.0**3))
    f = jax.jit(scalify.scalify(lambda u, v: jax.lax.dot_general(u, v, DN)))
    out = f(a, b)
    assert out.dtype == E4M3 and float(out.scale) == 2.0**-2 * 2.0**3 * 8  # r = 2^3 for K=64
    ref = a.to_array(jnp.float32) @ b.to_array(jnp.float32)
    assert _rel(scalify.asarray(out, jnp.float32), ref) < 0.06
    big = scalify.scaled_array(jnp.full((4, 64), 448.0, E4M3), jnp.float32(1.0))
    sat = f(big, scalify.scaled_array(jnp.full((64, 4), 448.0, E4M3), jnp.float32(1.0)))
    data = np.asarray(sat.data.astype(jnp.float32))
    assert not np.isnan(data).any() and np.all(data == 448.0)


def test_quantize_under_vmap_with_a_scale_per_batch_element():
    x = jnp.arange(12.0).reshape(3, 4)
    s = jnp.array([1.0, 2.0, 4.0])
    out = jax.vmap(lambda x, s: quantize(x, s, E4M3))(x, s)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(x / s[:, None]))


@pytest.mark.parametrize("scalified", [False, True])
def test_wide_gradient_runs_the_backward_in_its_dtype(scalified):
    """E4M3 forward operands with a bfloat16 gradient (`grad_dtype=bfloat16`): the two
    backward dots take bfloat16 operands (the saved FP8 operands widened, exactly), not
    mixed FP8 x bfloat16 dots, and their values are those of the widened operands."""
    x, w = _data((4, 32), 11), _data((32, 8), 12)
    dn = (((1,), (0,)), ((), ()))

    def loss(a, b):
        out = fp8_dot_general(a, b, dn, grad_dtype=jnp.bfloat16, preferred_element_type=jnp.bfloat16)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    grad = jax.grad(loss, argnums=(0, 1))
    if scalified:
        grad = scalify.scalify(grad)
        args = (scalify.as_scaled_array(x), scalify.as_scaled_array(w))
    else:
        args = (x, w)
    jaxpr = jax.make_jaxpr(grad)(*args)
    # outside scalify the dots are `scaled_matmul_p` (operands, then their scales)
    dots = [e for e in equations(jaxpr) if e.primitive in (jax.lax.dot_general_p, scaled_matmul_p)]
    operand_dtypes = sorted({tuple(str(v.aval.dtype) for v in e.invars[:2]) for e in dots})
    # forward: E4M3 x E4M3; backward: bfloat16 x bfloat16 (no mixed FP8 x bfloat16 dot)
    assert operand_dtypes == [("bfloat16", "bfloat16"), ("float8_e4m3fn", "float8_e4m3fn")], operand_dtypes
    got = scalify.asarray(jax.jit(grad)(*args))
    # reference: the same math on the E4M3-rounded operands and a bfloat16-rounded cotangent
    q = lambda t: t.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    out = (q(x) @ q(w)).astype(jnp.bfloat16)
    g = (2 * out.astype(jnp.float32)).astype(jnp.bfloat16).astype(jnp.float32)
    ref = (g @ q(w).T, q(x).T @ g)
    for a, r in zip(got, ref):
        np.testing.assert_allclose(np.asarray(a, np.float32), r, rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("exp", [-40, 40])
@pytest.mark.parametrize("jit", [False, True])
def test_wide_gradient_backward_scales_exactly_with_the_inputs(exp, jit):
    """Inside scalify, the same FP8-forward / bfloat16-backward matmul with inputs 2^exp
    (2^-40 and 2^40) times larger, eagerly and under jit: the data are the same (the scales
    carry the factor), so the gradients are exactly 2^exp (d lhs = 2 out w^T) and 2^(2 exp)
    (d rhs = x^T 2 out) times the unscaled ones."""
    x, w = _data((4, 32), 11), _data((32, 8), 12)
    dn = (((1,), (0,)), ((), ()))

    def loss(a, b):
        out = fp8_dot_general(a, b, dn, grad_dtype=jnp.bfloat16, preferred_element_type=jnp.bfloat16)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    grad = scalify.scalify(jax.grad(loss, argnums=(0, 1)))
    grad = jax.jit(grad) if jit else grad
    k = np.float32(2.0**exp)
    base = scalify.asarray(grad(scalify.as_scaled_array(x), scalify.as_scaled_array(w)))
    big = scalify.asarray(grad(scalify.as_scaled_array(x * k), scalify.as_scaled_array(w)))
    np.testing.assert_array_equal(np.asarray(big[0], np.float64), np.asarray(base[0], np.float64) * 2.0**exp)
    np.testing.assert_array_equal(np.asarray(big[1], np.float64), np.asarray(base[1], np.float64) * 2.0 ** (2 * exp))
    assert np.all(np.isfinite(np.asarray(big[1]))) and np.any(np.asarray(big[1]) != 0)


# -- the weight gradient written by its GEMM in bfloat16 (rhs_grad_dtype) ----------------------
def _grads(policy, rhs_grad_dtype, scalified, x, w):
    def loss(x, w, hist):
        y = fp8_dot_general(x, w, DN, preferred_element_type=jnp.float32, scaling=policy,
                            amax_history=hist, rhs_grad_dtype=rhs_grad_dtype)
        return jnp.sum(y * G)

    grad = jax.grad(loss, argnums=(0, 1))
    if scalified:
        grad = scalify.scalify(grad)
        x, w = scalify.as_scaled_array(x), scalify.as_scaled_array(w)
    dx, dw = scalify.asarray(jax.jit(grad)(x, w, HIST))
    return np.asarray(dx), np.asarray(dw)


def _to_bf16(v):
    return np.asarray(jnp.asarray(v).astype(jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("scalified", [False, True])
@pytest.mark.parametrize("exp", [-40, 0, 40])
def test_rhs_grad_dtype_is_the_float32_gradient_rounded_to_it(policy, scalified, exp):
    """`rhs_grad_dtype=bfloat16`: the weight gradient (float32, as the kernel) is the float32
    path's gradient rounded to bfloat16, bit for bit, with inputs 2^-40, 1 and 2^40 times
    larger (the scales carry the factor inside scalify; outside, "jit" and "delayed" scale
    per tensor and "static" saturates both paths alike); the input gradient is unchanged."""
    x = X * np.float32(2.0**exp)
    dx_ref, dw_ref = _grads(policy, None, scalified, x, W)
    dx, dw = _grads(policy, jnp.bfloat16, scalified, x, W)
    assert dw.dtype == np.float32
    np.testing.assert_array_equal(dx, dx_ref)
    np.testing.assert_array_equal(dw, _to_bf16(dw_ref))
    if policy != "static" or scalified:
        assert np.count_nonzero(dw) > 0.9 * dw.size and np.all(np.isfinite(dw))


@pytest.mark.parametrize("exp", [-149, -133, -126, -100, 0, 111])
def test_dot_scaled_tn_bfloat16_output_is_the_float32_one_rounded(exp):
    """`dot_scaled_tn` into bfloat16 (its GEMM writes bfloat16, the scales one multiply)
    against the same dot into float32 rounded to bfloat16, for products of scales from 2^-149
    (float32's smallest) to 2^111: equal where the result is a normal bfloat16, within one
    subnormal step below (XLA:CPU flushes float32 subnormals, so products of scales below
    2^-126 give 0 in both). The dot itself writes bfloat16: no float32 output to cast."""
    rng = np.random.default_rng(7)
    a = cast(jnp.asarray(rng.standard_normal((16, 64)) * 8, jnp.float32), E4M3)
    b = cast(jnp.asarray(rng.standard_normal((64, 8)) * 8, jnp.float32), E5M2)
    sa, sb = jnp.float32(2.0 ** (exp // 2)), jnp.float32(2.0 ** (exp - exp // 2))
    f = jax.jit(lambda a, b, sa, sb: fp8.dot_scaled_tn(a, b, sa, sb, DN, jnp.bfloat16))
    f32 = jax.jit(lambda a, b, sa, sb: fp8.dot_scaled_tn(a, b, sa, sb, DN, jnp.float32))
    out = np.asarray(f(a, b, sa, sb).astype(jnp.float32), np.float64)
    ref = np.asarray(f32(a, b, sa, sb).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    normal = np.abs(ref) >= 2.0**-126
    np.testing.assert_array_equal(out[normal], ref[normal])
    np.testing.assert_allclose(out[~normal], ref[~normal], rtol=0, atol=2.0**-133)
    if exp >= -100:
        assert normal.mean() > 0.9
    hlo = f.lower(a, b, sa, sb).as_text()
    assert re.search(r"stablehlo.dot_general.*-> tensor<16x8xbf16>", hlo), hlo


def test_rhs_grad_dtype_gemm_writes_it_then_one_run_time_scale():
    """Inside scalify (static policy, the NanoGPT recipes'), the weight gradient's dot
    writes bfloat16 and is followed only by bfloat16 multiplies by one constant and one
    run-time scalar, then the widening to the kernel's float32: the shape XLA:GPU compiles
    to the FP8 GEMM alone. Without it, the dot writes
    float32."""
    def dots(rhs_grad_dtype):
        def loss(x, w):
            y = fp8_dot_general(x, w, DN, preferred_element_type=jnp.float32, rhs_grad_dtype=rhs_grad_dtype)
            return jnp.sum(y * G)

        grad = scalify.scalify(jax.grad(loss, argnums=1))
        jaxpr = jax.make_jaxpr(grad)(scalify.as_scaled_array(X), scalify.as_scaled_array(W))
        eqns = list(equations(jaxpr))
        found = []
        for e in eqns:
            if e.primitive is jax.lax.dot_general_p and e.outvars[0].aval.shape == W.shape:
                chain, var = [], e.outvars[0]
                while True:
                    users = [u for u in eqns if any(v is var for v in u.invars)]
                    if len(users) != 1 or users[0].primitive not in (jax.lax.mul_p, jax.lax.convert_element_type_p):
                        break
                    chain.append(users[0])
                    var = users[0].outvars[0]
                found.append((e, chain))
        return found

    (dot, chain), = dots(None)
    assert dot.outvars[0].aval.dtype == jnp.float32
    (dot, chain), = dots(jnp.bfloat16)
    assert dot.outvars[0].aval.dtype == jnp.bfloat16
    muls = [e for e in chain if e.primitive is jax.lax.mul_p]
    assert all(e.outvars[0].aval.dtype == jnp.bfloat16 for e in muls)
    traced = [e for e in muls if not any(isinstance(v, jax.extend.core.Literal) for v in e.invars)]
    assert len(traced) == 1, chain  # one run-time scale
    assert chain[-1].primitive is jax.lax.convert_element_type_p and chain[-1].outvars[0].aval.dtype == jnp.float32


@pytest.mark.parametrize("dtype", [jnp.float16, E4M3, jnp.int8])
def test_rhs_grad_dtype_must_have_float32_range(dtype):
    with pytest.raises(ValueError, match="float32's exponent range"):
        fp8_dot_general(X, W, DN, rhs_grad_dtype=dtype)


@pytest.mark.parametrize("dtypes", [(E4M3, E4M3, jnp.bfloat16), (jnp.float16, jnp.float16, jnp.float16)])
@pytest.mark.parametrize("scalified", [False, True])
def test_rhs_grad_dtype_with_16_bit_gemm_operands_rounds_after_the_gemm(dtypes, scalified):
    """A weight-gradient GEMM of 16-bit operands (FP8 forward with a bfloat16 gradient, or
    FP16 matmuls): `rhs_grad_dtype=bfloat16` rounds its float32 output, the same values as
    the default gradient rounded to bfloat16."""
    lhs_dtype, rhs_dtype, grad_dtype = dtypes

    def grads(rhs_grad_dtype):
        def loss(x, w):
            y = fp8_dot_general(x, w, DN, lhs_dtype=lhs_dtype, rhs_dtype=rhs_dtype, grad_dtype=grad_dtype,
                                preferred_element_type=jnp.float32, rhs_grad_dtype=rhs_grad_dtype)
            return jnp.sum(y * G)

        grad = jax.grad(loss, argnums=(0, 1))
        args = (X, W)
        if scalified:
            grad, args = scalify.scalify(grad), tuple(scalify.as_scaled_array(a) for a in args)
        return [np.asarray(g) for g in scalify.asarray(jax.jit(grad)(*args))]

    (dx_ref, dw_ref), (dx, dw) = grads(None), grads(jnp.bfloat16)
    np.testing.assert_array_equal(dx, dx_ref)
    np.testing.assert_array_equal(dw, _to_bf16(dw_ref))
    assert not np.array_equal(dw, dw_ref)  # the rounding happened


# -- unscaled activations: plain values between the FP8 GEMMs ------------------------------------
def _plain_activation_grads(exp_x, exp_g, unscaled, rhs_grad_dtype=jnp.bfloat16):
    """(y, dx, dw) of sum(fp8_dot(x, w) * g) inside scalify, bfloat16 x and product, float32
    kernel as a ScaledArray (a recipe's master), x and g at 2^exp_x and 2^exp_g."""
    x = (X * np.float32(2.0**exp_x)).astype(jnp.bfloat16)
    g = G * np.float32(2.0**exp_g)

    def loss(x, w):
        y = fp8_dot_general(x, w, DN, preferred_element_type=jnp.bfloat16, rhs_grad_dtype=rhs_grad_dtype,
                            unscaled_activations=unscaled)
        return jnp.sum(y.astype(jnp.float32) * g), y

    fn = jax.jit(scalify.scalify(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)))
    x_in = x if unscaled else scalify.as_scaled_array(x)
    (_, y), (dx, dw) = fn(x_in, scalify.as_scaled_array(W))
    return y, dx, dw


@pytest.mark.parametrize("exp_x, exp_g", [(0, 0), (-30, -40), (20, 40), (0, -60)])
def test_unscaled_activations_leave_plain_and_keep_the_values(exp_x, exp_g):
    """`unscaled_activations`: an unscaled bfloat16 input reaches its E4M3 cast as a value
    at scale 1, placed by the cast's drift guard, and so does the unscaled output gradient at
    E5M2: inputs 2^-30..2^20 and gradients 2^-60..2^40 neither flush nor saturate (a cast at
    scale 1 would flush the gradients below E5M2's 2^-16 and saturate at 448). The product
    and the input's gradient leave as plain bfloat16 values, within FP8's error of float32;
    at unit inputs the product is the scaled path's (`unscaled_activations=False` on a
    scaled input) and the input's gradient within FP8's error of it."""
    sx, sg = 2.0**exp_x, 2.0**exp_g
    y, dx, dw = _plain_activation_grads(exp_x, exp_g, True)
    assert not isinstance(y, scalify.ScaledArray) and not isinstance(dx, scalify.ScaledArray)
    assert y.dtype == jnp.bfloat16 and dx.dtype == jnp.bfloat16
    x32 = np.asarray(X, np.float64)
    assert _rel(np.asarray(y, np.float64) / sx, x32 @ W) < 0.06
    assert _rel(np.asarray(dx, np.float64) / sg, G @ W.T) < 0.1
    assert _rel(np.asarray(scalify.asarray(dw), np.float64) / (sx * sg), X.T @ G) < 0.1
    if exp_x == exp_g == 0:
        ys, dxs, _ = _plain_activation_grads(0, 0, False)
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(scalify.asarray(ys), np.float32))
        assert _rel(np.asarray(dx, np.float64), np.asarray(scalify.asarray(dxs), np.float64)) < 0.1


@pytest.mark.parametrize("exp_x, exp_g", [(0, 0), (-30, -40), (20, 40)])
def test_unscaled_activations_leave_the_weight_gradient_plain_too(exp_x, exp_g):
    """With no `rhs_grad_dtype` (an attention projection's `nn.DenseGeneral`), the weight
    gradient of a float32 kernel leaves its GEMM as float32 values, as the product and the
    input's gradient leave theirs, within FP8's error of float32."""
    sx, sg = 2.0**exp_x, 2.0**exp_g
    _, _, dw = _plain_activation_grads(exp_x, exp_g, True, rhs_grad_dtype=None)
    assert not isinstance(dw, scalify.ScaledArray) and dw.dtype == jnp.float32
    assert _rel(np.asarray(dw, np.float64) / (sx * sg), X.T @ G) < 0.1


def test_unscaled_activations_need_a_float32_range():
    """A float16 product (or input) cannot leave unscaled: the message says so."""
    with pytest.raises(ValueError, match="float32's exponent range"):
        fp8_dot_general(X.astype(jnp.float16), W, DN, preferred_element_type=jnp.float16, unscaled_activations=True)
    with pytest.raises(ValueError, match="float32's exponent range"):
        fp8_dot_general(X.astype(jnp.float16), W, DN, preferred_element_type=jnp.bfloat16, unscaled_activations=True)
