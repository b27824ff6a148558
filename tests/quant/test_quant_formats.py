import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from scalify.quant import SUPPORTED_FORMATS, format_info, is_fp8, saturating_cast

FORMATS = [jnp.dtype(n) for n in SUPPORTED_FORMATS]
NARROW = [d for d in FORMATS if d != jnp.float32]


@pytest.mark.parametrize(
    "name, fmax, min_normal, min_sub, m, has_inf, emax",
    [
        ("float8_e4m3fn", 448.0, 2.0**-6, 2.0**-9, 3, False, 8),
        ("float8_e5m2", 57344.0, 2.0**-14, 2.0**-16, 2, True, 15),
        ("float8_e4m3fnuz", 240.0, 2.0**-7, 2.0**-10, 3, False, 7),
        ("float8_e5m2fnuz", 57344.0, 2.0**-15, 2.0**-17, 2, False, 15),
        ("float16", 65504.0, 2.0**-14, 2.0**-24, 10, True, 15),
        ("bfloat16", float(ml_dtypes.finfo(jnp.bfloat16).max), 2.0**-126, 2.0**-133, 7, True, 127),
        ("float32", float(np.finfo(np.float32).max), 2.0**-126, 2.0**-149, 23, True, 127),
    ],
)
def test_format_info_values(name, fmax, min_normal, min_sub, m, has_inf, emax):
    info = format_info(name)
    assert info.name == name and info.dtype == jnp.dtype(name)
    assert info.max == fmax
    assert info.min_normal == min_normal
    assert info.min_subnormal == min_sub
    assert info.mantissa_bits == m
    assert info.has_inf == has_inf
    assert info.emax == emax
    assert info.unit_roundoff == 2.0 ** -(m + 1)
    assert format_info(jnp.dtype(name)) is info


def test_format_info_rejects_non_float():
    with pytest.raises(TypeError, match="floating dtype"):
        format_info(jnp.int8)
    with pytest.raises(TypeError, match="not a dtype"):
        format_info("not_a_dtype")


def test_is_fp8():
    for d in ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]:
        assert is_fp8(d) and is_fp8(jnp.dtype(d))
    for d in [jnp.float16, jnp.bfloat16, jnp.float32, jnp.int8, jnp.uint8, "float8_e8m0fnu"]:
        assert not is_fp8(d)
    assert not is_fp8("nonsense")


@pytest.mark.parametrize("dtype", NARROW, ids=str)
@pytest.mark.parametrize("src", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_saturating_cast_never_nan_and_clamps(dtype, src):
    info = format_info(dtype)
    src_max = float(jnp.finfo(src).max)
    vals = [0.0, 1.0, -1.0, info.max, -info.max, info.max * 1.01, -info.max * 1.01,
            info.max * 4, -info.max * 4, src_max, -src_max, np.inf, -np.inf]
    with np.errstate(over="ignore"):
        x = np.array(vals, np.float64).astype(np.float32).astype(jnp.dtype(src))
    y = saturating_cast(x, dtype)
    assert y.dtype == jnp.dtype(dtype)
    yf = np.asarray(y).astype(np.float32)
    xf = np.asarray(x).astype(np.float32)
    assert not np.isnan(yf).any()
    finite_in = np.isfinite(xf)
    assert np.all(np.abs(yf[finite_in]) <= info.max)
    big = finite_in & (np.abs(xf) >= info.max)
    np.testing.assert_array_equal(yf[big], np.sign(xf[big]) * info.max)
    infs = np.isinf(xf)
    expected_inf = np.sign(xf[infs]) * (np.inf if info.has_inf else info.max)
    np.testing.assert_array_equal(yf[infs], expected_inf)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", NARROW, ids=str)
@pytest.mark.parametrize("src", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_saturating_cast_with_inf_saturating(dtype, src, jit):
    """inf_saturates=True: +-inf at +-max as well, everything else (in-range rounding, finite
    overflow, NaN) as the default cast, for every format, from float32 and bfloat16."""
    info = format_info(dtype)
    rng = np.random.default_rng(1)
    in_range = rng.standard_normal(4000) * np.exp2(rng.uniform(np.log2(info.min_normal), np.log2(info.max), 4000))
    src_max = float(jnp.finfo(src).max)
    edges = [0.0, -0.0, info.max, -info.max, info.max * 1.01, -info.max * 4, src_max, -src_max]
    with np.errstate(over="ignore"):
        x = np.concatenate([np.clip(in_range, -info.max, info.max), edges]).astype(np.float32).astype(jnp.dtype(src))
    cast = functools.partial(saturating_cast, dtype=dtype)
    both = jax.jit(lambda v: (cast(v), cast(v, inf_saturates=True))) if jit else (
        lambda v: (cast(v), cast(v, inf_saturates=True)))
    plain, y = both(jnp.asarray(x))
    finite = np.isfinite(np.asarray(x, np.float32))  # an edge beyond src's range is inf already
    np.testing.assert_array_equal(np.asarray(y).astype(np.float32)[finite],
                                  np.asarray(plain).astype(np.float32)[finite])
    special = jnp.asarray(np.array([np.inf, -np.inf, np.nan, 1.0], np.float32).astype(jnp.dtype(src)))
    y = np.asarray(both(special)[1]).astype(np.float32)
    np.testing.assert_array_equal(y[[0, 1, 3]], [info.max, -info.max, 1.0])
    assert np.isnan(y[2])


@pytest.mark.parametrize("dtype", FORMATS, ids=str)
def test_saturating_cast_nan_stays_nan(dtype):
    y = np.asarray(saturating_cast(np.array([np.nan, 1.0], np.float32), dtype)).astype(np.float32)
    assert np.isnan(np.asarray(y)[0]) and np.asarray(y)[1] == 1.0


@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_saturating_cast_matches_rne_in_range(dtype):
    """In range it is exactly ml_dtypes' round-to-nearest-even cast."""
    info = format_info(dtype)
    rng = np.random.default_rng(0)
    # Stay in float32's normal range: XLA flushes float32 subnormals on CPU.
    lo = max(np.log2(info.min_subnormal) - 2, -100)
    hi = min(np.log2(info.max), 100)
    x = rng.standard_normal(20000).astype(np.float32) * np.exp2(
        rng.uniform(lo, hi, 20000)
    ).astype(np.float32)
    x = np.clip(x, -info.max, info.max)
    ref = x.astype(info.dtype).astype(np.float32)
    # XLA's default CPU code generator where tests/conftest.py picked the classic fusion
    # emitters for compile speed (they turn a negative value that rounds to zero into the
    # fnuz formats' NaN, 0x80, where XLA's default emitters, like ml_dtypes, give +0); only
    # then, as a jaxlib without that option would refuse it
    classic = "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "")
    options = {"xla_cpu_use_fusion_emitters": True} if classic and jax.default_backend() == "cpu" else {}
    got = np.asarray(jax.jit(saturating_cast, static_argnums=1, compiler_options=options)(x, dtype))
    np.testing.assert_array_equal(got.astype(np.float32), ref)


def test_rne_ties_to_even_e4m3():
    # E4M3 spacing in [1, 2) is 1/8: 1 + 1/16 ties to 1, 1 + 3/16 ties to 1.25.
    x = jnp.array([1 + 1 / 16, 1 + 3 / 16], jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(saturating_cast(x, jnp.float8_e4m3fn)).astype(np.float32), [1.0, 1.25]
    )


@pytest.mark.parametrize("dtype", NARROW, ids=str)
@pytest.mark.parametrize("shape", [(1000,), (4, 8, 32)], ids=str)
def test_round_trip_relative_error_bound(dtype, shape):
    info = format_info(dtype)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    y = np.asarray(saturating_cast(x, dtype)).astype(np.float32)
    err = np.abs(y - x)
    # Relative bound u = 2^-(m+1) in the normal range, absolute min_subnormal/2 below it.
    bound = info.unit_roundoff * np.abs(np.asarray(x)) + info.min_subnormal / 2
    assert np.all(err <= bound)
    normal = np.abs(np.asarray(x)) >= info.min_normal
    rel = err[normal] / np.abs(np.asarray(x))[normal]
    assert rel.max() <= info.unit_roundoff


def test_saturating_cast_under_jit():
    f = jax.jit(lambda v: saturating_cast(v * 1000.0, jnp.float8_e4m3fn))
    y = f(jnp.linspace(-2, 2, 9))
    assert not np.isnan(np.asarray(y).astype(np.float32)).any()
def test_widen_keeps_fp8_rounding_behind_a_barrier():
    """XLA's GPU compiler folds convert(convert(v, f8), f32) into v: `widen` puts an optimization_barrier between the two converts,
    and wider-than-FP8 inputs are converted directly."""
    import jax
    import jax.numpy as jnp

    from scalify.quant import widen

    x = jnp.linspace(0.1, 3.0, 7, dtype=jnp.float32)
    eqns = jax.make_jaxpr(lambda v: widen(v.astype(jnp.float8_e4m3fn), jnp.float32))(x).eqns
    assert [e.primitive.name for e in eqns] == ["convert_element_type", "optimization_barrier",
                                                "convert_element_type"]
    eqns = jax.make_jaxpr(lambda v: widen(v.astype(jnp.bfloat16), jnp.float32))(x).eqns
    assert [e.primitive.name for e in eqns] == ["convert_element_type", "convert_element_type"]
    out = jax.jit(lambda v: widen(v.astype(jnp.float8_e4m3fn), jnp.float32))(x)
    np.testing.assert_array_equal(out, np.asarray(x).astype(jnp.float8_e4m3fn).astype(np.float32))
