"""Storage codecs of optimizer-state leaves: scale choice, round trips, special values,
stochastic rounding, pytree behaviour."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalify.optim as so
from scalify import ScaledArray
from scalify.quant import format_info

DTYPES = [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2]


AMAXES = np.array([2.0**-100, 1e-30, 3e-8, 1.0, 7.5e4, 1e30, 2.0**120], np.float32)


@functools.lru_cache(maxsize=None)
def _round_trip(codec):
    return jax.jit(lambda x: (codec.encode(x), codec.decode(codec.encode(x))))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_for_puts_amax_in_top_binade(dtype):
    fmax = format_info(dtype).max
    # Elementwise on an array of maxima; eager, so the few ops compile once for all dtypes.
    s = np.asarray(so.scale_for(jnp.asarray(AMAXES), dtype, 0), np.float64)
    s3 = np.asarray(so.scale_for(jnp.asarray(AMAXES), dtype, 3), np.float64)
    amax = AMAXES.astype(np.float64)
    np.testing.assert_array_equal(np.log2(s), np.round(np.log2(s)))
    assert np.all(amax / s <= fmax)
    inside = (s > 2.0**-126) & (s < 2.0**124)  # else clipped to the float32 scale range
    assert inside.sum() >= 3
    assert np.all(amax[inside] / s[inside] > fmax / 2)
    np.testing.assert_array_equal(s3[inside], 8 * s[inside])


def _scale_for_reference(amax, dtype, margin):
    """`scale_for`'s formula in float64 NumPy: 2^clip(e - emax + [amax > mant 2^e] + margin,
    -126, 127), e = floor(log2 amax), float32 subnormals included; 1 for 0, negative, inf
    and nan."""
    info = format_info(dtype)
    mant = info.max / 2.0**info.emax
    with np.errstate(invalid="ignore"):  # signalling NaN bit patterns
        a = amax.astype(np.float64)
    ok = np.isfinite(a) & (a > 0)
    a = np.where(ok, a, 1.0)
    _, e = np.frexp(a)  # a = f * 2^e, f in [0.5, 1): exact
    e = e - 1.0
    above = a > mant * 2.0**e
    k = np.clip(e - info.emax + above + margin, -126, 127)
    return np.where(ok, 2.0**k, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_for_matches_its_formula_at_every_binade_edge(dtype):
    """The bit computation against the float64 formula: the format's maximum times every
    power of two of float32 (and one ulp either side), subnormal maxima, the extremes."""
    info = format_info(dtype)
    tops = np.float32(info.max) * np.exp2(np.arange(-150, 128 - info.emax), dtype=np.float64)
    tops = tops[(tops > 0) & (tops < np.finfo(np.float32).max)].astype(np.float32)
    amax = np.concatenate([tops, np.nextafter(tops, np.float32(0)), np.nextafter(tops, np.float32(np.inf)),
                           np.float32([2.0**-149, 3 * 2.0**-149, 2.0**-127, 1.5 * 2.0**-127, 1.9 * 2.0**-127,
                                       2.0**-126, np.finfo(np.float32).max, 1.0, 0.0])])
    for margin in (0, 3, info.emax):
        got = np.asarray(so.scale_for(jnp.asarray(amax), dtype, margin), np.float64)
        np.testing.assert_array_equal(got, _scale_for_reference(amax, dtype, margin), err_msg=f"margin {margin}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_for_matches_its_formula_on_any_float32_bits(dtype):
    """Random bit patterns (every sign, exponent and fraction: subnormals, inf, nan and
    negative values included) and random subnormals, eager and jitted."""
    rng = np.random.default_rng(0)
    amax = np.concatenate([rng.integers(0, 2**32, 50_000, dtype=np.int64).astype(np.uint32),
                           rng.integers(1, 2**23, 5_000, dtype=np.int64).astype(np.uint32)]).view(np.float32)
    for margin in (0, 2, info_emax := format_info(dtype).emax, info_emax + 20):
        want = _scale_for_reference(amax, dtype, margin)
        for fn in (so.scale_for, jax.jit(so.scale_for, static_argnums=(1, 2))):
            got = np.asarray(fn(jnp.asarray(amax), dtype, margin), np.float64)
            np.testing.assert_array_equal(got, want, err_msg=f"margin {margin}")


def test_scale_for_special_amax_gives_one():
    out = so.scale_for(jnp.array([0.0, np.inf, np.nan]), jnp.float16)
    np.testing.assert_array_equal(np.asarray(out), 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_codec_round_trip_at_extreme_scales(dtype):
    """Values around 2^-40 ... 2^40: plain `dtype` under/overflows, the scaled leaf keeps
    the format's relative precision on the values within its normal range."""
    info = format_info(dtype)
    base = jax.random.normal(jax.random.key(0), (257,))
    for log2_scale in [-40, -5, 0, 7, 40]:
        x = base * jnp.float32(2.0**log2_scale)
        leaf, y = _round_trip(so.ScaledCodec(dtype))(x)
        assert isinstance(leaf, ScaledArray) and leaf.data.dtype == jnp.dtype(dtype)
        normal = np.abs(np.asarray(x)) >= float(leaf.scale) * info.min_normal
        rel = np.abs(np.asarray(y) - np.asarray(x))[normal] / np.abs(np.asarray(x))[normal]
        assert normal.mean() > 0.9
        assert rel.max() <= info.unit_roundoff * (1 + 1e-6)
        if dtype == jnp.float16 and abs(log2_scale) == 40:
            plain = np.asarray(x.astype(dtype).astype(jnp.float32))
            assert not np.all(np.isfinite(plain)) or np.all(plain == 0)


def test_scaled_codec_float32_is_exact():
    x = jax.random.normal(jax.random.key(1), (64,)) * 1e-20
    _, y = _round_trip(so.ScaledCodec(jnp.float32))(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float8_e4m3fn])
def test_scaled_codec_special_values(dtype):
    x = jnp.array([0.0, -0.0, 1.5e-3, -2e-3, jnp.nan, jnp.inf, -jnp.inf], jnp.float32)
    y = np.asarray(_round_trip(so.ScaledCodec(dtype))(x)[1])
    assert y[0] == 0 and y[1] == 0
    np.testing.assert_allclose(y[2:4], np.asarray(x[2:4]), rtol=format_info(dtype).unit_roundoff)
    assert np.isnan(y[4])
    # Non-finite values never become finite (E4M3 has no infinity: they become NaN).
    assert not np.any(np.isfinite(y[5:]))
    zeros, _ = _round_trip(so.ScaledCodec(dtype))(jnp.zeros(7))
    assert float(zeros.scale) == 1.0 and np.all(np.asarray(zeros.to_array()) == 0)


def test_round_to_dtype_stochastic_is_unbiased_and_keeps_small_updates():
    t = jnp.full((20000,), 1.0 + 2.0**-13, jnp.float32)  # a quarter of a float16 ulp above 1
    rnd = jax.jit(so.round_to_dtype, static_argnums=(1, 2))
    rtn = rnd(t, jnp.float16, "nearest")
    assert np.all(np.asarray(rtn) == 1.0)
    sr = np.asarray(rnd(t, jnp.float16, "stochastic", jax.random.key(0)), np.float64)
    assert set(np.unique(sr)) == {1.0, 1.0 + 2.0**-10}
    assert abs(sr.mean() - (1.0 + 2.0**-13)) < 4 * 2.0**-10 / np.sqrt(20000)
    # Exact values, signs, subnormals, zero and specials are kept.
    exact = jnp.array([0.0, -1.5, 2.0**-24, -(2.0**-20), 65504.0, jnp.inf, jnp.nan])
    out = np.asarray(rnd(exact, jnp.float16, "stochastic", jax.random.key(1)), np.float32)
    np.testing.assert_array_equal(out[:6], np.asarray(exact[:6]))
    assert np.isnan(out[6])


def test_round_to_dtype_errors():
    with pytest.raises(ValueError, match="needs a PRNG key"):
        so.round_to_dtype(jnp.ones(3), jnp.float16, "stochastic")
    with pytest.raises(ValueError, match="'nearest' or 'stochastic'"):
        so.round_to_dtype(jnp.ones(3), jnp.float16, "up")


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape", [(3, 1000), (7,)])
def test_blockwise_codec_round_trip(signed, shape):
    x = jax.random.normal(jax.random.key(2), shape) * 1e-3
    x = x if signed else x * x
    leaf, y = _round_trip(so.BlockwiseCodec(signed, block_size=2048))(x)
    assert isinstance(leaf, so.BlockwiseArray)
    assert leaf.codes.dtype == jnp.uint8 and leaf.codes.shape == shape
    assert leaf.absmax.shape == (-(-int(np.prod(shape)) // 2048),)
    y = np.asarray(y)
    err = np.linalg.norm(y - np.asarray(x)) / np.linalg.norm(np.asarray(x))
    assert err < 0.05
    assert so.tree_nbytes(leaf) == int(np.prod(shape)) + 4 * leaf.absmax.size


@pytest.mark.parametrize("expand", [True, False])
def test_coat_codec_round_trip(expand):
    x = jax.random.normal(jax.random.key(3), (3, 300)) * 1e-4
    leaf, y = _round_trip(so.CoatCodec(expand=expand))(x)
    assert isinstance(leaf, so.CoatArray) and leaf.data.dtype == jnp.float8_e4m3fn
    ngroups = -(-900 // 128)
    assert leaf.scale.shape == (ngroups,)
    assert (leaf.k is None) == (not expand)
    y = np.asarray(y)
    assert np.linalg.norm(y - np.asarray(x)) / np.linalg.norm(np.asarray(x)) < 0.05
    assert so.tree_nbytes(leaf) == 900 + 4 * ngroups * (2 if expand else 1)


def test_stored_leaves_are_pytrees_under_jit():
    x = jax.random.normal(jax.random.key(4), (4096,))
    leaves = jax.jit(lambda x: [so.ScaledCodec().encode(x), so.BlockwiseCodec().encode(x), so.CoatCodec().encode(x)])(x)
    out = jax.jit(lambda ls: [l.to_array() for l in ls])(leaves)
    for leaf, o in zip(leaves, out):
        assert np.linalg.norm(np.asarray(o) - np.asarray(x)) < 0.05 * np.linalg.norm(np.asarray(x))
        children, treedef = jax.tree_util.tree_flatten(leaf)
        assert type(jax.tree_util.tree_unflatten(treedef, children)) is type(leaf)
        assert so.is_stored_leaf(leaf)


def test_finite_amaxes_one_reduction_per_shape_and_each_arrays_own_maximum():
    """`finite_amaxes`: max |x| over the finite elements of each array (0 if none), with
    arrays of one shape reduced as one stack (one reduction per shape), mixed dtypes
    included; equal to the per-array reference, eagerly and under jit."""
    from scalify.optim.codecs import finite_amaxes

    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((8, 16)).astype(np.float32) * 2.0**e for e in (-60, 0, 40)]
    xs[1][2, 3] = np.inf
    xs[2][0, 0] = np.nan
    xs.append(np.full((8, 16), np.inf, np.float32))  # no finite element: 0
    xs.append((rng.standard_normal((8, 16)) * 1e4).astype(np.float16))  # same shape, float16
    xs.append(rng.standard_normal((5,)).astype(np.float32))  # a shape of its own
    xs.append(np.float32(-3.5))  # 0-d
    want = [float(np.max(np.abs(np.where(np.isfinite(x), x, 0)).astype(np.float64), initial=0.0)) for x in xs]
    for fn in (finite_amaxes, jax.jit(finite_amaxes)):
        got = [float(m) for m in fn(xs)]
        assert got == want
    jaxpr = jax.make_jaxpr(finite_amaxes)(xs)
    tensor_maxes = [e for e in jaxpr.jaxpr.eqns if e.primitive is jax.lax.reduce_max_p and e.invars[0].aval.size > 1]
    assert len(tensor_maxes) == 2  # the (8, 16) stack of five arrays and the (5,) array



def test_finite_amaxes_variadic_equals_finite_amaxes_with_one_reduce_per_shape():
    """`finite_amaxes_variadic`: the same maxima as `finite_amaxes` (finite elements only,
    0 if none, mixed dtypes, 0-d arrays, 2^-60 to 2^40), from one variadic `reduce` per
    shape and dtype whose operands are the arrays themselves (no stacked copy, no float32
    copy of a float16 array), eagerly and under jit."""
    from scalify.optim.codecs import finite_amaxes, finite_amaxes_variadic

    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((8, 16)).astype(np.float32) * 2.0**e for e in (-60, 0, 40)]
    xs[1][2, 3] = -np.inf
    xs[2][0, 0] = np.nan
    xs.append(np.full((8, 16), np.nan, np.float32))
    xs.append((rng.standard_normal((8, 16)) * 1e4).astype(np.float16))
    xs.append(rng.standard_normal((5,)).astype(np.float32))
    xs.append(np.float32(-3.5))
    want = [float(m) for m in finite_amaxes(xs)]
    assert want[3] == 0.0 and want[0] > 0.0
    for fn in (finite_amaxes_variadic, jax.jit(finite_amaxes_variadic)):
        assert [float(m) for m in fn(xs)] == want
    eqns = jax.make_jaxpr(finite_amaxes_variadic)(xs).jaxpr.eqns
    reduces = [e for e in eqns if e.primitive is jax.lax.reduce_p]
    assert sorted(len(e.invars) // 2 for e in reduces) == [1, 1, 1, 4]  # operands + inits
    assert not [e for e in eqns if e.primitive is jax.lax.concatenate_p]
    assert [v.aval.dtype for e in reduces for v in e.invars if v.aval.shape == (8, 16)].count(np.float16) == 1