import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import scalify
from scalify import ScaledArray, ScaleError


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


def test_scaled_array_refuses_silent_materialisation_in_jnp():
    x = scalify.scaled_array([1.0, 2.0], 1.0)
    with pytest.raises(TypeError, match="scalify"):
        jnp.sin(x)


def test_fp8_data_and_e8m0_like_scale_storage():
    x = scalify.scaled_array(np.array([1.0, -2.0, 0.5]), 2.0**-8, dtype=ml_dtypes.float8_e4m3fn)
    assert x.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(x.to_array(jnp.float32), np.array([1.0, -2.0, 0.5]) * 2**-8)
