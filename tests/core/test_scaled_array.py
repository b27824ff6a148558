import warnings

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import scalify
from scalify import ScaledArray, ScaledTypeError, ScaleError


def test_scaled_array_basics():
    x = scalify.scaled_array([1.0, 2.0, 3.0], 0.25)
    assert x.shape == (3,) and x.ndim == 1 and x.size == 3 and x.dtype == jnp.float32
    assert x.scale.dtype == jnp.float32
    np.testing.assert_array_equal(x.to_array(), [0.25, 0.5, 0.75])
    np.testing.assert_array_equal(np.asarray(x), [0.25, 0.5, 0.75])
    assert x.to_array(jnp.float16).dtype == jnp.float16
    assert "ScaledArray" in repr(x)


def test_to_array_does_not_overflow_low_precision_data_in_intermediate():
    x = scalify.scaled_array(np.full((2,), 60000.0, np.float16), 2.0**-10)
    np.testing.assert_allclose(x.to_array(), 60000.0 * 2**-10, rtol=1e-3)
    assert x.to_array(jnp.float32).dtype == jnp.float32


def test_pytree_jit_vmap_tree_util():
    x = scalify.scaled_array(np.ones((4, 3), np.float16), 2.0**5)
    leaves, treedef = jax.tree_util.tree_flatten(x)
    assert len(leaves) == 2
    y = jax.jit(lambda a: a)(x)
    assert isinstance(y, ScaledArray)
    chex.assert_trees_all_equal(y.data, x.data)
    per_row = ScaledArray(jnp.ones((4, 3)), jnp.full((4, 1), 0.5))
    z = jax.vmap(lambda a: a.to_array())(per_row)
    np.testing.assert_array_equal(z, np.full((4, 3), 0.5))


@pytest.mark.parametrize("scale", [3.0, 0.3, -2.0, 0.0, np.inf])
def test_non_power_of_two_scale_is_an_error(scale):
    with pytest.raises(ScaleError, match="power of two"):
        scalify.scaled_array([1.0, 2.0], scale)


def test_scale_shape_must_broadcast():
    with pytest.raises(ScaleError, match="does not broadcast"):
        scalify.scaled_array(np.ones((2, 3)), np.ones((2,)))
    # per-row scales broadcast fine
    scalify.scaled_array(np.ones((2, 3)), np.ones((2, 1)))


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.uint8])
def test_integer_data_cannot_be_scaled(dtype):
    with pytest.raises(ScaleError, match="floating"):
        scalify.scaled_array(np.ones((2,), dtype), 1.0)
    with pytest.raises(ScaleError, match="floating"):
        ScaledArray(jnp.ones((2,), dtype), jnp.float32(1))


def test_as_scaled_array_splits_scalars_exactly_and_keeps_non_floats():
    tree = {"a": 3.0, "b": jnp.ones(2, jnp.bfloat16), "c": 7, "d": jnp.arange(3), "e": np.float32(0.375)}
    out = scalify.as_scaled_array(tree)
    assert isinstance(out["a"], ScaledArray) and float(out["a"].scale) == 2.0 and float(out["a"].data) == 1.5
    assert out["b"].dtype == jnp.bfloat16 and float(out["b"].scale) == 1.0
    assert out["c"] == 7 and out["d"].dtype == jnp.int32
    assert float(out["e"].to_array()) == 0.375
    back = scalify.asarray(out)
    chex.assert_trees_all_close(back["b"], tree["b"])
    assert float(back["a"]) == 3.0


def test_as_scaled_array_with_given_scale():
    x = jnp.array([1.0, 2.0], jnp.float16)
    out = scalify.as_scaled_array(x, scale=2.0**-4)
    np.testing.assert_array_equal(out.data, [16.0, 32.0])
    np.testing.assert_array_equal(out.to_array(), x)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float16, jnp.bfloat16])
def test_as_scaled_array_of_narrow_arrays(dtype):
    # FP8 arrays have no implicit promotion in JAX: the RMS and the split are computed in
    # float32, and the values are kept exactly.
    x = jnp.array([[0.5, -3.0], [0.0, 2.0**-6]], dtype)
    for out in (scalify.as_scaled_array(x), scalify.as_scaled_array(x, scale=2.0**-2),
                jax.jit(scalify.as_scaled_array)(x)):
        assert out.dtype == dtype
        np.testing.assert_array_equal(out.to_array(jnp.float32), x.astype(jnp.float32))
    assert float(scalify.as_scaled_array(x).scale) == 1.0  # RMS 1.52: data in [1, 2)
    scalar = scalify.as_scaled_array(jnp.asarray(0.75, dtype))
    assert float(scalar.to_array(jnp.float32)) == 0.75


@pytest.mark.parametrize("dtype, big", [(jnp.float8_e4m3fn, 448.0), (jnp.float16, 6e4)])
def test_as_scaled_array_refuses_a_scale_that_overflows_the_data(dtype, big):
    # x / scale beyond the dtype's max would be NaN (E4M3 has no infinity) or inf, silently.
    x = jnp.array([0.5, big], dtype)
    with pytest.raises(ValueError, match="overflows .*larger"):
        scalify.as_scaled_array(x, scale=2.0**-3)
    np.testing.assert_array_equal(scalify.as_scaled_array(x, scale=2.0).to_array(jnp.float32), x.astype(jnp.float32))


def test_scaled_array_refuses_silent_materialisation_in_jnp():
    x = scalify.scaled_array([1.0, 2.0], 1.0)
    with pytest.raises(TypeError, match="scalify"):
        jnp.sin(x)


def test_fp8_data_and_e8m0_like_scale_storage():
    x = scalify.scaled_array(np.array([1.0, -2.0, 0.5]), 2.0**-8, dtype=ml_dtypes.float8_e4m3fn)
    assert x.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(x.to_array(jnp.float32), np.array([1.0, -2.0, 0.5]) * 2**-8)


# ----------------------------------------------------------------------------- Python values


def test_scalar_conversions_use_the_value():
    x = scalify.scaled_array(3.0, 0.5)
    assert float(x) == 1.5 and isinstance(float(x), float)
    assert int(x) == 1 and isinstance(int(x), int)
    assert x.item() == 1.5 and isinstance(x.item(), float)
    assert bool(x) and not bool(scalify.scaled_array(0.0, 4.0))
    assert complex(x) == 1.5
    # Size-1 arrays of any rank convert, like NumPy's item().
    assert float(scalify.scaled_array([[5.0]], 2.0**-2)) == 1.25
    # The exact value, even where data's own dtype cannot hold it (FP8 data, tiny scale).
    f8 = scalify.scaled_array(np.array([1.5]), 2.0**-20, dtype=ml_dtypes.float8_e4m3fn)
    assert f8.item() == 1.5 * 2.0**-20 and float(f8) == 1.5 * 2.0**-20


def test_scalar_conversions_of_larger_arrays_are_errors():
    x = scalify.scaled_array([1.0, 2.0, 3.0], 0.25)
    with pytest.raises(ValueError, match=r"size 1 .*shape \(3,\)"):
        x.item()
    assert x.item(2) == 0.75  # an index picks one element, as in NumPy
    with pytest.raises(ScaledTypeError, match=r"only size-1 .*float\(\).*to_array"):
        float(x)
    with pytest.raises(ScaledTypeError, match=r"only size-1 .*int\(\)"):
        int(x)
    with pytest.raises(ValueError, match="ambiguous.*any"):
        bool(x)


def test_format_follows_jax_arrays():
    x = scalify.scaled_array(3.0, 0.5)
    assert f"{x:.4f}" == "1.5000" == f"{jnp.float32(1.5):.4f}"
    assert f"{x:>8.2e}" == format(1.5, ">8.2e")
    arr = scalify.scaled_array([1.0, 2.0], 0.5)
    assert f"{arr}" == str(arr) == repr(arr)
    with pytest.raises(TypeError):  # as for a jax.Array / np.ndarray of rank > 0
        f"{arr:.2f}"
    with pytest.raises(TypeError):
        f"{jnp.array([0.5, 1.0]):.2f}"


def test_repr_shows_value_data_and_scale():
    x = scalify.scaled_array([1.0, 2.0, 3.0], 0.25)
    text = repr(x)
    assert text.startswith("ScaledArray(value=[0.25, 0.5 , 0.75], data=Array([1., 2., 3.]")
    assert "scale=Array(0.25, dtype=float32)" in text
    assert repr(scalify.scaled_array(3.0, 0.5)).startswith("ScaledArray(value=1.5, data=")
    # Placeholders (jax.eval_shape) have no value to show, and repr does not fail.
    shapes = jax.eval_shape(lambda a: a, x)
    assert repr(shapes).startswith("ScaledArray(data=ShapeDtypeStruct(shape=(3,)")


def test_conversions_under_a_trace_need_a_concrete_value():
    x = scalify.scaled_array(3.0, 0.5)
    for convert in (float, int, bool, lambda a: a.item(), lambda a: f"{a:.2f}", np.asarray):
        def f(a):
            convert(a)

        with pytest.raises(ScaledTypeError, match=r"needs a concrete value.*data is traced.*outside"):
            jax.jit(f)(x)
    seen = []

    def g(a):
        seen.append(repr(a))  # repr does not try to materialise tracers
        return a

    jax.jit(g)(x)
    assert seen[0].startswith("ScaledArray(data=") and "value=" not in seen[0]
    with pytest.raises(ScaledTypeError, match="needs a concrete value.*eval_shape"):
        float(jax.eval_shape(lambda a: a, x))


# ----------------------------------------------------------------------------- operators

_OPERATOR_CASES = {
    "+": lambda x: x + x,
    "* (scalar)": lambda x: x * 2,
    "* (reflected)": lambda x: 2 * x,
    "- (unary)": lambda x: -x,
    "/": lambda x: x / 2.0,
    "**": lambda x: x**2,
    "@": lambda x: x @ x,
    "<": lambda x: x < 1.0,
    ">=": lambda x: x >= x,
    "==": lambda x: x == x,
    "!=": lambda x: x != 1.0,
    "abs": abs,
    "indexing": lambda x: x[0],
    "iteration": list,
    "+= (in place)": lambda x: x.__iadd__(x),
    "numpy array +": lambda x: np.ones(2, np.float32) + x,
    "numpy scalar *": lambda x: np.float32(2) * x,
    "jax array *": lambda x: jnp.ones(2) * x,
}


@pytest.mark.parametrize("op", list(_OPERATOR_CASES))
def test_operators_outside_scalify_say_what_to_do(op):
    x = scalify.scaled_array([1.0, 2.0], 0.5)
    with pytest.raises(ScaledTypeError, match=r"scalify\.scalify.*to_array\(\)"):
        _OPERATOR_CASES[op](x)


def test_operator_error_is_a_type_error_and_scalify_computes_the_same_expression():
    assert issubclass(ScaledTypeError, TypeError)
    x = scalify.scaled_array([1.0, 2.0], 0.5)
    with pytest.raises(TypeError, match=r"does not support `\+` outside scalify"):
        x + x
    out = scalify.scalify(lambda a: a + a * 2.0)(x)
    np.testing.assert_array_equal(scalify.asarray(out), [1.5, 3.0])
    # Hashing (identity) still works: ScaledArrays can key dicts and sit in sets.
    assert {x: 1}[x] == 1 and len({x, x}) == 1


# ----------------------------------------------------------------------------- construction


def test_missing_scale_or_data_is_an_error_at_construction():
    with pytest.raises(ScaleError, match=r"scale is missing \(got None\).*scaled_array\(data, 1\.0\)"):
        ScaledArray(jnp.ones(2), None)
    with pytest.raises(ScaleError, match=r"data is missing"):
        ScaledArray(None, jnp.float32(1))
    with pytest.raises(ScaleError, match=r"scale is missing \(got None\)"):
        scalify.scaled_array([1.0, 2.0], None)
    # The pytree machinery still rebuilds ScaledArrays around placeholders.
    x = scalify.scaled_array([1.0, 2.0], 0.5)
    treedef = jax.tree_util.tree_structure(x)
    empty = jax.tree_util.tree_unflatten(treedef, [None, None])
    assert isinstance(empty, ScaledArray) and empty.scale is None
    assert jax.tree.map(lambda a: None, x).data is None


@pytest.mark.parametrize("exponent, what", [(200, "overflows"), (128, "overflows"), (-200, "underflows"),
                                            (-150, "underflows")])
def test_scale_out_of_the_scale_dtype_range_is_a_clear_error_without_numpy_warning(exponent, what):
    scale = 2.0**exponent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ScaleError) as info:
            scalify.scaled_array([1.0, 2.0], scale)
        with pytest.raises(ScaleError, match=what):
            scalify.as_scaled_array(jnp.ones(2), scale=scale)
    msg = str(info.value)
    assert f"scale {scale!r} (2^{exponent}) {what} the scale dtype float32" in msg
    assert "2^-126 to 2^127" in msg and "keep the rest of the factor in the data" in msg


def test_scales_at_the_ends_of_the_float32_range_are_kept_exactly():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for exponent in (127, -126, -149):  # the largest, smallest normal and smallest subnormal
            x = scalify.scaled_array([1.0], 2.0**exponent)
            assert x.scale.dtype == jnp.float32 and float(x.scale) == 2.0**exponent
    with pytest.raises(ScaleError, match="power of two"):  # not a power of two: reported as given
        scalify.scaled_array([1.0], 3e200)


@pytest.mark.parametrize("log2_scale, lost", [(20, np.inf), (-30, 0.0)])
def test_np_asarray_warns_when_the_value_does_not_fit_the_data_dtype(log2_scale, lost):
    """float16 data at 2^20 (2^-30): np.asarray gives float16 as NumPy expects, inf (0) as
    plain JAX would hold, with a warning that says so; item() and to_array(float32) give
    the value; a value that fits gives no warning."""
    x = scalify.scaled_array(np.float16([1.5, 0.0]), np.float32(2.0**log2_scale))
    with pytest.warns(RuntimeWarning, match="do not fit float16"):
        out = np.asarray(x)
    assert out.dtype == np.float16 and out[0] == lost and out[1] == 0
    assert x.item(0) == 1.5 * 2.0**log2_scale
    assert x.to_array(np.float32)[0] == np.float32(1.5 * 2.0**log2_scale)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.asarray(scalify.scaled_array(np.float16([1.5, 0.0]), np.float32(2.0**4)))
        np.asarray(x, dtype=np.float32)


# ------------------------------------------------------------ scales that are not powers of two


def _sum_of_squares(x):
    return jnp.sum(x * x)


def test_a_traced_scale_that_is_not_a_power_of_two_gives_the_plain_value():
    """A scale made under jax.jit is not known when `scaled_array` builds the ScaledArray:
    it is split exactly, so a scale of 1.5 gives sum(x * x) = 36, not the 33.75 of a scale
    taken as a power of two."""
    build = scalify.scaled_array
    d = jnp.full((4,), 2.0, jnp.float32)

    @jax.jit
    def step(d, s):
        return scalify.scalify(_sum_of_squares)(build(d, s)).to_array()

    assert float(step(d, 1.5)) == 36.0
    np.testing.assert_array_equal(step(d, 1.5), jax.jit(lambda d, s: _sum_of_squares(d * s))(d, 1.5))
    for s in (0.75, -3.0, 2.0**-5 * 1.25, 2.0**20 * 1.75, 0.0):
        np.testing.assert_allclose(step(d, s), _sum_of_squares(d * np.float32(s)), rtol=1e-6, err_msg=str(s))
    assert np.isnan(step(d, np.nan)) and np.isposinf(step(d, np.inf))


def test_traced_scales_are_split_exactly_into_power_of_two_and_mantissa():
    """`scaled_array` under jit: the scale becomes a power of two, the mantissa goes into
    the data (one rounding: the value is `data * s` as plain JAX computes it); a power of
    two leaves data and scale unchanged, bit for bit; per-row scales are split per row."""
    rows = jax.random.normal(jax.random.PRNGKey(0), (3, 5), jnp.float32)
    scales = jnp.array([[1.5], [2.0**-3], [-0.625 * 2.0**9]], jnp.float32)
    out = jax.jit(scalify.scaled_array)(rows, scales)
    assert np.all(scalify.core.pow2.is_pow2(np.asarray(out.scale)))
    np.testing.assert_array_equal(out.to_array(), rows * scales)
    np.testing.assert_array_equal(out.data[1], rows[1])  # a power of two: data unchanged
    np.testing.assert_array_equal(out.scale.ravel(), [1.0, 2.0**-3, 2.0**8])
    # float16 data: the mantissa is multiplied in float32 and rounded once to float16.
    h = rows.astype(jnp.float16)
    out16 = jax.jit(scalify.scaled_array)(h, jnp.float32(3.0 * 2.0**-12))
    assert out16.dtype == jnp.float16 and float(out16.scale) == 2.0**-11
    np.testing.assert_array_equal(out16.data, (h.astype(jnp.float32) * 1.5).astype(jnp.float16))


def test_arguments_of_a_scalified_function_rebuilt_by_tree_map_are_checked():
    """A ScaledArray rebuilt by pytree operations skips the constructor's check: its
    concrete scale is checked when it enters scalify (an error that says what to do)."""
    x = scalify.scaled_array(jnp.full((4,), 2.0), 1.0)
    tripled = jax.tree_util.tree_map(lambda t: t * 1.5, x)  # data 3, scale 1.5
    with pytest.raises(ScaleError, match="power of two"):
        scalify.scalify(_sum_of_squares)(tripled)
    with pytest.raises(ScaleError, match="power of two"):  # eager construction: checked
        scalify.scaled_array(jnp.ones(4), 1.5)


def test_as_scaled_array_with_a_traced_scale_rounds_it_to_a_power_of_two():
    x = jnp.array([1.0, -3.0, 0.1], jnp.float32)
    out = jax.jit(lambda x, s: scalify.as_scaled_array(x, scale=s))(x, 3.0)
    assert float(out.scale) == 2.0
    np.testing.assert_array_equal(out.to_array(), x)


# ----------------------------------------------------------------- to_array of narrow formats


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, ml_dtypes.float4_e2m1fn])
def test_to_array_of_narrow_formats_is_float32(dtype):
    """FP8 (and FP4) data materialise in float32 by default: their dtypes do not promote
    with others in JAX (`fp8.to_array() - ref` raised), and their range rarely holds the
    value. An explicit dtype is kept; 16-bit and wider data keep their dtype."""
    ref = np.array([1.0, -2.0, 0.5], np.float32) * 2.0**-20
    x = scalify.scaled_array(np.array([1.0, -2.0, 0.5]), 2.0**-20, dtype=dtype)
    for out in (x.to_array(), jax.jit(lambda a: a.to_array())(x), scalify.asarray(x), np.asarray(x)):
        assert out.dtype == np.float32
        np.testing.assert_array_equal(out - ref, 0.0)
    assert x.to_array(dtype).dtype == dtype
    fp8_out = scalify.scalify(lambda a: a * 2.0)(x)
    np.testing.assert_array_equal(fp8_out.to_array() - ref * 2, 0.0)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_to_array_of_16_and_32_bit_data_keeps_their_dtype(dtype):
    x = scalify.scaled_array(np.array([1.0, -2.0]), 2.0**-3, dtype=dtype)
    assert x.to_array().dtype == dtype and jax.jit(lambda a: a.to_array())(x).dtype == dtype
