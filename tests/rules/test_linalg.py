"""Scale rules of contractions (scalify/rules/linalg.py): dot_general and convolutions.

Model invariance: with float32 data and power-of-two scales != 1, the scaled dot equals the
plain one exactly (power-of-two factors commute with every product and sum). The output
scale is sa * sb * round_pow2(sqrt(K)). Low precision: a float16 chain of matmuls whose plain
float16 values overflow stays finite and accurate under scalify.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import scalify
from scalify import ScaledArray, scaled_array
from scalify.rules import linalg
from scalify.rules.linalg import contraction_scale_factor, scaled_dot_general


def _data(shape, seed, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _scaled(shape, scale, seed, dtype=np.float32):
    return scaled_array(_data(shape, seed, dtype), scale)


def _pow2(shape, seed):
    return 2.0 ** np.random.default_rng(seed + 50).integers(-6, 7, size=shape).astype(np.float32)


def _check(f, *args, rtol=1e-6):
    out = scalify.scalify(f)(*args)
    ref = f(*scalify.asarray(args))
    assert isinstance(out, ScaledArray)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    np.testing.assert_allclose(out.to_array(jnp.float32), ref.astype(jnp.float32), rtol=rtol, atol=0)
    return out


EINSUMS = {
    "attention_scores": ("bhqd,bhkd->bhqk", (2, 3, 4, 16), (2, 3, 5, 16)),
    "attention_values": ("bhqk,bhkd->bhqd", (2, 3, 4, 5), (2, 3, 5, 8)),
    "matmul": ("ij,jk->ik", (6, 32), (32, 5)),
    "matmul_t": ("ij,kj->ik", (6, 32), (5, 32)),
    "matvec": ("ij,j->i", (6, 64), (64,)),
    "vecmat": ("j,jk->k", (64,), (64, 3)),
    "inner": ("i,i->", (128,), (128,)),
    "outer": ("i,j->ij", (4,), (5,)),
    "two_contractions": ("ijk,kjl->il", (3, 4, 8), (8, 4, 2)),
    "batched_mixed": ("bij,jbk->bki", (2, 3, 9), (9, 2, 4)),
}


@pytest.mark.parametrize("name", sorted(EINSUMS))
def test_einsum_invariance_and_scale(name):
    spec, sa_shape, sb_shape = EINSUMS[name]
    a, b = _scaled(sa_shape, 2.0**-5, 0), _scaled(sb_shape, 2.0**7, 1)
    out = _check(lambda a, b: jnp.einsum(spec, a, b), a, b)
    ins, _ = spec.split("->")
    lhs, rhs = ins.split(",")
    k = math.prod(sa_shape[lhs.index(c)] for c in set(lhs) & set(rhs) if c not in spec.split("->")[1])
    assert float(out.scale) == 2.0**-5 * 2.0**7 * 2.0 ** math.floor(math.log2(math.sqrt(k)))


def test_matmul_operator_and_dot():
    a, b = _scaled((3, 4, 64), 2.0**-3, 2), _scaled((64, 6), 2.0**9, 3)
    _check(lambda a, b: a @ b, a, b)
    _check(lambda a, b: jnp.dot(a[0, 0], b), a, b)
    # An unscaled float operand is promoted with scale 1.
    w = _data((64, 6), 4)
    _check(lambda a: a @ w, a)


@pytest.mark.parametrize("mode", ["down", "nearest", "up"])
def test_output_scale_follows_rounding_mode(mode):
    a, b = _scaled((4, 48), 2.0**-2, 5), _scaled((48, 4), 2.0**3, 6)  # sqrt(48) = 6.93
    with scalify.ScalifyConfig(rounding_mode=mode):
        out = _check(lambda a, b: a @ b, a, b)
    assert float(out.scale) == 2.0 * {"down": 4.0, "nearest": 8.0, "up": 8.0}[mode]


def test_unit_scale_keeps_unit_variance_data():
    a, b = _scaled((64, 1024), 2.0**-4, 7), _scaled((1024, 64), 2.0**5, 8)
    out = scalify.scalify(lambda a, b: a @ b)(a, b)
    assert 0.5 < float(jnp.std(out.data)) < 2.0


@pytest.mark.usefixtures("arguments_as_given")
def test_data_is_one_dot_and_one_constant_multiply():
    """The FP8 path builds on this form: dot_general, then one multiply by a constant."""
    a, b = _scaled((8, 64), 2.0**-5, 9), _scaled((64, 8), 2.0**7, 10)
    # Concrete scales: a traced one would first be split into a power of two and a mantissa
    # multiplied into the data (the scalified function's argument guard).
    sf = scalify.scalify(lambda a, b: a @ b)
    jaxpr = jax.make_jaxpr(lambda da, db: sf(ScaledArray(da, a.scale), ScaledArray(db, b.scale)))(a.data, b.data)
    eqns = jaxpr.jaxpr.eqns
    dots = [i for i, e in enumerate(eqns) if e.primitive is lax.dot_general_p]
    assert len(dots) == 1
    (i,) = dots
    uses = [e for e in eqns[i + 1 :] if eqns[i].outvars[0] in e.invars]
    assert len(uses) == 1 and uses[0].primitive is lax.mul_p
    other = [v for v in uses[0].invars if v is not eqns[i].outvars[0]][0]
    assert isinstance(other, jax.extend.core.Literal) and other.val == 1 / 8
    assert dots[0] == 0 or all(e.primitive is not lax.mul_p or e.outvars[0].aval.shape == () for e in eqns[:i])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_preferred_element_type(dtype):
    a, b = _scaled((4, 32), 2.0**-5, 11, dtype), _scaled((32, 3), 2.0**7, 12, dtype)
    f = lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    out = _check(f, a, b)
    assert out.dtype == jnp.float32 and out.data.dtype == jnp.float32
    # Without preferred_element_type the output keeps the low-precision dtype.
    out = scalify.scalify(lambda a, b: a @ b)(a, b)
    assert out.dtype == dtype


def test_scaled_dot_general_function():
    a, b = _scaled((4, 16), 2.0**3, 13), _scaled((16, 5), 2.0**-1, 14)
    out = scaled_dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    np.testing.assert_allclose(out.to_array(), a.to_array() @ b.to_array(), rtol=1e-6)
    assert float(out.scale) == 2.0**3 * 2.0**-1 * 4
    assert contraction_scale_factor(16) == 4.0 and contraction_scale_factor(0) == 1.0


def test_scaled_dot_general_precision_none_follows_the_default_matmul_precision():
    """Called directly with precision=None, the dot binds what `lax.dot_general` binds: the
    `jax_default_matmul_precision` setting (tests/conftest.py: "highest"). A raw None would
    run float32 matmuls in TF32 on NVIDIA GPUs (CPU ignores precision, so only the bound
    parameter shows it here)."""
    a, b = _scaled((4, 16), 2.0**3, 13), _scaled((16, 5), 2.0**-1, 14)
    dn = (((1,), (0,)), ((), ()))

    def bound(f):
        eqns = jax.make_jaxpr(f)(a, b).jaxpr.eqns
        return [e.params["precision"] for e in eqns if e.primitive is lax.dot_general_p]

    expected = bound(lambda x, y: lax.dot_general(x.data, y.data, dn))
    assert expected == [(lax.Precision.HIGHEST, lax.Precision.HIGHEST)]
    assert bound(lambda x, y: scaled_dot_general(x, y, dn).data) == expected
    with jax.default_matmul_precision("bfloat16"):
        assert bound(lambda x, y: scaled_dot_general(x, y, dn).data) == [(lax.Precision.DEFAULT,) * 2]
    assert bound(lambda x, y: scaled_dot_general(x, y, dn, precision=lax.Precision.HIGH).data) == [
        (lax.Precision.HIGH,) * 2
    ]


# -- non-scalar scales ------------------------------------------------------------------------
NONSCALAR = {
    # name: (spec, a shape, a scale shape, b shape, b scale shape, expected out scale shape)
    "row_x_col": ("ij,jk->ik", (6, 32), (6, 1), (32, 5), (5,), (6, 5)),
    "row_only": ("ij,jk->ik", (6, 32), (6, 1), (32, 5), (), (6, 1)),
    "col_only": ("ij,jk->ik", (6, 32), (), (32, 5), (1, 5), (1, 5)),
    "contracting_a": ("ij,jk->ik", (6, 32), (32,), (32, 5), (), ()),
    "contracting_both": ("ij,jk->ik", (6, 32), (6, 32), (32, 5), (32, 1), (6, 1)),
    "batched_per_head": ("bhqd,bhkd->bhqk", (2, 3, 4, 8), (1, 3, 1, 1), (2, 3, 5, 8), (2, 1, 1, 1), (2, 3, 1, 1)),
    "batched_free": ("bqd,bkd->bqk", (2, 4, 8), (2, 4, 1), (2, 5, 8), (1, 5, 8), (2, 4, 5)),
    "matvec_rows": ("ij,j->i", (6, 16), (6, 1), (16,), (16,), (6,)),
}


@pytest.mark.parametrize("name", sorted(NONSCALAR))
def test_nonscalar_scales(name):
    spec, ash, ass, bsh, bss, expected = NONSCALAR[name]
    a = scaled_array(_data(ash, 15), _pow2(ass, 15))
    b = scaled_array(_data(bsh, 16), _pow2(bss, 16))
    out = _check(lambda a, b: jnp.einsum(spec, a, b), a, b)
    assert np.shape(out.scale) == expected



@pytest.mark.parametrize("jit", [False, True])
def test_contraction_over_steps_ignores_the_scale_of_an_all_zero_step(jit):
    """float16 per-step gradients stacked by a scan, one scale per step (T, 1, 1), contracted
    over the steps: the masked last step is exactly zero and kept the scale its zeros
    started with (2^1), the other steps sit near 2^-30. The common scale of the contraction
    is the largest among the non-zero elements: equal to float32 to float16 rounding (the
    largest scale of all, 2^1, flushed every other step to zero)."""
    rng = np.random.default_rng(5)
    t = 6
    data = rng.standard_normal((t, 4, 8)).astype(np.float16)
    data[-1] = 0
    steps = np.float32([2.0**-30, 2.0**-29, 2.0**-31, 2.0**-30, 2.0**-28, 2.0]).reshape(t, 1, 1)
    g = scaled_array(data, steps)
    v = rng.standard_normal((t, 4, 5)).astype(np.float16)
    f = lambda g, v: jnp.einsum("tbk,tbn->kn", g, v)  # noqa: E731
    out = (jax.jit(scalify.scalify(f)) if jit else scalify.scalify(f))(g, v)
    ref = np.einsum("tbk,tbn->kn", data.astype(np.float64) * steps, v.astype(np.float64))
    np.testing.assert_allclose(np.asarray(out.to_array(np.float32), np.float64), ref, rtol=0,
                               atol=2.0**-8 * np.max(np.abs(ref)))

# -- convolutions -------------------------------------------------------------------------
CONVS = {
    # name: (lhs shape, rhs shape, kwargs, K)
    "1d_same_stride": ((2, 3, 16), (4, 3, 5), dict(window_strides=(2,), padding="SAME"), 15),
    "1d_dilated": ((2, 3, 16), (4, 3, 3), dict(window_strides=(1,), padding="VALID", rhs_dilation=(2,)), 9),
    "2d_nchw": ((2, 3, 8, 8), (4, 3, 3, 3), dict(window_strides=(1, 1), padding=((1, 1), (0, 2))), 27),
    "2d_nhwc": (
        (2, 8, 8, 6),
        (3, 3, 2, 6),
        dict(
            window_strides=(2, 1),
            padding="SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=3,
        ),
        18,
    ),
    "2d_transposed": ((1, 2, 5, 5), (3, 2, 3, 3), dict(window_strides=(1, 1), padding=((1, 1), (1, 1)), lhs_dilation=(2, 2)), 18),
    "2d_batch_groups": ((4, 2, 6, 6), (4, 2, 3, 3), dict(window_strides=(1, 1), padding="VALID", batch_group_count=2), 18),
}


@pytest.mark.parametrize("name", sorted(CONVS))
def test_conv_invariance_and_scale(name):
    lsh, rsh, kw, k = CONVS[name]
    lhs, rhs = _scaled(lsh, 2.0**-5, 17), _scaled(rsh, 2.0**7, 18)
    out = _check(lambda l, r: lax.conv_general_dilated(l, r, **kw), lhs, rhs)
    assert float(out.scale) == 2.0**2 * 2.0 ** math.floor(math.log2(math.sqrt(k)))


@pytest.mark.parametrize(
    "lss, rss, expected",
    [
        ((2, 1, 1, 1), (4, 1, 1, 1), (2, 4, 1, 1)),  # per-example x per-output-channel
        ((), (4, 1, 1, 1), (1, 4, 1, 1)),
        ((1, 3, 1, 1), (1, 3, 1, 1), ()),  # varies along input channels: collapsed
        ((2, 3, 8, 8), (4, 3, 3, 3), (2, 4, 1, 1)),
    ],
)
def test_conv_nonscalar_scales(lss, rss, expected):
    lhs = scaled_array(_data((2, 3, 8, 8), 19), _pow2(lss, 19))
    rhs = scaled_array(_data((4, 3, 3, 3), 20), _pow2(rss, 20))
    out = _check(lambda l, r: lax.conv_general_dilated(l, r, (1, 1), "SAME"), lhs, rhs)
    assert np.shape(out.scale) == expected


def test_conv_nhwc_per_channel_weight_scale():
    lhs = _scaled((2, 6, 6, 4), 2.0**-3, 21)
    rhs = scaled_array(_data((3, 3, 4, 5), 22), _pow2((5,), 22))  # HWIO, per output channel
    f = lambda l, r: lax.conv_general_dilated(l, r, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    out = _check(f, lhs, rhs)
    assert np.shape(out.scale) == (1, 1, 1, 5)


def test_conv_preferred_element_type():
    lhs, rhs = _scaled((1, 2, 8), 2.0**-5, 23, jnp.bfloat16), _scaled((3, 2, 3), 2.0**6, 24, jnp.bfloat16)
    f = lambda l, r: lax.conv_general_dilated(l, r, (1,), "SAME", preferred_element_type=jnp.float32)
    out = _check(f, lhs, rhs)
    assert out.dtype == jnp.float32


# -- low precision ----------------------------------------------------------------------------
@pytest.mark.parametrize("n_layers, log2_w_std", [(24, 0), (64, -3)])
def test_float16_matmul_chain_stays_finite(n_layers, log2_w_std):
    """x <- x @ W + b in float16, width 256, W = w_std * N(0, 1) not divided by sqrt(fan_in).

    Each layer multiplies the magnitude by ~16 * w_std: plain float16 overflows after a few
    layers (2^4 per layer, or 2^1 per layer); scalify keeps the data near unit scale and the
    magnitude in the (float32) scale. W is given as unit-variance data with scale w_std, as
    unit scaling assumes. (Chain lengths keep the reference and the scales below 2^127.)
    """
    width, w_std = 256, 2.0**log2_w_std
    rng = np.random.default_rng(25)
    x = rng.standard_normal((8, width)).astype(np.float16)
    wd = [rng.standard_normal((width, width)).astype(np.float16) for _ in range(n_layers)]
    bs = [rng.standard_normal((width,)).astype(np.float16) for _ in range(n_layers)]

    def net(x, ws, bs):
        for w, b in zip(ws, bs):
            x = x @ w + b
        return x

    ws = [(w.astype(np.float32) * w_std).astype(np.float16) for w in wd]  # exact: power of two
    ref = np.asarray(net(x.astype(np.float32), [w.astype(np.float32) for w in ws], [b.astype(np.float32) for b in bs]))
    assert np.isfinite(ref).all()
    assert not np.isfinite(np.asarray(net(jnp.asarray(x), ws, bs), np.float32)).all()

    # One jitted scalified layer applied n_layers times (compiling the unrolled chain is slow).
    layer = jax.jit(scalify.scalify(lambda x, w, b: x @ w + b))
    out = scalify.as_scaled_array(jnp.asarray(x))
    for w, b in zip(wd, bs):
        out = layer(out, scaled_array(w, w_std), scalify.as_scaled_array(jnp.asarray(b)))
    assert out.dtype == jnp.float16
    data = np.asarray(out.data, np.float32)
    assert np.isfinite(data).all() and 0.25 < data.std() < 8
    got = np.asarray(out.to_array(jnp.float32), np.float64)
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref.astype(np.float64))
    assert rel < 2e-2, rel


def test_fp8_operand_layout_is_configuration_and_part_of_the_trace_key():
    """An FP8 dot whose rhs contracts its major dim: "barrier" transposes it behind an
    optimization_barrier, "transpose" without it, "none" leaves it to XLA; the same
    scalified function re-traces under each ScalifyConfig."""
    e4m3 = jnp.float8_e4m3fn
    a = scaled_array(jnp.ones((8, 16), e4m3), 1.0)
    b = scaled_array(jnp.ones((16, 4), e4m3), 1.0)
    f = scalify.scalify(lambda a, b: jax.lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32))
    prims = {}
    for mode in ("barrier", "transpose", "none"):
        with scalify.ScalifyConfig(fp8_operand_layout=mode):
            jaxpr = jax.make_jaxpr(lambda a, b: f(a, b))(a, b)  # a new function: make_jaxpr caches
            np.testing.assert_array_equal(f(a, b).to_array(jnp.float32), np.full((8, 4), 16.0))
        prims[mode] = {e.primitive.name for e in jaxpr.eqns}
    assert {"transpose", "optimization_barrier"} <= prims["barrier"]
    assert "transpose" in prims["transpose"] and "optimization_barrier" not in prims["transpose"]
    assert not {"transpose", "optimization_barrier"} & prims["none"]
    assert f.cache_size() == 3
    with pytest.raises(ValueError, match="fp8_operand_layout"):
        scalify.ScalifyConfig(fp8_operand_layout="tn")


@pytest.mark.parametrize("placement,accumulator", [("bound", "float32"), ("measure", "float32"), ("measure", "bfloat16")])
@pytest.mark.parametrize("log2_scale", [-40, 0, 40])
def test_fp8_dot_float16_output_placements(placement, accumulator, log2_scale):
    """E4M3 x E4M3 -> float16 with operands at the format's max: the raw products reach
    448^2 * K = 2^27.6 (K = 1024), beyond float16's max. Every placement
    (`ScalifyConfig.narrow_dot_placement`) and accumulator (`narrow_dot_accumulator`, for
    "measure") gives the exact product of the FP8 values (float64 reference) up to the
    output's roundings, relative to its max-abs: float16's half-ulp 2^-11 of an element
    (<= 2^-10 of the max), plus bfloat16's 2^-9 for the bfloat16 accumulator (<= 2^-8).
    "measure" leaves unit max-abs data; "bound" places the Cauchy-Schwarz bound of the
    aligned column (here the exact max, 448^2 K / 32) below 2^8, accumulating in float32.
    The accumulator is the dot's own output type, not a later cast."""
    e4m3 = jnp.float8_e4m3fn
    rng = np.random.default_rng(7)
    k = 1024
    a = (448.0 * rng.choice([-1.0, 1.0], size=(16, k))).astype(e4m3)
    b = np.asarray(rng.standard_normal((k, 8)) * 64.0, np.float32).astype(e4m3)
    b[:, 0] = np.asarray(a[0], np.float32)  # one column aligned with a row: output 448^2 * K
    scale = 2.0**log2_scale
    ref = (np.asarray(a, np.float64) @ np.asarray(b, np.float64)) * scale * scale
    f = lambda x, y: lax.dot_general(x, y, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float16)
    args = (scaled_array(a, scale), scaled_array(b, scale))
    with scalify.ScalifyConfig(narrow_dot_placement=placement, narrow_dot_accumulator=accumulator):
        out = jax.jit(scalify.scalify(f))(*args)
        jaxpr = str(jax.make_jaxpr(scalify.scalify(f))(*args))
    assert f"preferred_element_type={accumulator}" in jaxpr
    assert out.dtype == jnp.float16
    data = np.asarray(out.data, np.float32)
    top = (1, 2) if placement == "measure" else (2.0**7, 2.0**8)
    assert np.isfinite(data).all() and top[0] <= np.abs(data).max() < top[1]
    got = np.asarray(out.to_array(jnp.float32), np.float64)
    assert np.abs(ref).max() > 2.0**27 * scale * scale
    tol = 2.0**-10 if accumulator == "float32" else 2.0**-8
    assert np.abs(got - ref).max() <= tol * np.abs(ref).max()


def test_narrow_dot_accumulator_is_checked():
    with pytest.raises(ValueError, match="narrow_dot_accumulator"):
        scalify.ScalifyConfig(narrow_dot_accumulator="float16")


def _narrow_dot(a, b, placement, dn=(((1,), (0,)), ((), ())), jit=True):
    f = lambda x, y: lax.dot_general(x, y, dn, preferred_element_type=jnp.float16)
    g = scalify.scalify(f)
    with scalify.ScalifyConfig(narrow_dot_placement=placement):
        return (jax.jit(g) if jit else g)(a, b), str(jax.make_jaxpr(scalify.scalify(f))(a, b))


@pytest.mark.parametrize("dtypes", [("float16", "float16"), ("float8_e4m3fn", "float8_e5m2")])
@pytest.mark.parametrize("case", ["aligned_max", "random", "tiny"])
@pytest.mark.parametrize("log2_scale", [-40, 0, 40])
@pytest.mark.parametrize("jit", [True, False])
def test_narrow_dot_bound_placement(dtypes, case, log2_scale, jit):
    """"bound" placement of a float16 dot output: data below 2^NARROW_DOT_TOP for any
    operands (Cauchy-Schwarz), including the worst case where a row of a is aligned with a
    column of b at the formats' max (the bound is then the exact max); the values equal the
    float64 product of the operands up to float16's rounding (half-ulp 2^-11 of an element,
    <= 2^-10 of the max), plus bfloat16's 2^-9 for FP8 operands (their default
    `narrow_dot_accumulator`); tiny operands (float16 subnormals) keep their product.
    Eagerly and under jit."""
    da, db = (jnp.dtype(d) for d in dtypes)
    rng = np.random.default_rng(3)
    k = 512
    if case == "aligned_max":
        a = float(jnp.finfo(da).max) * rng.choice([-1.0, 1.0], size=(8, k))
        b = rng.standard_normal((k, 16)) * 0.5
        b[:, 0] = np.sign(a[0]) * float(jnp.finfo(db).max)
    elif case == "random":
        a, b = rng.standard_normal((8, k)), rng.standard_normal((k, 16)) * 8
    else:
        a, b = rng.standard_normal((8, k)) * 2.0**-20, rng.standard_normal((k, 16)) * 2.0**-20
    a, b = np.asarray(a, np.float32).astype(da), np.asarray(b, np.float32).astype(db)
    scale = 2.0**log2_scale
    ref = (np.asarray(a, np.float64) @ np.asarray(b, np.float64)) * scale * scale
    out, _ = _narrow_dot(scaled_array(a, scale), scaled_array(b, scale), "bound", jit=jit)
    data = np.abs(np.asarray(out.data, np.float32))
    assert out.dtype == jnp.float16 and np.isfinite(data).all()
    assert data.max() < 2.0**linalg.NARROW_DOT_TOP
    if case == "aligned_max":  # the bound is reached: the top binade below 2^8
        assert data.max() >= 2.0 ** (linalg.NARROW_DOT_TOP - 1)
    got = np.asarray(out.to_array(jnp.float32), np.float64)
    tol = 2.0**-8 if da.itemsize == 1 else 2.0**-10
    assert np.abs(got - ref).max() <= tol * np.abs(ref).max()


def test_narrow_dot_bound_zero_and_nonfinite_operands():
    """A zero operand gives zeros with a finite scale; an inf in an operand gives the
    inf/NaN outputs of the plain product, not a silently finite result."""
    a = scaled_array(np.zeros((4, 32), np.float16), 1.0)
    b = scaled_array(np.ones((32, 8), np.float16), 1.0)
    out, _ = _narrow_dot(a, b, "bound")
    assert np.all(np.asarray(out.to_array(jnp.float32)) == 0) and np.isfinite(float(out.scale))
    ai = np.ones((4, 32), np.float16)
    ai[1, 3] = np.inf
    out, _ = _narrow_dot(scaled_array(ai, 1.0), b, "bound")
    plain = np.asarray(ai, np.float32) @ np.ones((32, 8), np.float32)
    got = np.asarray(out.to_array(jnp.float32))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(plain))


def test_narrow_dot_auto_placement_follows_the_sizes():
    """"auto" bounds from the operands where the output is larger than both operands (a
    forward matmul into a wider layer: the L2 norms' reduce_sum appears in the trace) and
    measures the output otherwise (a narrowing matmul, a weight gradient); the values agree
    with the explicit placements."""
    rng = np.random.default_rng(5)
    x = scaled_array(rng.standard_normal((64, 16)).astype(np.float16), 2.0**-3)
    w_wide = scaled_array(rng.standard_normal((16, 64)).astype(np.float16), 2.0**5)
    w_narrow = scaled_array(rng.standard_normal((16, 4)).astype(np.float16), 2.0**5)
    for w, bound in ((w_wide, True), (w_narrow, False)):
        out, jaxpr = _narrow_dot(x, w, "auto")
        assert ("reduce_sum" in jaxpr) == bound
        ref, _ = _narrow_dot(x, w, "bound" if bound else "measure")
        np.testing.assert_array_equal(out.to_array(jnp.float32), ref.to_array(jnp.float32))


def test_narrow_dot_bound_with_batch_dims():
    """Batched dots (attention-like): the bound is the max over batch and free dims; values
    as the float32 product."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 8, 32)).astype(np.float16) * np.float16(4)
    k = rng.standard_normal((2, 32, 8)).astype(np.float16)
    dn = (((2,), (1,)), ((0,), (0,)))
    out, _ = _narrow_dot(scaled_array(q, 2.0**10), scaled_array(k, 2.0**-30), "bound", dn)
    ref = np.einsum("bik,bkj->bij", q.astype(np.float64), k.astype(np.float64)) * 2.0**-20
    got = np.asarray(out.to_array(jnp.float32), np.float64)
    assert np.abs(np.asarray(out.data, np.float32)).max() < 2.0**linalg.NARROW_DOT_TOP
    assert np.abs(got - ref).max() <= 2.0**-10 * np.abs(ref).max()


def test_narrow_dot_placement_is_checked():
    with pytest.raises(ValueError, match="narrow_dot_placement"):
        scalify.ScalifyConfig(narrow_dot_placement="max")



def _conv(l, r):
    return lax.conv_general_dilated(l, r, (1, 1), "SAME", precision=lax.Precision.HIGHEST)


RANGE_CASES = {  # name: (function, operand shapes, number of scale factors in the value)
    "dot": (lambda a, b: a @ b, ((4, 8), (8, 8)), 2),
    "dot_chain": (lambda a, b: (a @ b) @ b, ((4, 8), (8, 8)), 3),
    "per_row_dot": (lambda a, b: a @ b, ((4, 8), (8, 8)), 2),
    "conv": (_conv, ((1, 3, 8, 8), (4, 3, 3, 3)), 2),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("e", [-70, 70])
@pytest.mark.parametrize("name", sorted(RANGE_CASES))
def test_output_scale_beyond_float32_range_keeps_the_value(name, e, jit):
    """Operands at scales 2^-70 (2^70): the product of their scales, 2^-140 (2^140), is beyond
    float32's range. The output scale is clamped to the range and the rest goes into the
    data, so the value is kept where plain float32 flushes it to 0 (overflows to inf), and
    multiplies by 2^(-e) bring it back, equal to the exact value. Before the clamp the scale
    was 0 (inf): a ScaleError eagerly, 0 or NaN under jit."""
    f, shapes, n = RANGE_CASES[name]
    datas = [_data(s, 40 + i) for i, s in enumerate(shapes)]
    row = 2.0 ** (np.arange(4) - 2) if name == "per_row_dot" else np.ones(4)
    scales = [np.float32(2.0**e) for _ in shapes]
    if name == "per_row_dot":
        scales[0] = (scales[0] * row.reshape(4, 1)).astype(np.float32)
    back = np.float32(2.0**-e)

    def g(*xs):
        y = f(*xs)
        for _ in range(n - 1):
            y = y * back
        return y

    out = (jax.jit(scalify.scalify(g)) if jit else scalify.scalify(g))(
        *[scaled_array(d, s) for d, s in zip(datas, scales)]
    )
    assert np.all(np.isfinite(np.asarray(out.scale))) and np.all(np.asarray(out.scale) > 0)
    # exact value: f of the data (float64 dots; float32 conv at HIGHEST) times 2^e (row factors)
    d64 = [np.asarray(d, np.float64) for d in datas]
    raw = np.asarray(_conv(*datas), np.float64) if name == "conv" else f(d64[0] * row.reshape(4, 1), *d64[1:])
    ref = raw * 2.0**e
    got = np.asarray(scalify.asarray(out), np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * np.max(np.abs(ref)))
    with np.errstate(all="ignore"):
        plain = np.asarray(g(*[np.asarray(d * np.asarray(s, np.float64), np.float32) for d, s in zip(datas, scales)]))
    assert not np.allclose(plain, ref, rtol=1e-3, atol=0)  # what plain float32 gives instead


@pytest.mark.parametrize("window", [None, 32])
def test_dot_drift_window_keeps_float32_weight_gradients_of_a_deep_mlp(window):
    """A 12-layer float32 ReLU MLP with weights entered at scale 1 (data ~1/sqrt(K), not unit
    variance): the static output scale sa * sb * sqrt(K) grows 2^3 per layer while the values
    do not, and the first layer's weight gradient leaves with data near 2^-36, so the row of
    an input feature 2^-100 below the others (values near 2^-100, normal float32 numbers) is
    flushed by float32. With the drift guard
    on float32 contractions (`dot_drift_window`) the gradient equals plain JAX's element by
    element; without it (the default) the smallest elements are lost."""
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((64, 64)) / 8).astype(np.float32) for _ in range(12)]
    x = rng.standard_normal((32, 64)).astype(np.float32)
    x[:, 5] *= 2.0**-100  # a feature whose weight gradients sit 2^-100 below the others

    def loss(ws, x):
        h = x
        for w in ws:
            h = jax.nn.relu(h @ w)
        return jnp.sum(h)

    g = jax.jit(jax.grad(loss))(ws, x)[0]
    with scalify.ScalifyConfig(dot_drift_window=window):
        sg = jax.jit(scalify.scalify(jax.grad(loss)))([scaled_array(w, np.float32(1.0)) for w in ws], x)[0]
    got, ref = np.asarray(sg.to_array(np.float32)), np.asarray(g)
    small = ref[5] != 0
    assert small.any()
    if window is None:
        assert np.abs(np.asarray(sg.data)).max() < 2.0**-30  # the drifted data
        assert not np.allclose(got[5][small], ref[5][small], rtol=1e-3, atol=0)
    else:
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=0)
