import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalify.quant import E8M0, e8m0_exponent, from_e8m0, to_e8m0


def test_e8m0_dtype_exists():
    assert jnp.dtype("float8_e8m0fnu") == E8M0


@pytest.mark.parametrize("shape", [(), (255,), (5, 51)], ids=str)
def test_exact_round_trip_all_powers_of_two(shape):
    exps = np.arange(-127, 128)  # all 255 finite E8M0 values
    size = int(np.prod(shape))
    e = exps[np.arange(size) % exps.size].reshape(shape) if size else exps[:0]
    s = np.ldexp(np.float32(1), e).astype(np.float32)
    q = to_e8m0(s)
    assert q.dtype == E8M0 and q.shape == s.shape
    np.testing.assert_array_equal(np.asarray(e8m0_exponent(q)), e)
    back = from_e8m0(q)
    assert back.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(back), s)


def test_round_trip_under_jit():
    # jnp.exp2 is not exact for integer exponents on XLA CPU; ldexp is.
    s = jnp.ldexp(jnp.float32(1), jnp.arange(-100, 101))
    back = jax.jit(lambda v: from_e8m0(to_e8m0(v)))(s)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(s))


@pytest.mark.parametrize(
    "bad", [3.0, 0.75, 0.0, -2.0, np.inf, np.nan, 2.0**-128, 1.5 * 2.0**-100], ids=str
)
def test_rejects_non_powers_of_two(bad):
    with pytest.raises(ValueError, match="powers of two"):
        to_e8m0(np.array([1.0, bad], np.float32))


def test_traced_input_rounds_instead_of_raising():
    q = jax.jit(to_e8m0)(jnp.array([3.0, 1.4, 0.0], jnp.float32))
    out = np.asarray(from_e8m0(q))
    assert out[0] == 4.0 and out[1] == 1.0 and np.isnan(out[2])


def test_from_uint8_bits_and_nan_code():
    bits = jnp.array([0, 126, 127, 128, 254, 255], jnp.uint8)
    out = np.asarray(from_e8m0(bits))
    np.testing.assert_array_equal(out[:5], [2.0**-127, 0.5, 1.0, 2.0, 2.0**127])
    assert np.isnan(out[5])


def test_from_e8m0_rejects_other_dtypes():
    with pytest.raises(TypeError, match="to_e8m0"):
        from_e8m0(jnp.ones(3, jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_from_e8m0_dtype(dtype):
    q = to_e8m0(jnp.array([0.25, 1.0, 8.0]))
    out = from_e8m0(q, dtype)
    assert out.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(out).astype(np.float32), [0.25, 1.0, 8.0])
