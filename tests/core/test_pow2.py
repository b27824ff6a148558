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


# -- pow2_fit: the one amax -> power-of-two scale ---------------------------------------------
FIT_TARGETS = [448.0, 57344.0, 65504.0, 448.0 / 6, 65504.0 / 10, 2.0**16, 1.0, 3.0, 1e-30, 2.0**127]


def _fit_amaxes():
    rng = np.random.default_rng(0)
    normal = np.float32(2.0) ** rng.uniform(-126, 127, 2000) * rng.uniform(1, 2, 2000)
    subnormal = np.float32(2.0**-149) * rng.integers(1, 2**23, 200)
    exact = np.float32([2.0**k for k in range(-149, 128, 7)])
    # at each binade edge of a target: the same fraction as the target, one ulp either side
    fractions = np.float32([448.0, 57344.0, 65504.0, 3.0, 448.0 / 6, 65504.0 / 10])
    edges = [np.nextafter(f * np.float32(2.0) ** k, d, dtype=np.float32)
             for f in fractions for k in (-140, -60, 0, 60) for d in (0, np.inf)]
    edges += list(fractions)
    limits = [np.float32(2.0**-126), np.nextafter(np.float32(2.0**-126), 0, dtype=np.float32),
              np.finfo(np.float32).max]
    return np.concatenate([normal, subnormal, exact, edges, limits]).astype(np.float32)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("target", FIT_TARGETS)
def test_pow2_fit_is_the_smallest_power_of_two_that_fits(target, jit):
    """amax / s <= target with the smallest power of two s, against float64 arithmetic,
    across float32's range (subnormal maxima too), for format maxima and targets that
    float32 cannot hold (448/6); s clipped to [2^-126, 2^127]."""
    from scalify.core.pow2 import pow2_fit

    amax = _fit_amaxes()
    fit = jax.jit(pow2_fit, static_argnums=1) if jit else pow2_fit
    s = np.asarray(fit(jnp.asarray(amax), target), np.float64)
    a = amax.astype(np.float64)
    assert np.all(np.log2(s) == np.round(np.log2(s)))
    assert np.all((s >= 2.0**-126) & (s <= 2.0**127))
    fits = a / s <= target
    assert np.all(fits | (s == 2.0**127))
    smallest = a / (s / 2) > target
    assert np.all(smallest | (s == 2.0**-126))


def test_pow2_fit_of_zero_negative_and_nonfinite_maxima_is_one_and_bad_targets_are_refused():
    from scalify.core.pow2 import pow2_fit

    out = pow2_fit(jnp.array([0.0, -0.0, -3.0, np.inf, -np.inf, np.nan], jnp.float32), 448.0)
    np.testing.assert_array_equal(out, np.ones(6, np.float32))
    for bad in (0.0, -1.0, np.inf, np.nan):
        with pytest.raises(ValueError, match="target must be a positive finite number"):
            pow2_fit(jnp.float32(1.0), bad)
