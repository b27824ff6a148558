"""`custom_scale` (scalify/ops/custom_scale.py).

Outside scalify the function runs as written (eager, jit, grad, vmap, pytrees, static
arguments, closures). Inside, the rule runs on scaled inputs (data and scale checked), and
gradients work both as `scalify(jax.grad(f))` and `jax.grad(scalify(f))`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import scalify
from scalify import ScaledArray, ScalifyError, scaled_array
from scalify.ops import custom_scale, custom_scale_call_p, unit_rescale
from scalify.rules.common import materialize
from _ops_testing import assert_close, data, requires

S = scalify.scalify
RULE_CALLS = []


@custom_scale
def cube(x):
    return x * x * x


@cube.defscale
def _cube_rule(x: ScaledArray) -> ScaledArray:
    """x^3: scale s^3; data x.data^3."""
    RULE_CALLS.append(x.shape)
    return ScaledArray(x.data * x.data * x.data, x.scale**3)


@custom_scale
def mix(tree):
    """A pytree in, a pytree out, an integer argument inside."""
    return {"y": tree["a"] * jnp.tanh(tree["b"]), "n": tree["n"] + 1}


@mix.defscale
def _mix_rule(tree):
    a, b = tree["a"], tree["b"]
    y = ScaledArray((a.data * jnp.tanh(materialize(b))).astype(a.dtype), a.scale)
    return {"y": y, "n": tree["n"] + 1}


# -- outside scalify -------------------------------------------------------------------
def test_runs_as_written_outside():
    x = jnp.asarray(data((3, 4), special=True))
    assert_close(cube(x), x * x * x, rtol=0)
    assert_close(jax.jit(cube)(x), x * x * x, rtol=0)
    assert_close(jax.vmap(cube)(x), x * x * x, rtol=0)
    assert RULE_CALLS == []
    jaxpr = jax.make_jaxpr(cube)(x)
    assert [e.primitive for e in jaxpr.eqns] == [custom_scale_call_p]


def test_gradients_outside():
    x = jnp.asarray(data((3, 4)))
    g = jax.grad(lambda a: jnp.sum(jnp.sin(cube(a))))
    want = jnp.cos(x**3) * 3 * x**2
    assert_close(g(x), want, rtol=1e-6)
    assert_close(jax.jit(g)(x), want, rtol=1e-6)
    assert_close(jax.vmap(g)(x), want, rtol=1e-6)
    assert_close(jax.grad(jax.grad(lambda a: cube(a)))(2.0), 12.0)
    assert_close(jax.jvp(cube, (x,), (jnp.ones_like(x),))[1], 3 * x**2, rtol=1e-6)
    assert_close(jax.grad(lambda a: jnp.sum(jax.checkpoint(cube)(a)))(x), 3 * x**2, rtol=1e-6)


def test_pytrees_and_integers_outside():
    tree = {"a": jnp.ones((3,)), "b": jnp.arange(3.0), "n": jnp.arange(3)}
    out = jax.jit(mix)(tree)
    np.testing.assert_allclose(out["y"], jnp.tanh(jnp.arange(3.0)))
    np.testing.assert_array_equal(out["n"], jnp.arange(1, 4))
    g = jax.grad(lambda t: jnp.sum(mix(t)["y"]), allow_int=True)(tree)
    np.testing.assert_allclose(g["a"], jnp.tanh(jnp.arange(3.0)), rtol=1e-6)


def test_static_argnums():
    power = custom_scale(lambda x, n: x**n, static_argnums=1)
    power.defscale(lambda x, n: ScaledArray(x.data**n, x.scale**n))
    x = jnp.asarray(data((4,)))
    assert_close(power(x, 3), x**3)
    assert_close(jax.jit(power, static_argnums=1)(x, 2), x**2)
    xs = scaled_array(data((4,)), 2.0**-3)
    out = S(lambda a: power(a, 3))(xs)
    assert float(out.scale) == 2.0**-9
    assert_close(out.to_array(), xs.to_array() ** 3)
    out = power(xs, 2)  # eager on a ScaledArray: runs under scalify
    assert float(out.scale) == 2.0**-6
    with pytest.raises(TypeError, match="hashable"):
        power(x, [2])


def test_closure_over_traced_values():
    def f(x, w):
        return custom_scale(lambda a: a * w)(x)

    x = jnp.asarray(data((3,)))
    np.testing.assert_allclose(jax.jit(f)(x, 2.0), 2 * x)
    gx, gw = jax.grad(lambda a, w: jnp.sum(f(a, w)), argnums=(0, 1))(x, 3.0)
    np.testing.assert_allclose(gx, np.full((3,), 3.0))
    np.testing.assert_allclose(gw, jnp.sum(x), rtol=1e-6)


# -- inside scalify ----------------------------------------------------------------------
@pytest.mark.parametrize("scale", [2.0**-5, 2.0**7])
def test_rule_is_used_inside(scale):
    RULE_CALLS.clear()
    x = data((3, 4), special=True)
    xs = scaled_array(x, scale)
    out = S(cube)(xs)
    assert RULE_CALLS == [(3, 4)]
    assert float(out.scale) == scale**3
    assert_close(out.data, x * x * x, rtol=0)
    assert_close(out.to_array(), x.astype(np.float64) ** 3 * scale**3, rtol=1e-6)


def test_no_scaled_input_binds_as_is():
    RULE_CALLS.clear()
    x = jnp.asarray(data((3,)))
    np.testing.assert_array_equal(S(cube)(x), cube(x))
    assert RULE_CALLS == []


def test_pytree_rule_inside():
    tree = {
        "a": scaled_array(data((3,)), 2.0**-4),
        "b": scaled_array(data((3,), seed=1), 2.0**2),
        "n": jnp.arange(3),
    }
    out = S(mix)(tree)
    assert float(out["y"].scale) == 2.0**-4
    want = tree["a"].to_array() * jnp.tanh(tree["b"].to_array())
    assert_close(out["y"].to_array(), want)
    np.testing.assert_array_equal(out["n"], jnp.arange(1, 4))


def test_defscale_after_first_call():
    f = custom_scale(lambda x: x * 2.0)
    x = jnp.ones((2,))
    f(x)  # traced and cached before the rule exists
    f.defscale(lambda a: ScaledArray(a.data, a.scale * 2))
    out = S(f)(scaled_array(x, 2.0**-3))
    np.testing.assert_array_equal(out.data, x)
    assert float(out.scale) == 2.0**-2


@requires(lax.mul_p)
def test_no_rule_is_scalified_op_by_op():
    f = custom_scale(lambda x, y: x * y)
    xs, ys = scaled_array(data((3,)), 2.0**-3), scaled_array(data((3,), seed=1), 2.0**5)
    out = S(f)(xs, ys)
    assert float(out.scale) == 2.0**2
    assert_close(out.to_array(), xs.to_array() * ys.to_array())


def test_unscaled_float_arguments_are_promoted():
    seen = []
    f = custom_scale(lambda x, y: x + y)
    f.defscale(lambda x, y: seen.append((type(x), type(y))) or ScaledArray(x.data, x.scale))
    S(f)(scaled_array(np.ones(2, np.float32), 2.0), jnp.ones((2,)))
    assert seen == [(ScaledArray, ScaledArray)]


def test_jit_both_sides():
    x = data((3, 4))
    xs = scaled_array(x, 2.0**-5)
    out = jax.jit(S(cube))(xs)
    assert float(out.scale) == 2.0**-15
    assert_close(out.to_array(), np.asarray(xs.to_array(), np.float64) ** 3)


@requires(jax.extend.core.primitives.jit_p)
def test_scalify_of_jit():
    xs = scaled_array(data((3, 4)), 2.0**-5)
    out = S(jax.jit(cube))(xs)
    assert float(out.scale) == 2.0**-15


@requires(lax.mul_p, lax.reduce_sum_p, lax.broadcast_in_dim_p, lax.integer_pow_p, lax.sin_p, lax.cos_p)
def test_scalify_of_grad():
    x = data((3, 4))
    xs = scaled_array(x, 2.0**-5)
    f = lambda a: jnp.sum(jnp.sin(cube(a)))
    RULE_CALLS.clear()
    g = S(jax.grad(f))(xs)
    assert RULE_CALLS  # the forward used the scale rule
    v = xs.to_array()
    assert_close(np.asarray(g), jnp.cos(v**3) * 3 * v**2, rtol=1e-5)


def test_grad_of_scalify():
    x = data((3, 4))
    xs = scaled_array(x, 2.0**-5)
    g = jax.grad(lambda a: jnp.sum(S(cube)(a).to_array()))(xs)
    # d(value)/d(data) = 3 x^2 * s
    v = xs.to_array()
    assert_close(g.data, 3 * v**2 * 2.0**-5, rtol=1e-6)
    g = jax.jit(jax.grad(lambda a: jnp.sum(S(cube)(a).to_array())))(xs)
    assert_close(g.data, 3 * v**2 * 2.0**-5, rtol=1e-6)


def test_vmap_inside_scalify_vmaps_the_rule():
    # A rule whose output scale depends on the example gets a per-example scale.
    f = custom_scale(lambda x: x * 1.0)
    f.defscale(lambda x: unit_rescale(x, "max"))
    x = data((3, 8)) * np.array([[1e-3], [1.0], [1e3]], np.float32)
    out = S(jax.vmap(f))(scaled_array(x, 2.0**-5))
    assert out.scale.shape == (3, 1)
    for row in np.asarray(out.data):
        assert 1.0 <= np.max(np.abs(row)) < 2.0
    assert_close(out.to_array(), x * 2.0**-5)
    # A rule that keeps the scale keeps it unbatched.
    out = S(jax.vmap(cube))(scaled_array(data((3, 4)), 2.0**-2))
    assert out.scale.shape == ()


def test_vmap_with_unbatched_and_per_example_scaled_arguments():
    f = custom_scale(lambda x, y: x * y)
    f.defscale(lambda x, y: ScaledArray(x.data * y.data, x.scale * y.scale))
    x, y = data((4, 3)), data((3,), seed=1)
    rows = (2.0 ** np.arange(4.0).reshape(4, 1)).astype(np.float32)
    out = S(jax.vmap(f, in_axes=(0, None)))(scaled_array(x, rows), scaled_array(y, 2.0**-3))
    assert out.scale.shape == (4, 1)
    assert_close(out.to_array(), x * rows * y * 2.0**-3)


# -- errors ------------------------------------------------------------------------------
def test_wrong_rule_structure_raises():
    f = custom_scale(lambda x: (x, x))
    f.defscale(lambda x: x)
    with pytest.raises(ScalifyError, match="structure"):
        S(f)(scaled_array(np.ones(2, np.float32), 2.0))


def test_closure_with_rule_inside_scalify_raises():
    def g(x, w):
        f = custom_scale(lambda a: a * w)
        f.defscale(lambda a: a)
        return f(x)

    with pytest.raises(ScalifyError, match="closes over"):
        S(g)(scaled_array(np.ones(2, np.float32), 2.0), jnp.ones((2,)))


def test_keyword_arguments_raise():
    with pytest.raises(TypeError, match="positional"):
        cube(x=jnp.ones(2))


def test_partial_and_method_functions():
    import functools

    twice = custom_scale(functools.partial(jnp.multiply, 2.0))
    assert twice.__name__ == "partial"
    np.testing.assert_array_equal(twice(jnp.ones(2)), 2 * jnp.ones(2))

    class Layer:
        alpha = 3.0

        @functools.partial(custom_scale, static_argnums=0)  # self: hashable, static
        def __call__(self, x):
            return x * self.alpha

    np.testing.assert_array_equal(Layer()(jnp.ones(2)), 3 * jnp.ones(2))
