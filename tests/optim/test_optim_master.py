"""FP16 scaled master weights: `scaled_params` and `apply_updates` (round-to-nearest and
stochastic rounding)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scalify
import scalify.optim as so
from scalify import ScaledArray

PARAMS = {"w": jax.random.normal(jax.random.key(0), (32, 64)) * 3e-3, "b": jnp.zeros((64,)), "step": jnp.int32(3)}


def test_scaled_params_layout_and_bytes():
    p16 = so.scaled_params(PARAMS, jnp.float16)
    assert isinstance(p16["w"], ScaledArray) and p16["w"].data.dtype == jnp.float16
    assert not isinstance(p16["step"], ScaledArray)
    amax = float(jnp.max(jnp.abs(p16["w"].data.astype(jnp.float32))))
    assert 1.0 < amax <= 2.0  # unit-scale data: scalify's rules have the headroom above
    w = np.asarray(PARAMS["w"])
    np.testing.assert_allclose(np.asarray(p16["w"].to_array(jnp.float32)), w, rtol=2.0**-11, atol=np.abs(w).max() * 2.0**-25)
    assert so.bytes_per_parameter(p16, PARAMS) == pytest.approx(2.0, abs=0.01)
    assert so.bytes_per_parameter(PARAMS, PARAMS) == pytest.approx(4.0, abs=0.01)
    top = so.scaled_params(PARAMS, jnp.float16, margin=0)["w"]
    assert 32768 < float(jnp.max(jnp.abs(top.data.astype(jnp.float32)))) <= 65504


def test_apply_updates_plain_params_is_optax():
    u = jax.tree.map(lambda p: jnp.full(p.shape, 0.5, p.dtype) if p.ndim else None, PARAMS)
    ref = optax.apply_updates({k: v for k, v in PARAMS.items() if k != "step"}, {k: u[k] for k in ("w", "b")})
    out = so.apply_updates(PARAMS, u)
    for k in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(ref[k]))
    assert int(out["step"]) == 3


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_small_updates_kept_only_with_stochastic_rounding(rounding):
    """500 steps of an update of 1/8 of a float16 ulp at every weight: round-to-nearest
    rounds each one away, stochastic rounding keeps them on average."""
    w = jnp.linspace(1.0, 2.0, 4096, endpoint=False)  # scale 1, ulp 2^-10 everywhere
    p = {"w": so.scaled_params({"w": w}, jnp.float16)["w"]}
    u = {"w": jnp.full(w.shape, 2.0**-13)}

    @jax.jit
    def run(p, key):
        def body(i, p):
            return so.apply_updates(p, u, rounding=rounding, key=jax.random.fold_in(key, i))

        return jax.lax.fori_loop(0, 500, body, p)

    out = np.asarray(run(p, jax.random.key(0))["w"].to_array(jnp.float32), np.float64)
    drift = np.mean(out - np.asarray(w, np.float64))
    expected = 500 * 2.0**-13
    if rounding == "nearest":
        assert drift == 0.0
    else:
        assert drift == pytest.approx(expected, rel=0.05)


def test_apply_updates_rescales_on_growth():
    p = so.scaled_params({"w": jnp.ones((8,))}, jnp.float16)
    out = so.apply_updates(p, {"w": jnp.full((8,), 1e6)})["w"]
    np.testing.assert_allclose(np.asarray(out.to_array(jnp.float32)), 1e6 + 1, rtol=2.0**-11)
    assert 1.0 < float(jnp.max(out.data.astype(jnp.float32))) <= 2.0


def test_apply_updates_inside_scalify_matches_plain():
    p16 = so.scaled_params(PARAMS, jnp.float16)
    u = jax.tree.map(lambda p: 1e-4 * jnp.ones(p.shape) if jnp.issubdtype(p.dtype, jnp.floating) else None, PARAMS)
    key = jax.random.key(3)

    def f(p, u, key):
        return so.apply_updates(p, u, rounding="stochastic", key=key)

    plain = jax.jit(f)(p16, u, key)
    scaled = jax.jit(scalify.scalify(f))(p16, u, key)
    assert jax.tree.structure(plain) == jax.tree.structure(scaled)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(scaled)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_stochastic_rounding_needs_a_key():
    with pytest.raises(ValueError, match="PRNG key"):
        so.apply_updates(so.scaled_params({"w": jnp.ones(3)}), {"w": jnp.ones(3)}, rounding="stochastic")
