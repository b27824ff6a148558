"""The gather-transpose fold (`scalify.core.folds`): `x + scatter_add(0, i, u)` becomes
`scatter_add(x, i, u)` before interpretation.

The fold must give the gradient plain JAX gives (float32: equal; float16 data: within the
rounding of one addition), with repeated indices, eagerly and under jit, and must leave the
program alone where the zeros-scatter is used twice."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scalify
from scalify.core.folds import fold_zero_scatter_adds


def _ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _take_repeated(x, idx):
    return jnp.sum(jnp.sin(x)) + jnp.sum(jnp.take(x, idx, axis=1) ** 2)


def _inputs(scale, dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    logits = (jax.random.normal(k1, (4, 8, 50)) * scale).astype(dtype)
    labels = jax.random.randint(k2, (4, 8), 0, 50)
    return logits, labels


def test_cross_entropy_gradient_folds_the_zeros_scatter():
    logits, labels = _inputs(1.0)
    plain = jax.make_jaxpr(jax.grad(_ce))(logits, labels).jaxpr
    folded = fold_zero_scatter_adds(plain)
    full = lambda eqns, name: [  # noqa: E731
        e for e in eqns if e.primitive.name == name and e.outvars[0].aval.shape == (4, 8, 50)
    ]
    assert len(full(plain.eqns, "add_any")) == 1
    # the [4, 8, 50] cotangent: one scatter-add into the softmax part, no add_any left
    big = [e for e in folded if e.primitive is jax.lax.scatter_add_p]
    assert len(big) == 1 and big[0].outvars[0].aval.shape == (4, 8, 50)
    assert not full(folded, "add_any")
    zeros = [e for e in full(plain.eqns, "jit")]  # take_along_axis's transpose, zeros inside
    assert len(zeros) == 1 and zeros[0] not in folded


@pytest.mark.parametrize("scale", [2.0**-12, 1.0, 2.0**10])
@pytest.mark.parametrize("jit", [False, True])
def test_folded_gradients_equal_plain_float32(scale, jit):
    logits, labels = _inputs(scale)
    want = jax.grad(_ce)(logits, labels)
    f = scalify.scalify(jax.grad(_ce))
    f = jax.jit(f) if jit else f
    got = f(scalify.as_scaled_array(logits), labels).to_array()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("jit", [False, True])
def test_repeated_indices_fold_to_the_plain_gradient(jit):
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 6))
    idx = jnp.array([0, 2, 2, 5, 0, 0])  # duplicates: the updates add up
    want = jax.grad(_take_repeated)(x, idx)
    f = scalify.scalify(jax.grad(_take_repeated))
    f = jax.jit(f) if jit else f
    got = f(scalify.as_scaled_array(x), idx).to_array()
    # duplicates are summed in another order than plain's: within float32 rounding
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-7, atol=0)


def test_float16_cross_entropy_gradient_no_worse_than_plain():
    logits, labels = _inputs(4.0)
    exact = np.asarray(jax.grad(_ce)(logits, labels), np.float64)
    lo = logits.astype(jnp.float16)
    plain = np.asarray(jax.grad(_ce)(lo, labels), np.float64)
    got = scalify.scalify(jax.grad(_ce))(scalify.as_scaled_array(lo), labels).to_array()
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all()
    err = lambda g: np.abs(g - exact).max()  # noqa: E731
    # plain float16 flushes the smallest softmax terms; the scaled gradient keeps them
    assert err(got) <= err(plain) * 1.01


def test_a_zeros_scatter_used_twice_is_left_alone():
    from jax.extend.core.primitives import add_jaxvals_p  # autodiff's add_any

    def f(x, u, i, twice):
        s = jnp.zeros_like(x).at[i].add(u)
        y = add_jaxvals_p.bind(x, s)
        return (y, s) if twice else y

    args = (jnp.ones((5,)), jnp.ones((2,)), jnp.array([1, 3]))
    once = jax.make_jaxpr(lambda *a: f(*a, False))(*args).jaxpr
    twice = jax.make_jaxpr(lambda *a: f(*a, True))(*args).jaxpr
    assert len(fold_zero_scatter_adds(once)) < len(once.eqns)
    assert fold_zero_scatter_adds(twice) == list(twice.eqns)
