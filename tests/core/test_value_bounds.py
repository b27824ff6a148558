"""Static value bounds (`scalify.core.value_bounds`) and the gated products they place.

The analysis must never under-bound: every bound is checked against the values it bounds
on random inputs across float16's range. The product rule must place `x * gate` without a
max-reduction, and no worse than plain float16 anywhere plain float16 is finite."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalify
from scalify.core.value_bounds import pow2_ceil, value_bounds

GATES = {
    "gelu_tanh": jax.nn.gelu,
    "gelu_erf": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "sigmoid_gate": lambda x: x * jax.nn.sigmoid(x),
    "tanh_mix": lambda x: x * (0.25 * jnp.tanh(x) - 0.5 * jnp.cos(x) + 1.0),
}


def test_bounds_of_bounded_functions_and_their_maps():
    def f(x):
        t = jnp.tanh(x)
        return t, 1.0 + t, 0.5 * (1.0 + t), t * jnp.sin(x), jnp.concatenate([t, 3.0 * t]), x * t, jnp.exp(x)

    jp = jax.make_jaxpr(f)(jnp.ones((4,))).jaxpr
    b = value_bounds(jp)
    got = [b.get(v) for v in jp.outvars]
    assert got == [1.0, 2.0, 1.0, 1.0, 4.0, None, None]


@pytest.mark.parametrize("name", list(GATES))
def test_every_bound_holds_on_its_values(name):
    """Each bounded variable's values stay within its bound, for inputs from 2^-10 to 2^12
    (a jit's sub-jaxpr, such as `jax.nn.silu`'s, analysed on its own, as scalify does)."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal(4096) * 2.0 ** np.linspace(-10, 12, 4096), jnp.float32)
    env, bounds = {}, {}

    def run(j, args):
        bounds.update(value_bounds(j))
        for v, a in zip(j.invars, args):
            env[v] = a
        for eqn in j.eqns:
            ins = [v.val if hasattr(v, "val") else env[v] for v in eqn.invars]
            if eqn.primitive.name in ("jit", "pjit"):
                sub = eqn.params["jaxpr"]
                run(sub.jaxpr, list(sub.consts) + ins)
                outs = [env[v] for v in sub.jaxpr.outvars]
            else:
                outs = eqn.primitive.bind(*ins, **eqn.params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            for v, o in zip(eqn.outvars, outs):
                env[v] = o

    run(jax.make_jaxpr(GATES[name])(x).jaxpr, [x])
    assert bounds, "nothing bounded"
    for v, bound in bounds.items():
        assert float(jnp.max(jnp.abs(env[v]))) <= bound, (v, bound)


def test_pow2_ceil():
    assert [pow2_ceil(b) for b in (1.0, 1.5, 2.0, 0.3, 3.0)] == [1.0, 2.0, 2.0, 0.5, 4.0]


def _reduce_maxes(fn, x):
    return str(jax.make_jaxpr(scalify.scalify(fn))(x)).count("reduce_max")


@pytest.mark.parametrize("name", [n for n in GATES if n != "gelu_tanh"])
@pytest.mark.parametrize("log2_scale", [-20, 0, 12])
@pytest.mark.parametrize("jit", [False, True])
def test_gated_products_are_placed_without_measuring_and_match_plain(name, log2_scale, jit):
    """x * gate(x) in float16 data at scales 2^-20..2^12, data from 2^-6 to 2^6 (what a
    unit-scaled activation spans): finite, no worse than plain float16, and the forward pass has no max-reduction of
    the product."""
    f = GATES[name]
    rng = np.random.default_rng(1)
    data = (rng.standard_normal((64, 32)) * 2.0 ** rng.integers(-6, 6, (64, 32))).astype(np.float16)
    x = scalify.ScaledArray(jnp.asarray(data), jnp.float32(2.0 ** log2_scale))
    value = data.astype(np.float32) * 2.0 ** log2_scale
    ref = np.asarray(f(jnp.asarray(value, jnp.float32)), np.float64)
    with np.errstate(over="ignore"):
        plain = np.asarray(f(jnp.asarray(value.astype(np.float16))), np.float64)  # plain float16
    run = jax.jit(scalify.scalify(f)) if jit else scalify.scalify(f)
    got = np.asarray(run(x).to_array(jnp.float32), np.float64)
    assert np.all(np.isfinite(got))
    # no worse than plain float16 (twice its error, where cancellation in `1 + tanh` costs
    # both the same bits) plus two float16 roundings of the result
    plain_err = np.where(np.isfinite(plain), np.abs(plain - ref), np.inf)
    tol = 2 * plain_err + 2.0 ** -10 * np.abs(ref) + 2.0 ** (log2_scale - 24)
    assert np.all(np.abs(got - ref) <= tol), np.max(np.abs(got - ref) - tol)
    assert _reduce_maxes(f, x) == 0, str(jax.make_jaxpr(scalify.scalify(f))(x))


def test_tanh_gelu_gate_product_is_not_measured():
    """The tanh GELU's `x * 0.5 * (1 + tanh(...))`: one max-reduction is left, that of its
    `x ** 3` (a power of the unbounded input), none for the product."""
    x = scalify.as_scaled_array(jnp.linspace(-4.0, 4.0, 256, dtype=jnp.float16))
    assert _reduce_maxes(jax.nn.gelu, x) == 1


def _gelu_case(top):
    rng = np.random.default_rng(1)
    data = (rng.standard_normal((64, 32)) * 2.0 ** rng.integers(-6, top, (64, 32))).astype(np.float16)
    x = scalify.ScaledArray(jnp.asarray(data), jnp.float32(1.0))
    ref = np.asarray(jax.nn.gelu(jnp.asarray(data, jnp.float32)), np.float64)
    plain = np.asarray(jax.nn.gelu(jnp.asarray(data)), np.float64)
    got = np.asarray(scalify.scalify(jax.nn.gelu)(x).to_array(jnp.float32), np.float64)
    return np.abs(got - ref) <= 2 * np.abs(plain - ref) + 2.0 ** -10 * np.abs(ref)


def test_tanh_gelu_no_worse_than_plain_float16_on_inputs_spanning_12_binades():
    """Inputs from 2^-6 to 2^6: the cube `x**3` spans 36 binades; placed with its largest
    data at 2^8 (`scalify.rules.elementwise.POWER_TOP`) its sum with `x` keeps `x`'s bits."""
    assert np.all(_gelu_case(6))


@pytest.mark.xfail(strict=True, reason=(
    "The tanh GELU's x + 0.044715 * x**3 in float16 data on inputs spanning 20 binades: the "
    "sum spans more binades than float16 holds, and at the cube's scale the linear term of "
    "the elements far below the largest flushes, so GELU(x) becomes x / 2 there (plain "
    "float16 overflows the largest cubes to inf instead, which tanh saturates). "
    "scalify.nn.gelu computes the gate in float32 and has no such gap."))
def test_tanh_gelu_no_worse_than_plain_float16_on_inputs_spanning_20_binades():
    assert np.all(_gelu_case(14))
