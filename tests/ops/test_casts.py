import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import scalify
from scalify.ops.casts import (
    cast,
    cast_on_backward,
    cast_on_forward,
    reduce_precision,
    reduce_precision_on_backward,
    reduce_precision_on_forward,
)

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
FP8 = [E4M3, E5M2]
SPECIAL = np.array([0.0, -0.0, 1.0, -3.3, 1e-12, 447.0, 449.0, 500.0, 6e4, 1e6, -1e30,
                    np.inf, -np.inf, np.nan], np.float32)


def _f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("src", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_fp8_cast_saturates_never_nan(dtype, src):
    x = jnp.asarray(SPECIAL).astype(src)
    y = _f32(cast(x, dtype))
    fmax = float(ml_dtypes.finfo(dtype).max)
    xf = _f32(x)
    nan_in = np.isnan(xf)
    assert np.array_equal(np.isnan(y), nan_in), "NaN only where the input is NaN"
    finite_big = np.isfinite(xf) & (np.abs(xf) > fmax)
    assert np.all(np.abs(y[finite_big]) == fmax)
    if dtype == E4M3:  # no infinity: inf saturates
        assert np.all(np.abs(y[np.isinf(xf)]) == fmax)
    else:  # E5M2 keeps inf as inf
        assert np.all(np.isinf(y[np.isinf(xf)]))
    # A plain astype does produce NaN on E4M3 overflow: the reason saturation exists.
    if dtype == E4M3:
        # (449 still rounds to 448; from 464 = 448 + half an ulp on, astype gives NaN.)
        assert np.isnan(_f32(x.astype(dtype))[np.isfinite(xf) & (np.abs(xf) >= 464)]).all()


@pytest.mark.parametrize("dtype", FP8 + [jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)])
def test_cast_rounds_to_nearest_even(dtype):
    rng = np.random.default_rng(0)
    fmax = float(ml_dtypes.finfo(dtype).max)
    x = (rng.standard_normal(4096) * rng.choice([1e-3, 1.0, 30.0], 4096)).astype(np.float32)
    x = np.clip(x, -fmax, fmax)
    expected = x.astype(dtype).astype(np.float32)  # ml_dtypes: IEEE round-to-nearest-even
    np.testing.assert_array_equal(_f32(cast(x, dtype)), expected)
    np.testing.assert_array_equal(_f32(jax.jit(lambda v: cast(v, dtype))(x)), expected)
    # Ties go to even: 1 + eps/2 (halfway between 1 and 1 + eps) rounds to 1.
    eps = float(ml_dtypes.finfo(dtype).eps)
    assert _f32(cast(jnp.float32(1 + eps / 2), dtype)) == 1.0
    assert _f32(cast(jnp.float32(1 + 1.5 * eps), dtype)) == 1 + 2 * eps


def test_non_fp8_cast_follows_ieee_unless_saturate():
    x = jnp.float32(1e6)
    assert np.isinf(_f32(cast(x, jnp.float16)))
    assert _f32(cast(x, jnp.float16, saturate=True)) == 65504.0
    with pytest.raises(TypeError, match="floating-point"):
        cast(jnp.arange(3), E4M3)


def test_reduce_precision_keeps_container_and_fp8_range():
    x = jnp.asarray(SPECIAL, jnp.float32)
    y = reduce_precision(x, E4M3)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(_f32(y), _f32(cast(x, E4M3)))
    # lax.reduce_precision with E4M3's bit counts would model an IEEE format (max 240, inf).
    assert float(reduce_precision(jnp.float32(400.0), E4M3)) == 384.0
    # bfloat16 in a float16 container: the way back saturates instead of overflowing.
    z = reduce_precision(jnp.float16(65504.0), jnp.bfloat16)
    assert z.dtype == jnp.float16 and float(z) == 65504.0


@pytest.mark.parametrize("dtype", FP8)
def test_cast_on_forward_grad_is_identity(dtype):
    x = jnp.array([0.3, -1.7, 600.0, 2e5], jnp.float32)
    y = cast_on_forward(x, dtype)
    assert y.dtype == dtype
    w = jnp.array([1.5, -2.0, 3.0, 0.25], jnp.float32)
    g = jax.grad(lambda v: jnp.sum(cast_on_forward(v, dtype).astype(jnp.float32) * w))(x)
    assert g.dtype == jnp.float32
    np.testing.assert_array_equal(g, w)  # no rounding, no saturation of the gradient


@pytest.mark.parametrize("dtype", FP8)
def test_cast_on_backward_rounds_gradient_only(dtype):
    x = jnp.array([0.3, -1.7, 600.0, 2e5], jnp.float32)
    np.testing.assert_array_equal(cast_on_backward(x, dtype), x)  # forward identity
    w = jnp.array([0.1, -1e6, 3.0, 1e30], jnp.float32)
    for fn in (cast_on_backward, reduce_precision_on_backward):
        g = jax.grad(lambda v: jnp.sum(fn(v, dtype) * w))(x)
        assert g.dtype == jnp.float32
        np.testing.assert_array_equal(g, _f32(cast(w, dtype)))
        assert not np.isnan(g).any()


def test_reduce_precision_on_forward():
    x = jnp.array([0.3, -1.7, 600.0], jnp.bfloat16)
    y = reduce_precision_on_forward(x, E4M3)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_f32(y), _f32(cast(x, E4M3)))
    g = jax.grad(lambda v: jnp.sum(reduce_precision_on_forward(v, E4M3).astype(jnp.float32) * 0.1))(x)
    np.testing.assert_array_equal(_f32(g), _f32(jnp.full(3, 0.1, jnp.bfloat16)))


def test_directional_casts_jit_vmap():
    x = jnp.linspace(-600, 600, 12, dtype=jnp.float32).reshape(3, 4)
    f = jax.jit(jax.vmap(lambda v: cast_on_forward(v, E4M3)))
    np.testing.assert_array_equal(_f32(f(x)), _f32(cast(x, E4M3)))
    g = jax.jit(jax.grad(lambda v: jnp.sum(cast_on_backward(v, E5M2) * 1e5)))(x)
    assert float(g[0, 0]) == 57344.0


@pytest.mark.usefixtures("arguments_as_given")
@pytest.mark.parametrize("fn", [cast, reduce_precision, cast_on_forward, reduce_precision_on_forward])
def test_scaled_array_data_cast_scale_kept(fn):
    # Value 2^20 * [0.3, 1.7, ...]: plain E4M3 saturates to 448, the scaled cast keeps it.
    # (Data inside E4M3's range: the cast guard leaves it where it is.)
    scale = jnp.float32(2.0**20)
    sx = scalify.scaled_array(jnp.array([0.3, -1.7, 300.0, 440.0]), scale)
    for out in (fn(sx, E4M3), scalify.scalify(lambda v: fn(v, E4M3))(sx)):
        assert isinstance(out, scalify.ScaledArray)
        assert float(out.scale) == 2.0**20
        np.testing.assert_array_equal(_f32(out.data), _f32(cast(sx.data, E4M3)))
    plain = _f32(fn(sx.to_array(), E4M3))
    assert np.all(np.abs(plain) <= 448)


def test_scalify_grad_of_directional_cast():
    scale = jnp.float32(2.0**-12)
    sx = scalify.scaled_array(jnp.array([0.3, -1.7, 3.0]), scale)
    w = jnp.array([2.0, 0.5, -4.0], jnp.float32)

    def loss(v):
        return jnp.sum(cast_on_forward(v, E4M3).astype(jnp.float32) * cast_on_backward(w, E5M2))

    out = scalify.scalify(jax.grad(loss))(sx)
    ref = jax.grad(loss)(sx.to_array())
    np.testing.assert_array_equal(np.asarray(scalify.asarray(out)), ref)


@pytest.mark.usefixtures("arguments_as_given")
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("src", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("data_exp", [-40, -12, -5, 9, 20, 40])
def test_fp8_cast_of_wide_data_far_from_the_format_keeps_the_value(data_exp, dtype, src, jit):
    """float32 / bfloat16 data far below unit (most of it FP8 subnormal or zero) or beyond
    the format's max: inside scalify the cast first moves the data to unit max-abs, so the
    value survives (plain JAX: zeros or saturation; the cast outside scalify: the same)."""
    if data_exp > 0 and dtype == E5M2 and data_exp < 16:
        data_exp = 16  # within E5M2's range below 2^16
    vals = np.array([0.3, -1.7, 1.0, 0.05, -0.9], np.float32) * np.float32(2.0**data_exp)
    if src == jnp.bfloat16 and abs(data_exp) > 30:
        vals = vals.astype(ml_dtypes.bfloat16).astype(np.float32)
    scale = 2.0**-20
    sx = scalify.scaled_array(jnp.asarray(vals, src), jnp.float32(scale))
    fn = scalify.scalify(lambda v: cast(v, dtype))
    out = (jax.jit(fn) if jit else fn)(sx)
    got = _f32(out.data).astype(np.float64) * float(out.scale)
    want = vals.astype(np.float64) * scale
    eps = float(ml_dtypes.finfo(dtype).eps)
    np.testing.assert_allclose(got, want, rtol=eps)  # FP8 rounding only: no zero, no clip
    assert 1.0 <= np.abs(_f32(out.data)).max() < 2.0
    if abs(data_exp) == 40:  # no guard outside scalify: the data cast as is, zeros or max
        outside = _f32(cast(sx, dtype).data).astype(np.float64) * scale
        assert not np.allclose(outside, want, rtol=0.5, atol=0)


@pytest.mark.usefixtures("arguments_as_given")
@pytest.mark.parametrize("dtype", FP8)
def test_fp8_cast_guard_leaves_data_in_range_and_float16_alone(dtype):
    """Data already in the format's range (a quantiser's top binade, unit data) keeps its
    scale; float16 data is not measured (its own guards placed it)."""
    fmax = float(ml_dtypes.finfo(dtype).max)
    for data in ([0.3, -1.7, 1.0], [0.9 * fmax, -0.5 * fmax, 1.0], [0.07, -0.1, 0.01]):
        sx = scalify.scaled_array(jnp.asarray(data, jnp.float32), jnp.float32(2.0**-7))
        out = jax.jit(scalify.scalify(lambda v: cast(v, dtype)))(sx)
        assert float(out.scale) == 2.0**-7, data
    tiny16 = scalify.scaled_array(jnp.asarray([2.0**-12, -2.0**-13], jnp.float16), jnp.float32(1.0))
    jaxpr = jax.make_jaxpr(scalify.scalify(lambda v: cast(v, E5M2)))(tiny16)
    assert "reduce_max" not in str(jaxpr)
    assert float(scalify.scalify(lambda v: cast(v, E5M2))(tiny16).scale) == 1.0


@pytest.mark.usefixtures("arguments_as_given")
@pytest.mark.parametrize("dtype", FP8)
def test_fp8_cast_of_float32_widened_from_float16_is_not_measured(dtype):
    """float32 data whose values were widened from float16 (the float32 view of float16
    master weights) is float16 data: cast to FP8 without the guard's max-reduction, with
    the values of the float16 data's own cast (eagerly and under jit); float32 data with
    the same values but not widened keeps its guard."""
    vals = np.array([[0.3, -1.7, 1.0, 2.0**-6], [1.5, -0.25, 2.0**-9, 0.0]], np.float16)
    x16 = scalify.scaled_array(jnp.asarray(vals), jnp.float32(2.0**-30))
    x32 = scalify.scaled_array(jnp.asarray(vals, jnp.float32), jnp.float32(2.0**-30))

    def widened(v):
        return cast(v.astype(jnp.float32).T, dtype)  # a rearrangement keeps what is known

    assert "reduce_max" not in str(jax.make_jaxpr(scalify.scalify(widened))(x16))
    assert "reduce_max" in str(jax.make_jaxpr(scalify.scalify(lambda v: cast(v.T, dtype)))(x32))
    want = scalify.scalify(lambda v: cast(v.T, dtype))(x16)
    for fn in (scalify.scalify(widened), jax.jit(scalify.scalify(widened))):
        got = fn(x16)
        assert float(got.scale) == float(want.scale) == 2.0**-30
        np.testing.assert_array_equal(_f32(got.data), _f32(want.data))
