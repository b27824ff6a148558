"""scalify.core.lax_utils: the lax-level stand-ins give the jnp results (values, dtypes,
shapes, weak types) and bind a single primitive when the operands agree."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalify.core import lax_utils as L

OPS = [(L.mul, jnp.multiply), (L.div, jnp.divide), (L.maximum, jnp.maximum)]
OPERANDS = [
    (np.ones((3, 4), np.float32) * 3, np.float32(2)),              # array and 0-d, same dtype
    (np.arange(12, dtype=np.float16).reshape(3, 4), 0.5),          # Python scalar (weak type)
    (np.ones((3, 4), np.float16), np.float32(2)),                  # dtype promotion
    (np.ones((3, 1), np.float32), np.arange(4, dtype=np.float32)),  # broadcasting
    (np.float32(6), np.float32(4)),
]


@pytest.mark.parametrize("ours,ref", OPS, ids=lambda f: getattr(f, "__name__", "?"))
@pytest.mark.parametrize("a,b", OPERANDS)
def test_binary_ops_match_jnp(ours, ref, a, b):
    got, want = jax.jit(ours)(a, b), jax.jit(ref)(a, b)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert L.mul(jnp.float32(2), 3.0).weak_type == jnp.multiply(jnp.float32(2), 3.0).weak_type


def test_agreeing_operands_bind_one_primitive():
    jaxpr = jax.make_jaxpr(lambda x, s: L.mul(x, s))(jnp.ones((3, 4)), jnp.float32(2))
    assert [e.primitive.name for e in jaxpr.eqns] == ["mul"]
    jaxpr = jax.make_jaxpr(lambda x: L.astype(x, jnp.float32))(jnp.ones(3))
    assert not jaxpr.eqns  # same dtype: no convert


def test_astype_arr_and_clip():
    x = jnp.arange(5, dtype=jnp.int32)
    assert L.astype(x, jnp.float16).dtype == jnp.float16
    assert L.arr(x) is x and isinstance(L.arr(3.0), jax.Array)
    np.testing.assert_array_equal(L.clip(x, 1, 3), jnp.clip(x, 1, 3))
