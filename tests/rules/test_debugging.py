"""jax.debug.print / jax.debug.callback inside scalify see the values, eager and under jit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalify

X = np.array([1.5, -3.0, 0.25], np.float32)


def _scaled():
    return scalify.as_scaled_array(X, scale=2.0**-4)  # data = X * 16


@pytest.mark.parametrize("jit", [False, True])
def test_debug_print_prints_the_value(jit, capfd):
    def f(a):
        jax.debug.print("a={a} b={b}", a=a * 2.0, b=a.sum())
        return a + 1.0

    g = scalify.scalify(f)
    out = (jax.jit(g) if jit else g)(_scaled())
    jax.effects_barrier()
    printed = capfd.readouterr().out
    assert f"a={X * 2} b={np.float32(X.sum())}" in printed
    np.testing.assert_array_equal(out.to_array(), X + 1)


@pytest.mark.parametrize("jit", [False, True])
def test_debug_callback_receives_the_value(jit):
    seen = []

    def f(a, n):
        jax.debug.callback(lambda v, k: seen.append((np.asarray(v), int(k))), a * 4.0, n)
        return a

    g = scalify.scalify(f)
    (jax.jit(g) if jit else g)(_scaled(), jnp.int32(7))
    jax.effects_barrier()
    assert len(seen) == 1
    np.testing.assert_array_equal(seen[0][0], X * 4)
    assert seen[0][1] == 7
