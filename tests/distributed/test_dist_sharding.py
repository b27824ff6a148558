"""scalify keeps shardings: jit in/out_shardings, with_sharding_constraint and NamedSharding
inputs survive in the lowered and compiled programs; data are sharded, scales replicated."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import scalify
from scalify import ScaledArray
from scalify import distributed as D
from scalify.inspect import collective_bytes


def _data(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _scaled(x, scale):
    return scalify.scaled_array(x / scale, scale)


def _spec(sharding, ndim):
    """A sharding's spec, normalised to `ndim` entries."""
    return tuple((list(sharding.spec) + [None] * ndim)[:ndim])


def test_inner_jit_shardings_are_kept(mesh8):
    rows, cols = NamedSharding(mesh8, P("data")), NamedSharding(mesh8, P(None, "data"))
    inner = jax.jit(lambda x, w: jnp.tanh(x @ w) * 2.0, in_shardings=(rows, cols), out_shardings=rows)
    x, w = _data(0, (32, 16)), _data(1, (16, 8))
    ref = inner(x, w)
    f = jax.jit(scalify.scalify(inner))
    xs, ws = _scaled(x, 2.0**-5), _scaled(w, 2.0**7)
    out = f(xs, ws)
    np.testing.assert_allclose(np.asarray(out.to_array()), np.asarray(ref), rtol=1e-6, atol=1e-6)
    # The compiled program's shardings, read through the API: the HLO text prints them in a
    # format that changes with XLA (jax 0.10: "sharding={devices=[8,1]<=[8]}", jax 0.11:
    # "sharding={mesh['data'=8], [{'data'}, {}]}").
    compiled = f.lower(xs, ws).compile()
    (in_x, in_w), _ = compiled.input_shardings
    assert in_x.data.is_equivalent_to(rows, 2) and in_w.data.is_equivalent_to(cols, 2)
    assert compiled.output_shardings.data.is_equivalent_to(rows, 2)  # the rows sharding of the output
    assert in_x.scale.is_fully_replicated and compiled.output_shardings.scale.is_fully_replicated
    assert _spec(out.data.sharding, 2) == ("data", None)
    assert out.scale.sharding.is_fully_replicated


def test_sharding_constraint_is_kept(mesh8):
    def f(x):
        y = jax.lax.with_sharding_constraint(x * 3.0, NamedSharding(mesh8, P(None, "data")))
        return jnp.sum(y, axis=0)

    x = _data(2, (16, 32))
    g = jax.jit(scalify.scalify(f))
    xs = _scaled(x, 2.0**7)
    lowered = g.lower(xs).as_text()
    shardy = "sdy.sharding_constraint" in lowered and '[{}, {"data"}]' in lowered
    gspmd = "@Sharding" in lowered and "devices=[1,8]" in lowered
    assert shardy or gspmd
    out = g(xs)
    np.testing.assert_allclose(np.asarray(out.to_array()), np.asarray(jax.jit(f)(x)), rtol=1e-6)


def test_outer_jit_shardings_of_scaled_pytrees(mesh8):
    """jit(scalify(f)) with FSDP in/out shardings of a ScaledArray pytree: the compiled
    program takes and returns the data sharded and the scales replicated."""
    params = {"w": _scaled(_data(3, (64, 16)), 2.0**-5), "b": _scaled(_data(4, (16,)), 2.0**7)}
    sh = D.fsdp_shardings(params, mesh8, min_size=64)
    assert _spec(sh["w"].data, 2) == ("data", None) and sh["b"].data.spec == P()

    def update(p, x):
        g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(p)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g)

    x = _data(5, (32, 64))
    step = jax.jit(scalify.scalify(update), in_shardings=(sh, NamedSharding(mesh8, P("data"))),
                   out_shardings=sh)
    placed = jax.device_put(params, sh)
    compiled = step.lower(placed, x).compile()
    in_sh, _ = compiled.input_shardings
    out_sh = compiled.output_shardings
    for tree in (in_sh[0], out_sh):
        assert _spec(tree["w"].data, 2) == ("data", None)
        assert tree["w"].scale.is_fully_replicated and tree["b"].scale.is_fully_replicated
    new = step(placed, x)
    assert isinstance(new["w"], ScaledArray) and _spec(new["w"].data.sharding, 2) == ("data", None)
    ref = jax.jit(update)(scalify.asarray(params), x)
    for k in ("w", "b"):
        np.testing.assert_allclose(np.asarray(new[k].to_array()), np.asarray(ref[k]), rtol=1e-5, atol=1e-6)
    stats = collective_bytes(compiled)
    assert stats["count"] > 0  # XLA gathers the sharded weight and reduces its gradient
