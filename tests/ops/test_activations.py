"""Activations with scale rules (scalify/ops/activations.py): relu, gelu (tanh/erf), silu.

Outside scalify: equal to jax.nn (values incl. special values, gradients, jit, vmap).
Inside: output keeps the input scale, values equal jax.nn in float32 to 1e-6 relative,
float16 data at extreme scales stays accurate, gradients through scalify both ways.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import scalify
from scalify import ScaledArray, scaled_array
from scalify.ops import gelu, relu, silu
from _ops_testing import assert_close, data, requires
from _jaxpr_testing import equations

S = scalify.scalify
ACTS = {
    "relu": (relu, jax.nn.relu),
    "silu": (silu, jax.nn.silu),
    "gelu_tanh": (gelu, jax.nn.gelu),
    "gelu_erf": (
        functools.partial(gelu, approximate=False),
        functools.partial(jax.nn.gelu, approximate=False),
    ),
}
NAMES = sorted(ACTS)
# gelu_tanh computes 1 + tanh(u) with u << 0: ill-conditioned, and XLA's fusion choices
# (eager vs jit, even in plain JAX) change it by a few float32 ulps of 1, i.e. |x| * 1e-7.
ATOL = {"gelu_tanh": 1e-6}
# Its derivative 0.5 (1 + tanh u) + 0.5 x (1 - tanh u)(1 + tanh u) u' amplifies one ulp of
# tanh near -1 (2^-24) by 0.5 |x| |u'| 2: at |x| = 8 (u' = 0.798 (1 + 3 * 0.0447 x^2) = 7.6)
# one ulp moves the gradient by 3.6e-6 around an exact value of ~1e-14, so compilers that
# evaluate tanh with other instructions (LLVM -O0 against -O1 on XLA:CPU) differ by ulps.
GRAD_ATOL = {"gelu_tanh": 8e-6}


def _grid():
    x = np.concatenate([np.linspace(-8, 8, 33), [0.0, -0.0, 1e-30, -1e-30, 50.0, -50.0]])
    return x.astype(np.float32)


@pytest.mark.parametrize("name", NAMES)
def test_equals_jax_nn_outside(name):
    act, ref = ACTS[name]
    x = np.concatenate([_grid(), [np.inf, -np.inf, np.nan]]).astype(np.float32)
    atol = ATOL.get(name, 0.0)
    assert_close(act(x), ref(x), rtol=1e-7, atol=atol)
    assert_close(jax.jit(act)(x), jax.jit(ref)(x), rtol=1e-7, atol=atol)
    assert_close(jax.vmap(act)(x.reshape(6, 7)), ref(x).reshape(6, 7), rtol=1e-7, atol=atol)


@pytest.mark.parametrize("name", NAMES)
def test_gradients_equal_jax_nn_outside(name):
    act, ref = ACTS[name]
    x = jnp.asarray(_grid())
    atol = GRAD_ATOL.get(name, 0.0)
    want = jax.grad(lambda a: jnp.sum(ref(a)))(x)
    assert_close(jax.grad(lambda a: jnp.sum(act(a)))(x), want, rtol=1e-6, atol=atol)
    assert_close(jax.vmap(jax.grad(act))(x), want, rtol=1e-6, atol=atol)
    assert_close(jax.jvp(act, (x,), (jnp.ones_like(x),))[1], want, rtol=1e-6, atol=atol)
    second = jax.grad(lambda a: jnp.sum(jax.grad(lambda b: jnp.sum(act(b)))(a)))(x[::4])
    want2 = jax.grad(lambda a: jnp.sum(jax.grad(lambda b: jnp.sum(ref(b)))(a)))(x[::4])
    assert_close(second, want2, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("scale", [2.0**-5, 2.0**7])
def test_inside_keeps_scale_and_matches(name, scale):
    act, ref = ACTS[name]
    x = data((4, 8), seed=1, special=True)
    xs = scaled_array(x, scale)
    out = S(act)(xs)
    assert isinstance(out, ScaledArray)
    assert float(out.scale) == scale
    atol = ATOL.get(name, 0.0) * scale
    assert_close(out.to_array(), ref(xs.to_array()), rtol=1e-6, atol=atol)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("scale", [2.0**-20, 2.0**20])
def test_float16_extreme_scales(name, scale):
    # Plain float16 underflows (2^-20) or overflows (2^20) these values; scaled data does not.
    act, ref = ACTS[name]
    x = data((256,), seed=2, dtype=np.float16)
    xs = scaled_array(x, scale, dtype=jnp.float16)
    out = S(act)(xs)
    assert out.dtype == jnp.float16 and float(out.scale) == scale
    want = np.asarray(ref(xs.to_array(jnp.float32)), np.float64)
    got = np.asarray(out.to_array(jnp.float32), np.float64)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.max(np.abs(want)))


@pytest.mark.parametrize("name", NAMES)
def test_per_row_scales(name):
    act, ref = ACTS[name]
    x = data((3, 5), seed=3)
    rows = (2.0 ** np.array([[-6.0], [0.0], [6.0]])).astype(np.float32)
    xs = scaled_array(x, rows)
    out = S(act)(xs)
    np.testing.assert_array_equal(out.scale, rows)
    assert_close(out.to_array(), ref(xs.to_array()), rtol=1e-6, atol=ATOL.get(name, 0.0) * 2**6)


@requires(lax.mul_p, lax.reduce_sum_p, lax.broadcast_in_dim_p)
@pytest.mark.parametrize("name", NAMES)
def test_scalify_of_grad(name):
    act, ref = ACTS[name]
    x = data((4, 8), seed=4)
    xs = scaled_array(x, 2.0**-5)
    w = scaled_array(data((4, 8), seed=5), 2.0**7)
    loss = lambda a, b, f: jnp.sum(f(a) * b)
    g = S(jax.grad(lambda a, b: loss(a, b, act)))(xs, w)
    want = jax.grad(lambda a, b: loss(a, b, ref))(xs.to_array(), w.to_array())
    assert isinstance(g, ScaledArray)
    assert float(g.scale) == 2.0**7  # the cotangent's scale, times a unit-scale derivative
    assert_close(g.to_array(), want, rtol=1e-6, atol=ATOL.get(name, 0.0) * 2**7)


@pytest.mark.parametrize("name", NAMES)
def test_grad_of_scalify(name):
    act, ref = ACTS[name]
    x = data((4, 8), seed=6)
    xs = scaled_array(x, 2.0**-5)
    g = jax.grad(lambda a: jnp.sum(S(act)(a).to_array()))(xs)
    want = jax.grad(lambda a: jnp.sum(ref(a)))(xs.to_array())
    atol = ATOL.get(name, 0.0) * 2.0**-5
    assert_close(g.data, want * 2.0**-5, rtol=1e-6, atol=atol)  # d value / d data = scale


def test_jit_and_vmap_inside_scalify():
    xs = scaled_array(data((3, 4), seed=7), 2.0**-5)
    for name, (act, ref) in ACTS.items():
        out = jax.jit(S(jax.vmap(act)))(xs)
        assert out.scale.shape == ()
        atol = ATOL.get(name, 0.0) * 2.0**-5
        assert_close(out.to_array(), ref(xs.to_array()), rtol=1e-6, atol=atol)


def test_integer_input_raises():
    for act, _ in ACTS.values():
        with pytest.raises(TypeError, match="floating-point"):
            act(jnp.arange(3))


def test_derivative_recomputes_from_the_16bit_data():
    """The derivative rule reads the float16 data through an optimization barrier, so XLA
    cannot share the forward rule's float32 materialisation with the backward pass (it then
    would store that float32 tensor)."""
    xs = scaled_array(data((4, 8), seed=8).astype(np.float16), 2.0**-5)
    f = S(jax.grad(lambda a: jnp.sum(gelu(a).astype(jnp.float32))))
    barriers = [e for e in equations(jax.make_jaxpr(f)(xs)) if e.primitive.name == "optimization_barrier"]
    dtypes = [v.aval.dtype for e in barriers for v in e.invars]
    assert jnp.float16 in dtypes
