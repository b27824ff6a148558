"""Scaling ops (scalify/ops/scaling.py): set_scaling, get_data_scale, stop_scaling, rebalance.

Outside scalify: identity / cast, under jit, grad and vmap. Inside: the scale change (data and
scale checked), exact values in float32, special values kept, float16 data kept in range,
errors for non-power-of-two scales and integer inputs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import scalify
from scalify import ScaledArray, ScaleError, scaled_array
from scalify.ops import get_data_scale, rebalance, set_scaling, stop_scaling
from _ops_testing import assert_close, data, requires

S = scalify.scalify
OPS_IDENTITY = {
    "set_scaling": lambda x: set_scaling(x, 2.0**-3),
    "rebalance": lambda x: rebalance(x, 2.0**4),
    "stop_scaling": lambda x: stop_scaling(x),
    "get_data_scale": lambda x: get_data_scale(x)[0] * get_data_scale(x)[1],
}


# -- outside scalify -------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(OPS_IDENTITY))
def test_identity_outside_scalify_eager_jit_vmap(name):
    op = OPS_IDENTITY[name]
    x = jnp.asarray(data((3, 4), special=True))
    assert_close(op(x), x, rtol=0)
    assert_close(jax.jit(op)(x), x, rtol=0)
    assert_close(jax.vmap(op)(x), x, rtol=0)


@pytest.mark.parametrize("name", sorted(OPS_IDENTITY))
def test_gradient_is_identity_outside_scalify(name):
    op = OPS_IDENTITY[name]
    x = jnp.asarray(data((3, 4)))
    grad = jax.grad(lambda a: jnp.sum(jnp.sin(op(a))))
    np.testing.assert_array_equal(grad(x), jnp.cos(x))
    np.testing.assert_array_equal(jax.jit(grad)(x), jnp.cos(x))
    np.testing.assert_array_equal(jax.vmap(grad)(x), jnp.cos(x))
    _, tangent = jax.jvp(op, (x,), (jnp.ones_like(x),))
    np.testing.assert_array_equal(tangent, jnp.ones_like(x))


def test_outside_values_and_dtypes():
    x = jnp.asarray(data((2, 3)))
    d, s = get_data_scale(x)
    assert d is not None and s.dtype == jnp.float32 and s.shape == () and float(s) == 1.0
    d, s = get_data_scale(x, scale_shape=(2, 1))
    assert s.shape == (2, 1)
    y = stop_scaling(x, jnp.float16)
    assert y.dtype == jnp.float16
    np.testing.assert_array_equal(y, x.astype(jnp.float16))
    assert jax.grad(lambda a: stop_scaling(a, jnp.float16).astype(jnp.float32).sum())(x).dtype == jnp.float32


def test_vmap_with_batched_scale_operands_outside():
    x = jnp.asarray(data((4, 3)))
    scales = 2.0 ** jnp.arange(4.0)
    np.testing.assert_array_equal(jax.vmap(set_scaling)(x, scales), x)
    np.testing.assert_array_equal(jax.vmap(rebalance)(x, scales), x)
    np.testing.assert_array_equal(jax.vmap(lambda s: set_scaling(x, s))(scales), jnp.stack([x] * 4))


# -- inside scalify ----------------------------------------------------------------------
@pytest.mark.parametrize("s_in,s_out", [(2.0**-5, 2.0**7), (2.0**7, 2.0**-5), (1.0, 2.0**-3)])
def test_set_scaling_changes_scale_exactly(s_in, s_out):
    x = data((3, 4), special=True)
    xs = scaled_array(x, s_in)
    out = S(lambda a: set_scaling(a, s_out))(xs)
    assert isinstance(out, ScaledArray)
    assert float(out.scale) == s_out and out.dtype == jnp.float32
    assert_close(out.data, x * (s_in / s_out), rtol=0)
    assert_close(out.to_array(), xs.to_array(), rtol=0)


def test_set_scaling_makes_unscaled_input_scaled():
    x = data((5,))
    out = S(lambda a: set_scaling(a, 2.0**-4))(jnp.asarray(x))
    assert isinstance(out, ScaledArray) and float(out.scale) == 2.0**-4
    np.testing.assert_array_equal(out.data, x * 16)


def test_set_scaling_array_scale():
    x = data((3, 4))
    scale = 2.0 ** np.arange(-1.0, 2.0).reshape(3, 1)
    out = S(lambda a: set_scaling(a, scale))(scaled_array(x, 2.0**-5))
    np.testing.assert_array_equal(out.scale, scale)
    np.testing.assert_array_equal(out.to_array(), x * 2.0**-5)


def test_set_scaling_traced_scale_is_rounded_and_guarded():
    x = data((4,))
    xs = scaled_array(x, 2.0**-2)
    f = S(lambda a, s: set_scaling(a, s))
    out = f(xs, 3.0)  # traced: rounded to 2 (value unchanged)
    assert float(out.scale) == 2.0
    np.testing.assert_array_equal(out.to_array(), xs.to_array())
    for bad in (0.0, np.inf, np.nan):  # keeps the current scale, never nan
        out = f(xs, bad)
        assert float(out.scale) == 2.0**-2
        np.testing.assert_array_equal(out.to_array(), xs.to_array())


def test_set_scaling_float16_keeps_data_in_range():
    # The value 2^-22 * x is below float16's subnormals; as data * 2^-20 it is exact.
    x = data((64,), dtype=np.float16)
    xs = scaled_array(x, 2.0**-22, dtype=jnp.float16)
    out = S(lambda a: set_scaling(a, 2.0**-20))(xs)
    assert out.dtype == jnp.float16
    np.testing.assert_array_equal(out.data.astype(np.float32), x.astype(np.float32) / 4)
    np.testing.assert_array_equal(out.to_array(jnp.float32), xs.to_array(jnp.float32))


def test_get_data_scale_inside():
    x = data((2, 3))
    d, s = S(get_data_scale)(scaled_array(x, 2.0**-5))
    assert not isinstance(d, ScaledArray) and not isinstance(s, ScaledArray)
    np.testing.assert_array_equal(d, x)
    assert float(s) == 2.0**-5 and s.dtype == jnp.float32
    d, s = S(lambda a: get_data_scale(a, (2, 1)))(scaled_array(x, 2.0**3))
    np.testing.assert_array_equal(s, np.full((2, 1), 8.0))
    # per-row scale
    rows = 2.0 ** np.array([[1.0], [-2.0]], np.float32)
    d, s = S(lambda a: get_data_scale(a, (2, 1)))(scaled_array(x, rows))
    np.testing.assert_array_equal(s, rows)
    with pytest.raises(ScaleError, match="merge=True"):
        S(get_data_scale)(scaled_array(x, rows))
    # unscaled input: (x, 1)
    d, s = S(get_data_scale)(jnp.asarray(x))
    np.testing.assert_array_equal(d, x)
    assert float(s) == 1.0


@pytest.mark.parametrize("dtype", [None, jnp.float16, jnp.float32])
def test_stop_scaling_inside(dtype):
    x = data((3, 4), special=True)
    xs = scaled_array(x, 2.0**7)
    out = S(lambda a: stop_scaling(a, dtype))(xs)
    assert not isinstance(out, ScaledArray)
    assert out.dtype == (dtype or jnp.float32)
    assert_close(out, (x * 2.0**7).astype(dtype or np.float32), rtol=0)


def test_stop_scaling_float16_data_materialised_in_float32():
    # float16 data at 2^-20: the value underflows plain float16 but float32 is exact.
    x = data((64,), dtype=np.float16)
    out = S(lambda a: stop_scaling(a, jnp.float32))(scaled_array(x, 2.0**-20, dtype=jnp.float16))
    np.testing.assert_array_equal(out, x.astype(np.float32) * 2.0**-20)


@pytest.mark.parametrize("factor", [2.0**-3, 2.0**5])
def test_rebalance_inside(factor):
    x = data((3, 4), special=True)
    xs = scaled_array(x, 2.0**-5)
    out = S(lambda a: rebalance(a, factor))(xs)
    assert float(out.scale) == 2.0**-5 / factor
    assert_close(out.data, x * factor, rtol=0)
    assert_close(out.to_array(), xs.to_array(), rtol=0)
    out = S(lambda a: rebalance(a, factor))(jnp.asarray(x))  # unscaled input
    assert float(out.scale) == 1 / factor


def test_eager_scaled_array_outside_scalify():
    x = data((4,))
    xs = scaled_array(x, 2.0**-5)
    out = set_scaling(xs, 2.0**3)
    assert float(out.scale) == 8.0
    np.testing.assert_array_equal(out.to_array(), xs.to_array())
    d, s = get_data_scale(xs)
    np.testing.assert_array_equal(d, x)
    assert float(s) == 2.0**-5
    np.testing.assert_array_equal(stop_scaling(xs), x * 2.0**-5)
    assert float(rebalance(xs, 4.0).scale) == 2.0**-7


def test_scaling_ops_under_jit_of_scalify():
    x = data((3, 4))
    xs = scaled_array(x, 2.0**-5)

    def f(a):
        b = rebalance(set_scaling(a, 2.0**2), 2.0**-1)
        d, s = get_data_scale(b)
        return b, stop_scaling(b), d, s

    b, m, d, s = jax.jit(S(f))(xs)
    assert float(b.scale) == 8.0 and float(s) == 8.0
    np.testing.assert_array_equal(m, x * 2.0**-5)
    np.testing.assert_array_equal(d, x / 2**8)


@pytest.mark.usefixtures("arguments_as_given")
def test_vmap_inside_scalify_per_example_scale():
    x = data((4, 3))
    scales = (2.0 ** np.arange(4.0)).astype(np.float32)
    out = S(jax.vmap(set_scaling))(scaled_array(x, 2.0**-5), scales)
    assert out.scale.shape == (4, 1)
    np.testing.assert_array_equal(out.scale[:, 0], scales)
    np.testing.assert_array_equal(out.to_array(), x * 2.0**-5)
    d, s = S(jax.vmap(get_data_scale))(out)
    np.testing.assert_array_equal(s, np.broadcast_to(scales[:, None], (4, 1)))


@requires(lax.mul_p, lax.reduce_sum_p, lax.sin_p, lax.cos_p)
def test_gradients_with_scalify():
    x = data((3, 4))
    xs = scaled_array(x, 2.0**-5)

    def f(a):
        b = rebalance(set_scaling(a, 2.0**3), 2.0)
        return jnp.sum(jnp.sin(stop_scaling(b, jnp.float32)) * 3.0)

    want = 3 * np.cos(x * 2.0**-5)
    assert_close(np.asarray(S(jax.grad(f))(xs)), want)
    g = jax.grad(lambda a: S(f)(a))(xs)  # gradient w.r.t. data: d value/d data = scale
    assert_close(g.data, want * 2.0**-5)


# -- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [3.0, 0.0, -2.0, np.inf, np.nan, np.array([1.0, 3.0])])
def test_non_pow2_scale_raises(bad):
    x = jnp.ones((2,))
    with pytest.raises(ScaleError, match="power of two"):
        set_scaling(x, bad)
    with pytest.raises(ScaleError, match="power of two"):
        rebalance(x, bad)
    with pytest.raises(ScaleError, match="power of two"):
        S(lambda a: set_scaling(a, bad))(scaled_array(x, 1.0))


@pytest.mark.parametrize("op", [
    lambda x: set_scaling(x, 2.0), lambda x: rebalance(x, 2.0), get_data_scale, stop_scaling
])
@pytest.mark.parametrize("x", [jnp.arange(3), jnp.array([True, False]), 3])
def test_integer_input_raises(op, x):
    with pytest.raises(ScaleError, match="floating-point"):
        op(x)


def test_other_errors():
    x = jnp.ones((2, 3))
    with pytest.raises(ScaleError, match="does not broadcast"):
        set_scaling(x, jnp.ones((3, 1)))
    with pytest.raises(ScaleError, match="does not broadcast"):
        get_data_scale(x, scale_shape=(4,))
    with pytest.raises(ScaleError, match="floating point"):
        stop_scaling(x, jnp.int32)


@pytest.mark.parametrize("jit", [False, True])
def test_get_data_scale_merge_keeps_the_values(jit):
    """`merge=True`: a per-row scale (the per-layer scales of stacked parameters) merged to
    its largest value, the data multiplied by scale / largest: the same values, exactly,
    for rows 2^-40 to 2^40 apart; a scale that already fits is returned as it is."""
    x = data((3, 4))
    rows = 2.0 ** np.array([[40.0], [-40.0], [3.0]], np.float32)
    f = S(lambda a: get_data_scale(a, merge=True))
    f = jax.jit(f) if jit else f
    d, s = f(scaled_array(x, rows))
    assert s.shape == () and float(s) == 2.0**40
    np.testing.assert_array_equal(np.asarray(d, np.float64) * float(s),
                                  np.asarray(x, np.float64) * np.asarray(rows, np.float64))
    # per-row scale kept where scale_shape asks for it; a scalar scale untouched
    d, s = f(scaled_array(x, 2.0**-5))
    np.testing.assert_array_equal(d, x)
    assert float(s) == 2.0**-5
    d, s = S(lambda a: get_data_scale(a, (3, 1), merge=True))(scaled_array(x, rows))
    np.testing.assert_array_equal(d, x)
    np.testing.assert_array_equal(s, rows)


# -- as_scaled_value ------------------------------------------------------------------------------
@pytest.mark.parametrize("jit", [False, True])
def test_as_scaled_value_makes_a_plain_value_scaled_and_keeps_a_scaled_one(jit):
    """Inside scalify an unscaled value comes out as a ScaledArray at scale 1 with its data
    unchanged, a scaled one as it is (scales 2^-100..2^100); outside it is the identity;
    its gradient is the identity."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.bfloat16)
    wrap = jax.jit if jit else (lambda f: f)
    out = wrap(scalify.scalify(scalify.ops.as_scaled_value))(x)
    assert isinstance(out, scalify.ScaledArray) and float(out.scale) == 1.0
    np.testing.assert_array_equal(np.asarray(out.data, np.float32), np.asarray(x, np.float32))
    for e in (-100, 0, 100):
        s = scalify.ScaledArray(x, jnp.float32(2.0**e))
        kept = wrap(scalify.scalify(scalify.ops.as_scaled_value))(s)
        assert float(kept.scale) == 2.0**e
        np.testing.assert_array_equal(np.asarray(kept.data, np.float32), np.asarray(x, np.float32))
    np.testing.assert_array_equal(np.asarray(wrap(scalify.ops.as_scaled_value)(x)), np.asarray(x))
    g = wrap(jax.grad(lambda v: jnp.sum(scalify.ops.as_scaled_value(v) * v)))(jnp.float32(3.0))
    assert float(g) == 6.0
    with pytest.raises(Exception, match="floating"):
        scalify.ops.as_scaled_value(jnp.arange(3))
