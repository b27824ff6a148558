"""Dynamic and delayed rescaling (scalify/ops/rescale.py).

Outside scalify: identity (jit/grad/vmap). Inside: data gets unit l1-mean / RMS / max-abs
(in [1, 2) with round-down), values unchanged, special values keep the scale, float16 at
2^-20 becomes unit-ish. `*_grad` variants change only the backward scale. Delayed rescaling
uses the scale from previous steps' max-abs history.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import scalify
from scalify import ScaledArray, ScaleError, scaled_array
from scalify.ops import (
    DelayedScalingState,
    delayed_rescale,
    delayed_scaling_init,
    dynamic_rescale_l1,
    dynamic_rescale_l1_grad,
    dynamic_rescale_l2,
    dynamic_rescale_l2_grad,
    dynamic_rescale_max,
    dynamic_rescale_max_grad,
)
from _ops_testing import assert_close, data, requires
from _jaxpr_testing import equations

S = scalify.scalify
FWD = {"l1": dynamic_rescale_l1, "l2": dynamic_rescale_l2, "max": dynamic_rescale_max}
GRAD = {"l1": dynamic_rescale_l1_grad, "l2": dynamic_rescale_l2_grad, "max": dynamic_rescale_max_grad}
ALL = {**{k: v for k, v in FWD.items()}, **{k + "_grad": v for k, v in GRAD.items()}}


def _norm(x, norm):
    x = np.abs(np.asarray(x, np.float64))
    return {"l1": np.mean(x), "l2": np.sqrt(np.mean(x * x)), "max": np.max(x)}[norm]


# -- outside scalify -------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(ALL))
def test_identity_outside_scalify(name):
    op = ALL[name]
    x = jnp.asarray(data((3, 4), special=True))
    assert_close(op(x), x, rtol=0)
    assert_close(jax.jit(op)(x), x, rtol=0)
    assert_close(jax.vmap(op)(x), x, rtol=0)
    y = jnp.asarray(data((3, 4)))
    grad = jax.grad(lambda a: jnp.sum(jnp.sin(op(a))))
    np.testing.assert_array_equal(grad(y), jnp.cos(y))
    np.testing.assert_array_equal(jax.vmap(grad)(y), jnp.cos(y))
    np.testing.assert_array_equal(jax.jvp(op, (y,), (jnp.ones_like(y),))[1], jnp.ones_like(y))


# -- inside scalify ----------------------------------------------------------------------
@pytest.mark.parametrize("norm", sorted(FWD))
@pytest.mark.parametrize("scale", [2.0**-5, 2.0**7])
@pytest.mark.parametrize("mult", [1e-3, 1.0, 1e4])
def test_dynamic_rescale_unit_norm_and_invariance(norm, scale, mult):
    x = data((4, 8), seed=1, scale=mult)
    xs = scaled_array(x, scale)
    out = S(FWD[norm])(xs)
    assert isinstance(out, ScaledArray) and out.scale.shape == ()
    assert 1.0 <= _norm(out.data, norm) < 2.0
    np.testing.assert_array_equal(out.to_array(), xs.to_array())  # exact: power-of-two ratio


@pytest.mark.parametrize("norm", sorted(FWD))
@pytest.mark.parametrize("mult", [1e-3, 1e4])
def test_float16_at_tiny_scale_becomes_unit(norm, mult):
    # Values ~mult * 2^-20 underflow float16 (1e-9) or lose precision; data stays unit-ish.
    x = data((256,), seed=2, scale=mult, dtype=np.float16)
    xs = scaled_array(x, 2.0**-20, dtype=jnp.float16)
    out = S(FWD[norm])(xs)
    assert out.dtype == jnp.float16
    assert 1.0 <= _norm(out.data, norm) < 2.0
    np.testing.assert_allclose(
        out.to_array(jnp.float32), xs.to_array(jnp.float32), rtol=1e-3, atol=0
    )
    moved = np.log2(float(out.scale)) + 20  # ~ log2(mult)
    assert abs(moved - np.log2(mult)) <= 3


@pytest.mark.parametrize("norm", sorted(FWD))
def test_float32_huge_values_do_not_overflow_the_norm(norm):
    x = np.full((1024,), 1e37, np.float32)
    out = S(FWD[norm])(scaled_array(x, 2.0**-1))
    assert 1.0 <= _norm(out.data, norm) < 2.0
    np.testing.assert_array_equal(out.to_array(), x / 2)


@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_float32_norm_over_the_whole_exponent_range(norm):
    """Float32 data whose largest element is anywhere from 2^-120 to 2^126, over 2^16
    elements (sums that overflow float32 from 2^57 on for l2), reaching the rescale as is
    (no input guard): the data leaves with a unit norm and the values are unchanged,
    eagerly and under jit."""
    base = data((1 << 16,), seed=9)
    base = base / np.max(np.abs(base))  # largest |element| exactly 1
    for e in range(-120, 127, 9):
        x = (base * np.float32(2.0**e)).astype(np.float32)
        xs = scaled_array(x, 2.0**-3)
        for jit in (False, True):
            with scalify.ScalifyConfig(input_drift_window=None):
                fn = jax.jit(S(FWD[norm])) if jit else S(FWD[norm])
                out = fn(xs)
            assert 1.0 <= _norm(out.data, norm) < 2.0, (e, _norm(out.data, norm))
            np.testing.assert_array_equal(out.to_array(), xs.to_array())


@pytest.mark.parametrize("norm", sorted(FWD))
@pytest.mark.parametrize("special", ["zeros", "inf", "nan"])
def test_special_values_keep_the_scale(norm, special):
    x = np.zeros((8,), np.float32) if special == "zeros" else data((8,), seed=3)
    if special != "zeros":
        x[2] = {"inf": np.inf, "nan": np.nan}[special]
    xs = scaled_array(x, 2.0**-5)
    with scalify.ScalifyConfig(input_drift_window=None):  # the argument as given (the input
        out = S(FWD[norm])(xs)                          # guard moves all-zero data to 2^-64)
    assert float(out.scale) == 2.0**-5
    assert_close(out.to_array(), xs.to_array(), rtol=0)


@pytest.mark.parametrize("norm", sorted(FWD))
def test_unscaled_input_becomes_scaled(norm):
    x = data((16,), seed=4, scale=300.0)
    out = S(FWD[norm])(jnp.asarray(x))
    assert isinstance(out, ScaledArray)
    assert 1.0 <= _norm(out.data, norm) < 2.0
    np.testing.assert_array_equal(out.to_array(), x)


def test_non_scalar_input_scale():
    x = data((3, 4), seed=5)
    rows = (2.0 ** np.array([[-3.0], [0.0], [4.0]])).astype(np.float32)
    xs = scaled_array(x, rows)
    out = S(dynamic_rescale_l2)(xs)
    assert out.scale.shape == ()
    assert 1.0 <= _norm(out.data, "l2") < 2.0
    np.testing.assert_allclose(out.to_array(), xs.to_array(), rtol=1e-6)


def test_vmap_inside_scalify_is_per_example():
    x = data((3, 16), seed=6) * np.array([[1e-3], [1.0], [1e3]], np.float32)
    out = S(jax.vmap(dynamic_rescale_max))(scaled_array(x, 2.0**-5))
    assert out.scale.shape == (3, 1)
    for row in np.asarray(out.data):
        assert 1.0 <= _norm(row, "max") < 2.0
    np.testing.assert_array_equal(out.to_array(), x * 2.0**-5)


def _count(jaxpr, name) -> int:
    return sum(e.primitive.name == name for e in equations(jaxpr))


@pytest.mark.parametrize("norm", ["l2", "max"])
@pytest.mark.parametrize("exponent", [-40, 0, 40])
def test_rescaled_max_is_reused_by_later_guards(norm, exponent):
    """The rescale measures the max-abs (the safe float32 l2 norm divides by it first): the
    power guard of a following `y * y` reads it instead of reducing again, and the values
    are those of plain JAX. Data 2^e off unit at scale 2^-e, the input guard off."""
    x = data((64, 32), seed=11)
    xs = scaled_array(x * np.float32(2.0**exponent), 2.0**-exponent)

    def f(a):
        y = FWD[norm](a)
        return jnp.sum(y * y)

    with scalify.ScalifyConfig(input_drift_window=None):
        jaxpr = jax.make_jaxpr(S(f))(xs).jaxpr
        out = S(f)(xs)
    assert _count(jaxpr, "reduce_max") == 1
    np.testing.assert_allclose(np.asarray(out.to_array() if isinstance(out, ScaledArray) else out),
                               np.sum(np.asarray(x, np.float64) ** 2), rtol=1e-5)


def test_rescale_reads_the_input_guards_max():
    """The input guard measured the argument's max-abs: a max rescale of it reduces nothing."""
    xs = scaled_array(data((64, 32), seed=12) * np.float32(2.0**20), 2.0**-20)
    jaxpr = jax.make_jaxpr(S(dynamic_rescale_max))(xs).jaxpr
    assert _count(jaxpr, "reduce_max") == 1  # the guard's
    out = S(dynamic_rescale_max)(xs)
    assert 1.0 <= _norm(out.data, "max") < 2.0
    np.testing.assert_array_equal(out.to_array(), xs.to_array())


def test_eager_scaled_array_and_jit():
    x = data((8,), seed=7, scale=1e3)
    xs = scaled_array(x, 2.0**-5)
    out = dynamic_rescale_l2(xs)  # outside scalify on a ScaledArray: applies the rule
    assert 1.0 <= _norm(out.data, "l2") < 2.0
    out2 = jax.jit(S(dynamic_rescale_l2))(xs)
    np.testing.assert_array_equal(out2.data, out.data)
    np.testing.assert_array_equal(out2.scale, out.scale)


def test_integer_input_raises():
    for op in ALL.values():
        with pytest.raises(ScaleError, match="floating-point"):
            op(jnp.arange(3))


# -- *_grad: identity forward, rescaled backward ------------------------------------------
@pytest.mark.parametrize("norm", sorted(GRAD))
def test_grad_variant_forward_is_identity_inside(norm):
    xs = scaled_array(data((4, 4), seed=8), 2.0**-5)
    out = S(GRAD[norm])(xs)
    np.testing.assert_array_equal(out.data, xs.data)
    np.testing.assert_array_equal(out.scale, xs.scale)


@requires(lax.mul_p, lax.reduce_sum_p, lax.broadcast_in_dim_p)
@pytest.mark.parametrize("norm", sorted(GRAD))
def test_grad_variant_rescales_only_the_backward(norm):
    x = data((4, 8), seed=9, dtype=np.float16)
    w = data((4, 8), seed=10, scale=1e-3, dtype=np.float16)
    xs = scaled_array(x, 2.0**3, dtype=jnp.float16)
    ws = scaled_array(w, 2.0**-20, dtype=jnp.float16)  # tiny weights: tiny cotangent of x

    def loss(a, b, op):
        return jnp.sum(op(a) * b)

    plain = S(jax.grad(lambda a, b: loss(a, b, lambda v: v)))(xs, ws)
    rescaled = S(jax.grad(lambda a, b: loss(a, b, GRAD[norm])))(xs, ws)
    # Same gradient values; the rescaled one has unit-norm data.
    np.testing.assert_allclose(
        np.asarray(rescaled.to_array(jnp.float32)), np.asarray(plain.to_array(jnp.float32)), rtol=1e-3
    )
    assert 1.0 <= _norm(rescaled.data, norm) < 2.0
    if norm != "max":  # a float16 product of two tensors already leaves at unit max-abs
        assert float(rescaled.scale) != float(plain.scale)
    want = w.astype(np.float32) * 2.0**-20
    np.testing.assert_allclose(np.asarray(rescaled.to_array(jnp.float32)), want, rtol=1e-3)
    # The forward pass is untouched.
    fwd_plain = S(lambda a, b: a * b)(xs, ws)
    fwd = S(lambda a, b: GRAD[norm](a) * b)(xs, ws)
    np.testing.assert_array_equal(fwd.data, fwd_plain.data)
    np.testing.assert_array_equal(fwd.scale, fwd_plain.scale)


@requires(lax.mul_p, lax.reduce_sum_p, lax.broadcast_in_dim_p)
def test_grad_variant_unscaled_cotangent_becomes_scaled():
    x = jnp.asarray(data((16,), seed=11))
    g = S(jax.grad(lambda a: jnp.sum(dynamic_rescale_l2_grad(a) * 1e-6)))(x)
    assert isinstance(g, ScaledArray)
    assert 1.0 <= _norm(g.data, "l2") < 2.0
    assert_close(g.to_array(), np.full((16,), 1e-6, np.float32))


def test_grad_variant_jaxpr_has_rescale_in_backward_only():
    f = lambda a: jnp.sum(dynamic_rescale_l1_grad(a) * 2.0)
    jaxpr = jax.make_jaxpr(jax.grad(f))(jnp.ones((3,)))
    names = [e.primitive.name for e in jaxpr.eqns]
    assert "dynamic_rescale" in names and "dynamic_rescale_grad" not in names
    assert "dynamic_rescale_grad" in [e.primitive.name for e in jax.make_jaxpr(f)(jnp.ones((3,))).eqns]


# -- delayed rescaling ---------------------------------------------------------------------
def test_delayed_scaling_init():
    state = delayed_scaling_init(4, scale=2.0**-3)
    assert isinstance(state, DelayedScalingState)
    assert state.amax_history.shape == (4,) and float(state.scale) == 2.0**-3
    with pytest.raises(ValueError):
        delayed_scaling_init(0)
    with pytest.raises(ScaleError, match="power of two"):
        delayed_scaling_init(4, scale=3.0)


def test_delayed_rescale_outside_updates_state():
    state = delayed_scaling_init(3)
    xs = [data((8,), seed=s, scale=m) for s, m in [(0, 10.0), (1, 1000.0), (2, 0.1), (3, 0.1), (4, 0.1)]]
    amaxes = []
    for i, x in enumerate(xs):
        y, new = delayed_rescale(jnp.asarray(x), state, target=4.0, margin=1)
        np.testing.assert_array_equal(y, x)
        amaxes.insert(0, np.max(np.abs(x)))
        hist = (amaxes + [0.0] * 3)[:3]
        np.testing.assert_allclose(new.amax_history, hist, rtol=1e-7)
        want = 2.0 ** np.ceil(np.log2(max(hist) / 4.0)) * 2.0
        assert float(new.scale) == want, (i, float(new.scale), want)
        state = new


def test_delayed_rescale_inside_uses_previous_scale():
    state = delayed_scaling_init(2)

    @jax.jit
    @S
    def step(x, st):
        return delayed_rescale(x, st)

    scales = []
    for seed, mult in [(0, 100.0), (1, 100.0), (2, 1.0)]:
        x = data((16,), seed=seed, scale=mult)
        y, new = step(scaled_array(x, 2.0**-5), state)
        assert isinstance(y, ScaledArray) and not isinstance(new.scale, ScaledArray)
        assert float(y.scale) == float(state.scale)  # the scale chosen at the previous step
        np.testing.assert_array_equal(y.to_array(), x * 2.0**-5)
        scales.append(float(y.scale))
        state = new
    assert scales[0] == 1.0 and scales[1] == scales[2] > 1.0  # history of 2 keeps the peak
    # data of the last step has max-abs below the target (round up)
    assert np.max(np.abs(np.asarray(y.data))) <= 1.0


def test_delayed_rescale_zero_history_keeps_scale():
    state = delayed_scaling_init(2, scale=2.0**4)
    y, new = S(delayed_rescale)(jnp.zeros((4,)), state)
    assert float(new.scale) == 2.0**4 and float(y.scale) == 2.0**4


@requires(lax.mul_p, lax.reduce_sum_p)
def test_delayed_rescale_gradient_is_identity():
    state = delayed_scaling_init(2, scale=2.0**-2)
    x = data((8,), seed=12)
    g = jax.grad(lambda a: jnp.sum(delayed_rescale(a, state)[0] * 3.0))(jnp.asarray(x))
    np.testing.assert_array_equal(g, np.full((8,), 3.0))
    g = S(jax.grad(lambda a: jnp.sum(delayed_rescale(a, state)[0] * 3.0)))(scaled_array(x, 2.0**-5))
    assert_close(np.asarray(g), np.full((8,), 3.0))


def test_delayed_rescale_rejects_scaled_state():
    state = delayed_scaling_init(2)
    bad = DelayedScalingState(state.amax_history, scalify.as_scaled_array(state.scale))
    with pytest.raises(ScaleError, match="plain arrays"):
        delayed_rescale(jnp.ones((2,)), bad)
