"""Elementwise scale rules: model invariance in float32, special values, low precision."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import scalify
from scalify import ScaledArray, scaled_array

SCALES = [2.0**-5, 2.0**7]
SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)


def _values(n, seed, domain=None):
    """n float32 values in the op's domain (default: standard normal)."""
    rng = np.random.RandomState(seed)
    x = rng.randn(n).astype(np.float32)
    if domain == "pos":
        x = np.abs(x) + np.float32(0.1)
    elif domain == "unit":  # (-1, 1)
        x = np.tanh(x).astype(np.float32) * np.float32(0.99)
    elif domain == "ge1":
        x = np.abs(x) + np.float32(1.0)
    return x


def _scaled(x, scale, dtype=np.float32):
    """ScaledArray of value x with the given power-of-two scale (exact data = x / scale)."""
    return scaled_array((np.asarray(x, np.float64) / scale).astype(dtype), np.float32(scale))


def _value(out):
    return np.asarray(out.to_array(np.float32) if isinstance(out, ScaledArray) else out)


def _check(f, *xs, rtol=1e-6):
    """scalify(f) on ScaledArray inputs equals f on their float32 values."""
    out = scalify.scalify(f)(*xs)
    ref = f(*[x.to_array(np.float32) if isinstance(x, ScaledArray) else x for x in xs])
    assert np.shape(_value(out)) == np.shape(ref)
    if not isinstance(out, ScaledArray):  # (the interpreter checks scaled outputs' dtypes)
        assert jnp.result_type(out) == jnp.result_type(ref)
    np.testing.assert_allclose(_value(out), np.asarray(ref), rtol=rtol, atol=0)
    if isinstance(out, ScaledArray):
        assert scalify.is_pow2(np.asarray(out.scale)).all()
    return out


# ---------------------------------------------------------------------------------------
# Unary ops: model invariance, special values, two scales
# ---------------------------------------------------------------------------------------
UNARY = {
    "neg": (lax.neg, None),
    "abs": (lax.abs, None),
    "sign": (lax.sign, None),
    "sqrt": (lax.sqrt, "pos"),
    "rsqrt": (lax.rsqrt, "pos"),
    "cbrt": (lax.cbrt, None),
    "square": (lax.square, None),
    "integer_pow_3": (lambda x: lax.integer_pow(x, 3), None),
    "integer_pow_-2": (lambda x: lax.integer_pow(x, -2), None),
    "integer_pow_0": (lambda x: lax.integer_pow(x, 0), None),
    "pow_2.5": (lambda x: lax.pow(x, 2.5), "pos"),
    "pow_-0.5": (lambda x: lax.pow(x, -0.5), "pos"),
    "pow_int": (lambda x: lax.pow(x, 3), None),
    "exp": (lax.exp, None),
    "exp2": (lax.exp2, None),
    "log": (lax.log, "pos"),
    "log1p": (lax.log1p, "pos"),
    "expm1": (lax.expm1, None),
    "tanh": (lax.tanh, None),
    "logistic": (lax.logistic, None),
    "erf": (lax.erf, None),
    "erfc": (lax.erfc, None),
    "erf_inv": (lax.erf_inv, "unit"),
    "sin": (lax.sin, None),
    "cos": (lax.cos, None),
    "tan": (lax.tan, "unit"),
    "atan": (lax.atan, None),
    "asin": (lax.asin, "unit"),
    "acosh": (lax.acosh, "ge1"),
    "atanh": (lax.atanh, "unit"),
    "floor": (lax.floor, None),
    "ceil": (lax.ceil, None),
    "round_even": (lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN), None),
    "round_away": (lambda x: lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO), None),
    "is_finite": (lax.is_finite, None),
    "stop_gradient": (lax.stop_gradient, None),
    "reduce_precision": (lambda x: lax.reduce_precision(x, 8, 7), None),
    "convert_f16": (lambda x: x.astype(jnp.float16), None),
    "convert_i32": (lambda x: x.astype(jnp.int32), None),
    "convert_bool": (lambda x: x.astype(jnp.bool_), None),
    "relu": (lambda x: lax.max(x, 0.0), None),
    "scale_literal": (lambda x: x * 3.0 + 0.25, None),
}


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_model_invariance(name, scale):
    f, domain = UNARY[name]
    x = _values(16, 0, domain)
    if domain in ("pos", "ge1"):  # also the value of rounding ops' interest: big ones
        x = x * np.float32(4.0)
    else:
        x = x * np.float32(4.0) if name in ("floor", "ceil") or name.startswith("round") else x
    rtol = 1e-6
    if name == "convert_f16":  # float16 output: rounding of the data, compare at fp16 ulp
        rtol = 1e-3
    _check(f, _scaled(x, scale), rtol=rtol)


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_special_values(name):
    """0, -0, inf, -inf and nan behave as in plain JAX (never a NaN that JAX does not make).
    float -> int of inf/nan is implementation-defined in XLA: scalify gives what plain JAX
    gives on the same backend."""
    f, _ = UNARY[name]
    _check(f, _scaled(SPECIAL, 2.0**-5))


def test_rounding_half_values_and_small_scale():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 0.49, 1e-3, -3.75], np.float32)
    for scale in (2.0**-20, 2.0**-1, 1.0, 2.0, 2.0**20):
        for f in (lax.floor, lax.ceil, lambda v: lax.round(v, lax.RoundingMethod.TO_NEAREST_EVEN),
                  lambda v: lax.round(v, lax.RoundingMethod.AWAY_FROM_ZERO)):
            _check(f, _scaled(x * np.float32(scale), scale))


# ---------------------------------------------------------------------------------------
# Binary ops
# ---------------------------------------------------------------------------------------
BINARY = {
    "add": lax.add,
    "sub": lax.sub,
    "mul": lax.mul,
    "div": lax.div,
    "max": lax.max,
    "min": lax.min,
    "rem": lax.rem,
    "atan2": lax.atan2,
    "pow": lambda a, b: lax.pow(lax.abs(a), b),
    "nextafter": lax.nextafter,
    "eq": lax.eq,
    "ne": lax.ne,
    "lt": lax.lt,
    "le": lax.le,
    "gt": lax.gt,
    "ge": lax.ge,
    "select": lambda a, b: lax.select(a > b, a, b),
}


def _pair(seed):
    a, b = _values(16, seed), _values(16, seed + 1)
    b[:4] = a[:4]  # ties for comparisons, exact zeros for sub
    return a, b


@pytest.mark.parametrize("scales", [(2.0**-5, 2.0**7), (2.0**7, 2.0**-5), (2.0**3, 2.0**3)])
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_model_invariance(name, scales):
    a, b = _pair(0)
    if name == "nextafter":
        # nextafter steps one ulp of the data's dtype at the common scale; a zero/tiny
        # operand at a much smaller scale would be subnormal there.
        b = b + np.float32(10.0)
    _check(BINARY[name], _scaled(a, scales[0]), _scaled(b, scales[1]))


SPECIAL_PAIRS = np.array(
    [
        (0.0, 0.0), (1.0, 0.0), (-1.0, 0.0), (0.0, -0.0), (np.inf, 1.0), (np.inf, np.inf),
        (-np.inf, np.inf), (-np.inf, -np.inf), (np.nan, 1.0), (1.0, np.nan), (0.0, np.inf),
        (2.0, -np.inf),
    ],
    np.float32,
).T  # fmt: skip


@pytest.mark.parametrize("name", sorted(set(BINARY) - {"nextafter"}))
def test_binary_special_values(name):
    a, b = SPECIAL_PAIRS
    _check(BINARY[name], _scaled(a, 2.0**-5), _scaled(b, 2.0**7))


def test_add_any_from_grad():
    """add_any appears where a value is used twice in a gradient."""
    x = _scaled(_values(8, 3), 2.0**-6)
    g = jax.grad(lambda t: jnp.sum(t * t * 3.0))
    closed = jax.make_jaxpr(g)(x.to_array())
    assert "add_any" in str(closed)
    _check(g, x)


@pytest.mark.usefixtures("arguments_as_given")
def test_add_scale_is_rms_of_scales():
    a, b = _scaled(_values(8, 0), 2.0**4), _scaled(_values(8, 1), 2.0**4)
    out = scalify.scalify(lax.add)(a, b)
    assert float(out.scale) == 2.0**4  # 2^4 * sqrt(2), rounded down
    with scalify.ScalifyConfig(rounding_mode="up", input_drift_window=None):
        assert float(scalify.scalify(lax.add)(a, b).scale) == 2.0**5


@pytest.mark.usefixtures("arguments_as_given")
def test_mul_div_exact_scales():
    a, b = _scaled(_values(8, 0), 2.0**-5), _scaled(_values(8, 1), 2.0**7)
    assert float(scalify.scalify(lax.mul)(a, b).scale) == 2.0**2
    assert float(scalify.scalify(lax.div)(a, b).scale) == 2.0**-12


@pytest.mark.usefixtures("arguments_as_given")
def test_ternary_clamp_and_select_n():
    x = _scaled(_values(16, 0), 2.0**-3)
    lo, hi = _scaled(np.float32(-0.05), 2.0**-6), _scaled(np.float32(0.1), 2.0**-4)
    out = _check(lambda l, v, h: lax.clamp(l, v, h), lo, x, hi)
    assert float(out.scale) == 2.0**-3  # largest input scale
    _check(lambda v: lax.clamp(-0.05, v, 0.1), x)  # literal bounds
    pred = np.arange(16) % 3
    y, z = _scaled(_values(16, 1), 2.0**5), _scaled(_values(16, 2), 2.0**-9)
    out = _check(lambda p, a, b, c: lax.select_n(p, a, b, c), pred, x, y, z)
    assert float(out.scale) == 2.0**5


def test_comparisons_do_not_materialise():
    """Values that overflow float32 when materialised still compare correctly."""
    a = scaled_array(np.array([1.0, 2.0, 3.0], np.float32), np.float32(2.0**100))
    b = scaled_array(np.array([2.0**40, 2.0**42, 2.0**43], np.float32), np.float32(2.0**60))
    out = scalify.scalify(lax.lt)(a, b)
    np.testing.assert_array_equal(np.asarray(out), [False, True, True])
    out = scalify.scalify(lax.eq)(a, b)
    np.testing.assert_array_equal(np.asarray(out), [True, False, False])
    # float16 data whose ratio of scales underflows float16: compared in float32.
    c = scaled_array(np.array([1.0, 0.0], np.float16), np.float32(2.0**-30))
    d = scaled_array(np.array([0.0, 0.0], np.float16), np.float32(1.0))
    np.testing.assert_array_equal(np.asarray(scalify.scalify(lax.gt)(c, d)), [True, False])


# ---------------------------------------------------------------------------------------
# Non-scalar scales
# ---------------------------------------------------------------------------------------
ROW_SCALES = (2.0 ** np.array([-6, -1, 0, 5], np.float32)).reshape(4, 1)


def _rows(seed, domain=None):
    x = _values(20, seed, domain).reshape(4, 5)
    return scaled_array((x / ROW_SCALES).astype(np.float32), ROW_SCALES)


@pytest.mark.parametrize(
    "f",
    [
        lambda x, y: x + y,
        lambda x, y: x * y,
        lambda x, y: x / y,
        lambda x, y: lax.max(x, y),
        lambda x, y: x < y,
        lambda x, y: lax.max(x, 0.0),
        lambda x, y: x + 1.0,
        lambda x, y: x > 0.5,
        lambda x, y: lax.clamp(-0.5, x, 0.5),
        lambda x, y: lax.sqrt(lax.abs(x)),
        lambda x, y: lax.cbrt(y),
        lambda x, y: lax.integer_pow(x, 3),
        lambda x, y: lax.pow(lax.abs(x), 1.5),
        lambda x, y: lax.log(lax.abs(y)),
        lambda x, y: lax.round(x * 8.0),
        lambda x, y: lax.rem(x, y),
        lambda x, y: lax.select(x > y, x, jnp.full_like(x, -jnp.inf)),
    ],
)
def test_per_row_scales(f):
    _check(f, _rows(0), _rows(1))


# ---------------------------------------------------------------------------------------
# Special values through the interpreter's "any scale" promotion
# ---------------------------------------------------------------------------------------
@pytest.mark.usefixtures("arguments_as_given")
def test_masked_select_keeps_scale_and_minus_inf():
    x = _scaled(_values(8, 0), 2.0**-5)
    mask = np.array([True, False] * 4)
    out = _check(lambda v, m: lax.select(m, v, jnp.full_like(v, -jnp.inf)), x, mask)
    assert float(out.scale) == 2.0**-5
    assert np.isneginf(np.asarray(out.data)[1::2]).all()


def test_multiply_by_zero_and_inf_literals():
    x = _scaled(_values(8, 0), 2.0**-5)
    _check(lambda v: v * 0.0, x)
    _check(lambda v: v * jnp.inf, x)
    _check(lambda v: v + jnp.nan, x)


# ---------------------------------------------------------------------------------------
# Extreme scales: overflow guards of exact scale arithmetic
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [2.0**100, 2.0**-100])
@pytest.mark.parametrize("y", [2, 3, -2])
def test_integer_pow_scale_overflow_guard(scale, y):
    x = np.array([0.0, 1.0, -1.5, np.inf, 2.0**-20], np.float32)
    sx = scaled_array(x, np.float32(scale))
    out = scalify.scalify(lambda v: lax.integer_pow(v, y))(sx)
    assert scalify.is_pow2(np.asarray(out.scale)).all()
    # Same as materialising in float32 (inf / 0 where the value leaves float32's range) ...
    _check(lambda v: lax.integer_pow(v, y), sx)
    # ... and never a NaN from 0 * inf in the guard.
    assert not np.isnan(np.asarray(out.data)[[0, 1, 2, 4]]).any()


def test_log_of_underflowing_materialisation():
    """float32 data 2^-100 at scale 2^-100: data*scale is 0 in float32, log(d)+log(s) is not."""
    data = np.array([2.0**-100, 3 * 2.0**-100, 0.0, -1.0], np.float32)
    x = scaled_array(data, np.float32(2.0**-100))
    out = scalify.scalify(lax.log)(x)
    want = np.log(np.array([1.0, 3.0], np.float64)) - 200 * np.log(2.0)
    np.testing.assert_allclose(np.asarray(out.to_array())[:2], want, rtol=1e-6)
    assert np.isneginf(np.asarray(out.to_array())[2]) and np.isnan(np.asarray(out.to_array())[3])


# ---------------------------------------------------------------------------------------
# Low precision: float16 data where plain float16 would overflow or underflow
# ---------------------------------------------------------------------------------------
def _f16(x, scale):
    return _scaled(x, scale, np.float16)


def _close_to_f32(f, *xs, rtol=2e-3):
    out = scalify.scalify(f)(*xs)
    assert out.dtype == jnp.float16
    ref = f(*[x.to_array(np.float32) for x in xs])
    np.testing.assert_allclose(_value(out), np.asarray(ref), rtol=rtol, atol=0)
    return out


@pytest.mark.parametrize("scale", [2.0**20, 2.0**-24])
@pytest.mark.parametrize(
    "f",
    [
        lambda x, y: x + y,
        lambda x, y: x - y,
        lambda x, y: x * y,
        lambda x, y: x / y,
        lambda x, y: lax.max(x, y),
        lambda x, y: lax.sqrt(lax.abs(x)),
        lambda x, y: lax.rsqrt(lax.abs(x)),
        lambda x, y: lax.integer_pow(x, 3),
        lambda x, y: lax.square(y),
        lambda x, y: lax.pow(lax.abs(x), jnp.asarray(1.5, x.dtype)),
        lambda x, y: lax.round(x),
        lambda x, y: lax.clamp(y * 0.5, x, y * 2.0),
    ],
)
def test_float16_extreme_scales(f, scale):
    """x ~ 1e6 or ~ 6e-8: out of float16's normal range, kept in range by the scale."""
    a, b = _values(16, 0), np.abs(_values(16, 1)) + np.float32(0.5)
    xs = _f16(a * np.float32(scale), scale), _f16(b * np.float32(scale), scale)
    out = _close_to_f32(f, *xs, rtol=4e-3)
    assert np.isfinite(np.asarray(out.data)).all()


def test_float16_log_small_scale():
    """log of float16 data at scale 2^-20 (values ~1e-6): plain float16 cannot hold them."""
    x = np.abs(_values(16, 0)) + np.float32(0.1)
    sx = _f16(x * np.float32(2.0**-20), 2.0**-20)
    out = _close_to_f32(lax.log, sx, rtol=1e-3)
    plain = np.log(np.asarray(x * np.float32(2.0**-20), np.float16).astype(np.float32))
    assert np.abs(plain - np.asarray(_value(out))).max() > 1e-3  # plain fp16 loses digits


def test_float16_sqrt_odd_exponent():
    x = np.abs(_values(16, 0)) + np.float32(0.1)
    sx = _f16(x * np.float32(2.0**-21), 2.0**-21)
    out = _close_to_f32(lax.sqrt, sx, rtol=1e-3)
    assert float(out.scale) == 2.0**-11
    assert np.isfinite(np.asarray(out.data)).all()


# ---------------------------------------------------------------------------------------
# Property test: additive and multiplicative rules are exact for any power-of-two scales
# ---------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(
    ea=st.integers(-40, 40),
    eb=st.integers(-40, 40),
    op=st.sampled_from(["add", "sub", "mul", "div", "max", "lt", "select"]),
)
def test_property_exact_binary(ea, eb, op):
    a, b = _pair(7)
    _check(BINARY[op], _scaled(a, 2.0**ea), _scaled(b, 2.0**eb))


# ---------------------------------------------------------------------------------------
# Activations from jax.nn
# ---------------------------------------------------------------------------------------
ACTIVATIONS = {
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_erf": functools.partial(jax.nn.gelu, approximate=False),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
}


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_jax_nn_activations(name, scale):
    f = ACTIVATIONS[name]
    x = _scaled(_values(16, 0) * np.float32(3.0), scale)
    # The tanh-gelu's polynomial adds terms at different scales: a few ulps.
    _check(f, x, rtol=1e-6 if name != "gelu_tanh" else 2e-6)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16])
def test_8_and_16_bit_data_keep_their_dtype(dtype):
    """Rules return data in the input dtype and stay within a few of its ulps of float32."""
    x = _scaled(_values(16, 0) * np.float32(2.0**-9), 2.0**-9, dtype)
    y = _scaled(_values(16, 1) * np.float32(2.0**4), 2.0**4, dtype)
    eps = float(jnp.finfo(dtype).eps)
    # (max/min are left out: at the largest scale, 2^4, the other operand's 2^-9-sized
    # values are below FP8's range, an inherent limit of one output scale.)
    fns = [lax.add, lax.sub, lax.mul,
           lambda a, b: lax.exp(a), lambda a, b: lax.sqrt(lax.abs(b)), lambda a, b: lax.tanh(b),
           lambda a, b: lax.integer_pow(b, 2), lambda a, b: lax.round(b), lambda a, b: lax.abs(a)]
    for f in fns:
        out = scalify.scalify(f)(x, y)
        assert out.dtype == dtype
        ref = np.asarray(f(x.to_array(np.float32), y.to_array(np.float32)))
        err = np.abs(_value(out) - ref)
        assert (err <= 2 * eps * np.abs(ref) + 1e-6 * np.abs(ref).max()).all(), (f, err)


@pytest.mark.usefixtures("arguments_as_given")
def test_under_jit_same_as_eager():
    """Rules trace under jax.jit (traced scales) and give the eager result and scales."""
    x = _scaled(_values(16, 0), 2.0**-5)
    f = lambda v: (lax.pow(lax.abs(v), 2.5), lax.sqrt(lax.abs(v)), lax.log(lax.abs(v)),  # noqa
                   lax.round(v * 100.0), lax.integer_pow(v, 3), v < 0.1)
    eager, jitted = scalify.scalify(f)(x), jax.jit(scalify.scalify(f))(x)
    for a, b in zip(eager, jitted):
        np.testing.assert_array_equal(_value(a), _value(b))
        if isinstance(a, ScaledArray):
            np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
    assert float(jitted[0].scale) == 2.0**-13  # s^2.5 = 2^-12.5, floored: kept under jit


@pytest.mark.parametrize("mode", ["down", "nearest", "up"])
def test_add_scale_closed_forms_match_the_rounded_formula(mode):
    """add's output scale is round_pow2(sqrt(sa^2 + sb^2)) in every rounding mode (the rule
    uses closed forms for round-down and round-to-nearest)."""
    exps = np.arange(-6, 7)
    for ea in exps:
        for eb in exps:
            sa, sb = np.float32(2.0**ea), np.float32(2.0**eb)
            with scalify.ScalifyConfig(rounding_mode=mode):
                out = scalify.scalify(lambda x, y: x + y)(
                    scalify.scaled_array(np.ones(3, np.float32), sa),
                    scalify.scaled_array(np.ones(3, np.float32), sb))
                want = scalify.pow2_round(np.float32(np.sqrt(float(sa) ** 2 + float(sb) ** 2)), mode)
            assert float(out.scale) == float(want), (mode, ea, eb)


# -- complex numbers: complex data is not scaled ----------------------------------------------
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "name, f",
    [
        ("complex_abs", lambda a, b: jnp.abs(lax.complex(a, b))),
        ("complex_angle", lambda a, b: jnp.angle(lax.complex(a * 3.0, b))),
        ("real_imag", lambda a, b: lax.real(lax.complex(a, b)) * lax.imag(lax.complex(b, a))),
        ("conj", lambda a, b: lax.imag(lax.conj(lax.complex(a, b))) + lax.real(lax.conj(a))),
        ("fft", lambda a, b: jnp.abs(jnp.fft.fft(lax.complex(a, b)))),
    ],
)
def test_complex_values_equal_plain_jax(name, f, jit):
    rng = np.random.default_rng(3)
    xa, xb = rng.normal(size=(2, 8)).astype(np.float32)
    a, b = scaled_array(xa / 2.0**-9, 2.0**-9), scaled_array(xb / 2.0**6, 2.0**6)
    g = scalify.scalify(f)
    out = (jax.jit(g) if jit else g)(a, b)
    want = (jax.jit(f) if jit else f)(xa, xb)
    out = out.to_array() if isinstance(out, ScaledArray) else out
    assert out.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_complex_output_is_a_plain_complex_array():
    a = scaled_array(np.array([1.5, -2.0], np.float32), 2.0**-3)
    out = scalify.scalify(lambda a: lax.complex(a, 2.0 * a))(a)
    assert not isinstance(out, ScaledArray) and out.dtype == jnp.complex64
    np.testing.assert_array_equal(out, lax.complex(a.to_array(), 2.0 * a.to_array()))


@pytest.mark.parametrize("jit", [False, True])
def test_all_zero_data_leave_a_guard_at_a_small_scale(jit):
    """A zero has any scale. Where a guard measures data that are all zero (the float16 cast
    guard here, the input and loop guards too), their scale goes down to ZERO_SCALE (2^-64),
    so that a stale large scale cannot win the largest-scale choice of what they meet: a
    float16 concatenation of those zeros (entering at scale 2^10) with values at 2^-40 keeps
    the values. A scale already below ZERO_SCALE is kept, and guarding again changes
    nothing (the scale does not walk down to the bottom of the range)."""
    from scalify.core.guards import rebalance_drift
    from scalify.core.scale_flow import ZERO_SCALE

    zeros = scaled_array(np.zeros((4,), np.float32), np.float32(2.0**10))
    small = scaled_array(np.array([1.0, -0.5, 0.75, 2.0], np.float16), np.float32(2.0**-40))

    def f(z, s):
        zh = z.astype(jnp.float16)  # the cast guard measures 0
        return jnp.concatenate([zh, s]), zh

    g = jax.jit(scalify.scalify(f)) if jit else scalify.scalify(f)
    with scalify.ScalifyConfig(input_drift_window=None):  # the zeros enter at 2^10
        cat, zh = g(zeros, small)
    np.testing.assert_array_equal(_value(cat), np.concatenate([np.zeros(4), small.to_array(np.float32)]))
    assert float(zh.scale) == ZERO_SCALE and not np.any(np.asarray(zh.data))
    again = rebalance_drift(rebalance_drift(zh, 4), 4)
    assert float(again.scale) == ZERO_SCALE
    low = scaled_array(np.zeros((3,), np.float16), np.float32(2.0**-100))
    assert float(rebalance_drift(low, 4).scale) == 2.0**-100


@pytest.mark.parametrize("src", [jnp.float32, jnp.bfloat16])
def test_float16_cast_of_drifted_data_keeps_values(src):
    """float32 or bfloat16 data far below unit (2^-40 at scale 2^10) cast to float16: the cast guard
    (`cast_drift_window`) moves it to unit data first, so the values survive (plain float16
    of the data would be 0); unit data keep their scale."""
    data = np.array([1.0, -3.0, 0.5, 0.0], np.float32) * np.float32(2.0**-40)  # exact in bfloat16
    x = scaled_array(jnp.asarray(data, src), np.float32(2.0**10))
    cast = lambda x: x.astype(jnp.float16)  # noqa: E731
    with scalify.ScalifyConfig(input_drift_window=None):  # the argument enters drifted
        out = jax.jit(scalify.scalify(cast))(x)
    assert out.dtype == jnp.float16
    np.testing.assert_allclose(_value(out), data * 2.0**10, rtol=2.0**-11)
    with scalify.ScalifyConfig(input_drift_window=None, cast_drift_window=None):
        off = jax.jit(scalify.scalify(cast))(x)
    assert not np.any(np.asarray(off.data))  # the data underflowed
    unit = scaled_array(jnp.asarray([1.5, -0.25], src), np.float32(2.0**-30))
    out = jax.jit(scalify.scalify(cast))(unit)
    assert float(out.scale) == 2.0**-30
    np.testing.assert_array_equal(np.asarray(out.data), np.array([1.5, -0.25], np.float16))


def test_guards_reuse_a_measured_max_abs():
    """A guard that follows another on the same data, or on data derived from it exactly (the
    rescaled data, its conversion), reads the max-abs the first one measured: float32 data
    at 2^-30 cast to float16 (cast guard: one max-reduction), then squared (power guard: no
    second one). Values as plain float32 to float16 rounding."""
    data = np.array([1.0, -3.0, 0.5, 0.0], np.float32) * np.float32(2.0**-30)
    x = scaled_array(data, np.float32(2.0**8))
    f = lambda x: x.astype(jnp.float16) ** 2  # noqa: E731
    with scalify.ScalifyConfig(input_drift_window=None):
        jaxpr = jax.make_jaxpr(scalify.scalify(f))(x)
        out = jax.jit(scalify.scalify(f))(x)
    assert str(jaxpr).count("reduce_max") == 1
    want = (data.astype(np.float64) * 2.0**8) ** 2
    np.testing.assert_allclose(_value(out), want, rtol=2.0**-10)


def _clip_then_square(g, c):
    """The gradient path of optax's clip_by_global_norm then Adam's second moment: the
    norm squares the gradient (one power guard), the clipped gradient is the gradient
    rearranged, divided and multiplied by scalars and chosen by a scalar predicate
    (`lax.select`, as optax does), and is squared again."""
    t = jnp.reshape(g.T, (-1,))
    n = jnp.sqrt(jnp.sum(jnp.square(t)))
    clipped = lax.select(n > c, (t / n.astype(t.dtype)) * c.astype(t.dtype), -t)
    return clipped ** 2, clipped


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("data_exp", [-60, -8, 0, 8, 40])
@pytest.mark.parametrize("c", [2.0**-30, 0.75, 2.0**30])
def test_guards_reuse_max_abs_through_exact_maps(dtype, data_exp, c):
    """Data derived from measured data by an exact map (reshape, transpose, negation, a
    product or quotient with a scalar, a scalar-predicate select) have a known max-abs: the
    second power guard does not reduce again, and it still moves drifted data (float32
    data at 2^-60 squared would underflow: a wrong derived maximum would leave it there).
    Values as plain float64 rounded like plain float16/float32."""
    if dtype == np.float16 and not (-8 <= data_exp <= 8 and c == 0.75):  # normal float16 data
        pytest.skip("float16 data or bound of that size is not representable")
    rng = np.random.RandomState(data_exp + 100)
    data = (rng.randn(3, 5) * 2.0**data_exp).astype(dtype)
    scale = np.float32(2.0 ** (-data_exp))
    g = scaled_array(data, scale)
    f = jax.jit(scalify.scalify(_clip_then_square))
    with scalify.ScalifyConfig(input_drift_window=None):
        jaxpr = jax.make_jaxpr(scalify.scalify(_clip_then_square))(g, np.float32(c))
        sq, clipped = f(g, np.float32(c))
    assert str(jaxpr).count("reduce_max") == 1
    ref_sq, ref_clipped = _clip_then_square(jnp.asarray(data.astype(np.float64) * np.float64(scale), jnp.float32),
                                           np.float32(c))
    rtol = 2.0**-9 if dtype == np.float16 else 2.0**-20  # a few roundings in dtype
    np.testing.assert_allclose(_value(clipped), np.asarray(ref_clipped), rtol=rtol, atol=0)
    np.testing.assert_allclose(_value(sq), np.asarray(ref_sq), rtol=4 * rtol, atol=0)


@pytest.mark.parametrize("src", [jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_cast_back_to_a_narrower_source_has_no_guard(src):
    """Data widened to float32 from float16 (or FP8) and narrowed back to float16 (a master
    weight's float32 view cast for a float16 matmul) are float16 values: the cast guard
    has nothing to move and does not reduce. Data at 2^-20 (float16 subnormals kept as
    they are, exactly), values equal to plain."""
    data = (np.array([[1.0, -3.0], [0.5, 0.0]]) * 2.0**-6).astype(src)
    x = scaled_array(data, np.float32(2.0**-14))
    f = lambda x: x.astype(jnp.float32).T.astype(jnp.float16)  # noqa: E731
    jaxpr = jax.make_jaxpr(scalify.scalify(f))(x)
    assert str(jaxpr).count("reduce_max") == 0
    # ... while float32 data of its own are guarded (2^-6 data: below the window's 2^-4)
    x32 = scaled_array(np.asarray(data, np.float32), np.float32(2.0**-14))
    assert str(jax.make_jaxpr(scalify.scalify(f))(x32)).count("reduce_max") == 1
    want = np.asarray(f(jnp.asarray(np.asarray(data, np.float32) * 2.0**-14)), np.float64)
    np.testing.assert_array_equal(_value(jax.jit(scalify.scalify(f))(x)), want)



@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_product_with_a_zero_constant_is_a_zero_at_the_bottom_scale(dtype, jit):
    """`zeros_like(x) * x + c` (a polynomial evaluated from a zero accumulator): the zero
    constant has any scale, and takes the bottom one (`ZERO_SCALE`), so the zero product
    does not carry x's scale squared into the add, where its common scale flushed `c` (in
    float16 from x at 2^12; in float32 from x at 2^64, where the squared scale left the
    range). Equal to float64 to the dtype's rounding."""
    log2 = 12 if dtype == np.float16 else 64
    data = np.asarray([1.25, -0.75, 0.5, 1.0], dtype)
    x = scaled_array(data, np.float32(2.0**log2))
    f = lambda x: (jnp.zeros_like(x) * x + 0.3) * x - 1.2  # noqa: E731
    out = (jax.jit(scalify.scalify(f)) if jit else scalify.scalify(f))(x)
    v = data.astype(np.float64) * 2.0**log2
    ref = 0.3 * v - 1.2
    got = np.asarray(out.to_array(np.float32), np.float64)
    np.testing.assert_allclose(got, ref, rtol=2.0**-9 if dtype == np.float16 else 1e-6)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("y", [1.7, 2.0, 0.5])
def test_pow_past_float32_max_is_inf_as_plain(y, jit):
    """|x|^y with x at 2^100: |x|^1.7 and x^2 overflow float32 (inf, as in plain JAX), not
    NaN (the output scale reached 2^127, whose reciprocal XLA's division-by-constant
    rewrite flushes to 0: inf * 0); x^0.5 stays finite and equal."""
    data = np.float32([1.5, 2.0, 0.75])
    x = scaled_array(data, np.float32(2.0**100))
    f = lambda x: jnp.abs(x) ** y  # noqa: E731
    out = (jax.jit(scalify.scalify(f)) if jit else scalify.scalify(f))(x)
    ref = np.asarray(f(data * np.float32(2.0**100)))
    got = np.asarray(out.to_array(np.float32))
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, ref, rtol=1e-6)


# ---------------------------------------------------------------------------------------
# products of two narrow-range tensors: placed from their measured maximum
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("op", [lax.mul, lax.div])
@pytest.mark.parametrize("dtype", [np.float16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_product_of_narrow_tensors_never_leaves_the_dtype_range(op, dtype, jit):
    """Data 2^ea and 2^eb at scales 2^sa and 2^sb (values in float32's range): the raw
    product (or quotient) of the data can overflow or flush in the dtype where the value
    itself is ordinary; the result equals the float32 value rounded to the dtype, with data
    at unit max-abs. Plain float16 of the same value would keep it: scalify must too."""
    top = float(jnp.finfo(dtype).max)
    eps = float(jnp.finfo(dtype).eps)
    f = scalify.scalify(op)
    f = jax.jit(f) if jit else f
    rng = np.random.default_rng(0)
    for ea, eb in [(8, 8), (-6, 10), (12, -12), (0, 0)]:
        for sa, sb in [(-8, -8), (-60, 50), (40, 30)]:
            a = rng.uniform(0.5, 1.0, 64) * rng.choice([-1, 1], 64)
            b = rng.uniform(0.5, 1.0, 64) * rng.choice([-1, 1], 64)
            da, db = (a * 2.0**ea).astype(np.float32), (b * 2.0**eb).astype(np.float32)
            if max(abs(da).max(), abs(db).max()) > top:
                continue  # data not representable in the dtype
            x = scaled_array(jnp.asarray(da, dtype), np.float32(2.0**sa))
            y = scaled_array(jnp.asarray(db, dtype), np.float32(2.0**sb))
            out = f(x, y)
            assert out.dtype == jnp.dtype(dtype)
            xs = np.asarray(x.data, np.float64) * 2.0**sa
            ys = np.asarray(y.data, np.float64) * 2.0**sb
            ref = xs * ys if op is lax.mul else xs / ys
            value = np.asarray(out.data, np.float64) * np.float64(out.scale)
            np.testing.assert_allclose(value, ref, rtol=2 * eps, atol=0, err_msg=f"{ea} {eb} {sa} {sb}")
            data = np.abs(np.asarray(out.data, np.float32))
            assert 1.0 <= data.max() < 2.0 + 2 * eps


@pytest.mark.parametrize("op", [lax.mul, lax.div])
def test_product_of_narrow_tensors_keeps_special_values(op):
    """inf, nan and zeros in a float16 product behave as plain float16's."""
    a = np.array([1.0, np.inf, 0.0, np.nan, -2.0, 3.0], np.float16)
    b = np.array([2.0, 1.0, 0.0, 1.0, np.inf, 0.0], np.float16)
    out = scalify.scalify(op)(scaled_array(a, np.float32(2.0**-4)), scaled_array(b, np.float32(2.0**3)))
    ref = op(a.astype(np.float32) * 2.0**-4, b.astype(np.float32) * 2.0**3)
    np.testing.assert_array_equal(np.asarray(out.to_array(np.float32)), np.asarray(ref))


def test_float32_products_are_not_placed():
    """float32 data keep the static rule (data a.data * b.data, scale sa * sb): no
    reduction, and the value is plain JAX's exactly."""
    x = scaled_array(np.float32([3.0, -0.5]), np.float32(2.0**-4))
    y = scaled_array(np.float32([2.0, 0.75]), np.float32(2.0**6))
    with scalify.ScalifyConfig(input_drift_window=None):
        out = scalify.scalify(lax.mul)(x, y)
        jaxpr = jax.make_jaxpr(scalify.scalify(lax.mul))(x, y)
    assert float(out.scale) == 2.0**2
    np.testing.assert_array_equal(np.asarray(out.data), np.float32([6.0, -0.375]))
    assert "reduce_max" not in str(jaxpr)
