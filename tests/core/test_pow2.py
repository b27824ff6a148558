import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scalify
from scalify.core.pow2 import np_pow2_round

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]


def _positive_normals(dtype, n=200, seed=0):
    info = ml_dtypes.finfo(dtype) if dtype == ml_dtypes.bfloat16 else np.finfo(dtype)
    rng = np.random.default_rng(seed)
    lo, hi = np.log2(float(info.tiny)), np.log2(float(info.max)) - 1
    x = np.exp2(rng.uniform(lo, hi, size=n)).astype(dtype)
    return x[np.isfinite(x.astype(np.float64)) & (x.astype(np.float64) > 0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["down", "nearest", "up"])
def test_pow2_round_is_exact_power_of_two_in_every_float_dtype(dtype, mode):
    with jax.enable_x64(dtype == np.float64):  # float64 arrays need x64 mode
        _check_pow2_round(dtype, mode)


def _check_pow2_round(dtype, mode):
    x = _positive_normals(dtype)
    out = np.asarray(scalify.pow2_round(jnp.asarray(x), mode)).astype(np.float64)
    xf = x.astype(np.float64)
    assert np.asarray(scalify.pow2_round(jnp.asarray(x), mode)).dtype == x.dtype
    assert scalify.is_pow2(out).all()
    expected = np_pow2_round(xf, mode)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("mode,expected", [("down", [2, 0.5, 1, 1]), ("up", [4, 0.5, 2, 2]), ("nearest", [4, 0.5, 1, 2])])
def test_pow2_round_modes(mode, expected):
    x = jnp.array([3.0, 0.5, 1.4, 1.5], jnp.float32)  # 1.4 < sqrt(2) < 1.5
    np.testing.assert_array_equal(scalify.pow2_round(x, mode), np.array(expected, np.float32))


def test_pow2_round_special_values_and_sign():
    x = jnp.array([0.0, -0.0, jnp.inf, -jnp.inf, jnp.nan, -3.0], jnp.float32)
    out = np.asarray(scalify.pow2_round_down(x))
    np.testing.assert_array_equal(out[:4], [0.0, -0.0, np.inf, -np.inf])
    assert np.isnan(out[4])
    assert out[5] == -2.0


def test_default_mode_comes_from_config():
    x = jnp.float32(3.0)
    assert scalify.pow2_round(x) == 2.0
    with scalify.ScalifyConfig(rounding_mode="up"):
        assert scalify.pow2_round(x) == 4.0
    with scalify.ScalifyConfig(rounding_mode=scalify.Pow2RoundMode.NEAREST):
        assert scalify.pow2_round(x) == 4.0
    assert scalify.get_config().rounding_mode == scalify.Pow2RoundMode.DOWN


@settings(max_examples=100, deadline=None)
@given(st.floats(min_value=-2.0**100, max_value=2.0**100, allow_nan=False, width=32).filter(lambda v: abs(v) > 1e-30))
def test_split_pow2_is_exact(value):
    x = jnp.float32(value)
    mant, scale = scalify.split_pow2(x)
    assert scalify.is_pow2(np.asarray(scale)).all()
    assert 1.0 <= abs(float(mant)) < 2.0
    assert float(mant) * float(scale) == float(x)


def test_split_pow2_special_values_get_scale_one():
    mant, scale = scalify.split_pow2(jnp.array([0.0, jnp.inf, jnp.nan], jnp.float32))
    np.testing.assert_array_equal(scale, [1, 1, 1])
    assert mant[0] == 0 and mant[1] == np.inf and np.isnan(mant[2])


def test_pow2_round_under_jit_and_vmap():
    x = jnp.array([3.0, 5.0, 0.3], jnp.float32)
    chex.assert_trees_all_equal(jax.jit(scalify.pow2_round_down)(x), jax.vmap(scalify.pow2_round_down)(x))


def test_e8m0_round_trip_and_errors():
    scales = np.exp2(np.arange(-127, 128, dtype=np.float64)).astype(np.float32)
    e = scalify.scale_to_e8m0(scales)
    assert e.dtype == scalify.E8M0
    np.testing.assert_array_equal(scalify.scale_from_e8m0(e), scales)
    with pytest.raises(ValueError, match="power"):
        scalify.scale_to_e8m0(np.float32(3.0))
