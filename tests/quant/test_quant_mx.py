import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalify.quant import E8M0, e8m0_exponent, floor_log2, format_info, mx_dequantize, mx_quantize

DTYPES = [jnp.float8_e4m3fn, jnp.float8_e5m2]
dname = lambda d: jnp.dtype(d).name


def _normal(seed, shape, log_sigma=0.0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp(log_sigma * rng.standard_normal(shape))
    return x.astype(np.float32)


def _blocks(x, block_size, axis):
    xm = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    return xm.reshape(*xm.shape[:-1], xm.shape[-1] // block_size, block_size)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize(
    "shape, axis, block_size",
    [((8, 96), -1, 32), ((2, 64, 3), 1, 16)],
    ids=str,
)
def test_block_scale_is_spec_formula(dtype, shape, axis, block_size):
    info = format_info(dtype)
    x = _normal(1, shape, log_sigma=2.0)
    data, scales = mx_quantize(x, dtype, block_size, axis)
    assert data.dtype == jnp.dtype(dtype) and data.shape == x.shape
    assert scales.dtype == E8M0
    expected_shape = list(shape)
    expected_shape[axis] //= block_size
    assert scales.shape == tuple(expected_shape)
    amax = np.abs(_blocks(x, block_size, axis)).max(-1)
    want = np.floor(np.log2(amax)).astype(np.int32) - info.emax
    got = np.moveaxis(np.asarray(e8m0_exponent(scales)), axis, -1)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("shape, axis", [((16, 256), -1), ((4, 64, 2), 1)], ids=str)
def test_round_trip_error_bound(dtype, shape, axis):
    info = format_info(dtype)
    x = _normal(0, shape)
    data, scales = mx_quantize(x, dtype, 32, axis)
    y = mx_dequantize(data, scales, 32, axis)
    assert y.shape == x.shape and y.dtype == jnp.float32
    y = np.asarray(y)
    s = np.exp2(np.moveaxis(np.asarray(e8m0_exponent(scales)), axis, -1).astype(np.float64))
    xb, yb = _blocks(x, 32, axis), _blocks(y, 32, axis)
    err = np.abs(yb - xb)
    # Per element: relative 2^-(m+1) in the normal range plus half a subnormal step;
    # the block max may saturate at fmax, losing at most (2^(emax+1) - fmax) * s.
    sat = (2.0 ** (info.emax + 1) - info.max) * s[..., None]
    bound = info.unit_roundoff * np.abs(xb) + info.min_subnormal / 2 * s[..., None]
    assert np.all(err <= np.maximum(bound, sat) * (1 + 1e-6))
    assert np.linalg.norm(err) / np.linalg.norm(xb) < 2 * info.unit_roundoff


def test_saturation_never_nan():
    # Block amax 500 -> scale 2^(8-8)=1, 500 > 448 must clamp, not become NaN.
    x = np.concatenate([[500.0, -500.0, 1.0], np.zeros(29)]).astype(np.float32)
    data, scales = mx_quantize(x)
    d = np.asarray(data).astype(np.float32)
    assert not np.isnan(d).any()
    assert d[0] == 448.0 and d[1] == -448.0
    assert int(e8m0_exponent(scales)[0]) == 0


def test_zero_and_nonfinite_blocks():
    x = np.zeros((3, 32), np.float32)
    x[1, 4], x[2, 0] = np.inf, np.nan
    data, scales = mx_quantize(x)
    e = np.asarray(e8m0_exponent(scales))[:, 0]
    assert e[0] == -127 and e[1] == 128 and e[2] == 128  # 128 = NaN code 0xFF
    y = np.asarray(mx_dequantize(data, scales))
    np.testing.assert_array_equal(y[0], 0.0)
    assert np.isnan(y[1]).all() and np.isnan(y[2]).all()


def test_exponent_clamped_to_e8m0_range():
    x = np.full((32,), 3e38, np.float32)
    data, scales = mx_quantize(x, jnp.float8_e4m3fn)
    assert int(e8m0_exponent(scales)[0]) == 127 - 8
    np.testing.assert_allclose(np.asarray(mx_dequantize(data, scales)), 3e38, rtol=2**-4)


def test_jit_and_bf16_input():
    x = _normal(3, (8, 64)).astype(jnp.bfloat16)
    data, scales = jax.jit(mx_quantize, static_argnums=(1, 2, 3))(x, jnp.float8_e4m3fn, 32, -1)
    y = jax.jit(mx_dequantize, static_argnums=(2, 3, 4))(data, scales, 32, -1, jnp.bfloat16)
    assert y.dtype == jnp.bfloat16
    # floor rounding: up to 12.5% saturation error on block maxima in [448, 512) * 2^e.
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(x, np.float32), rtol=0.125, atol=0.02)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_ceil_scale_rounding_never_saturates(dtype):
    info = format_info(dtype)
    x = _normal(4, (64, 64)) * 3
    data, scales = mx_quantize(x, dtype, scale_rounding="ceil")
    assert np.all(np.abs(np.asarray(data).astype(np.float32)) <= info.max)
    amax = np.abs(_blocks(x, 32, -1)).max(-1)
    e = np.asarray(e8m0_exponent(scales))
    assert np.all(amax <= info.max * np.exp2(e.astype(np.float64)))  # fits
    assert np.all(amax > info.max * np.exp2(e - 1.0))  # smallest such exponent
    y = mx_dequantize(data, scales)
    rel = np.abs(np.asarray(y) - x) / np.abs(x)
    normal = np.abs(x) >= info.min_normal * np.repeat(np.exp2(e.astype(np.float64)), 32, -1)
    assert rel[normal].max() <= info.unit_roundoff
    with pytest.raises(ValueError, match="scale_rounding"):
        mx_quantize(x, dtype, scale_rounding="nearest")


def test_errors():
    with pytest.raises(ValueError, match="not a multiple of block_size=32"):
        mx_quantize(np.ones((4, 40), np.float32))
    with pytest.raises(ValueError, match="scalar"):
        mx_quantize(jnp.float32(1))
    data, scales = mx_quantize(np.ones((4, 64), np.float32))
    with pytest.raises(ValueError, match="does not match"):
        mx_dequantize(data, scales[:, :1])


def test_floor_log2_exact():
    x = np.array([1.0, 1.999999, 2.0, 0.75, 448.0, 2.0**-126, 3e38], np.float32)
    np.testing.assert_array_equal(np.asarray(floor_log2(x)), [0, 0, 1, -1, 8, -126, 127])
