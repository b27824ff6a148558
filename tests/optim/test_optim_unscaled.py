"""`scalify.optim.unscaled`: the optimizer on unscaled float32 values inside `scalify`.

The wrapped optax transformation must give the values plain optax gives on the
materialised gradients and params (float32 gradients, float16 master weights as in the
FP16/FP8 recipes), whatever their scales (2^-40 to 2^40), keep a plain float32 state, and
leave no scale guard in the compiled step (the reason it exists).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scalify
import scalify.optim as so
from scalify import ScaledArray

SHAPES = {"w": (16, 32), "b": (32,), "emb": (8, 16)}
EXPONENTS = {"w": -40, "b": 0, "emb": 40}


def _tx():
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))


def _grads(key, exponents):
    """float32 ScaledArray leaves whose data sit 2^-e away from unit, at scale 2^e."""
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        e = exponents[name]
        value = jax.random.normal(jax.random.key(key + i), shape)
        out[name] = ScaledArray(value * 2.0**-e, jnp.asarray(2.0**e, jnp.float32))
    return out


def _params(exponents):
    """float16 master weights (unit data at scale 2^e), as the FP16/FP8 recipes hold them."""
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        value = jax.random.normal(jax.random.key(100 + i), shape).astype(jnp.float16)
        out[name] = ScaledArray(value, jnp.asarray(2.0 ** exponents[name], jnp.float32))
    return out


def _values(tree):
    return scalify.asarray(tree, jnp.float32)


def _step(tx):
    def step(grads, state, params):
        return tx.update(grads, state, params)

    return step


def _inside_and_outside(tx, grads, params, jit, steps=3):
    """`steps` updates of `tx` inside scalify (jitted or eager) and the same outside (plain
    JAX): ([(updates, reference updates)] per step, final state, final reference state)."""
    state = ref_state = tx.init(params)
    step = scalify.scalify(_step(tx))
    step = jax.jit(step) if jit else step
    updates = []
    for _ in range(steps):
        ours, state = step(grads, state, params)
        theirs, ref_state = _step(tx)(grads, ref_state, params)
        updates.append((ours, theirs))
    return updates, state, ref_state


def _scaled_leaves(tree):
    """[(last key of its path, leaf)] of the ScaledArray leaves of `tree`."""
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, ScaledArray))
    return [(path[-1].key, x) for path, x in leaves if isinstance(x, ScaledArray)]


@pytest.mark.parametrize("jit", [False, True])
def test_unscaled_matches_plain_optax_on_the_values(jit):
    params, grads = _params({k: -e for k, e in EXPONENTS.items()}), _grads(10, EXPONENTS)
    tx = so.unscaled(_tx())
    state = tx.init(params)
    step = scalify.scalify(_step(tx))
    step = jax.jit(step) if jit else step
    plain = _step(_tx())
    ref_state = _tx().init(_values(params))
    for _ in range(3):
        updates, state = step(grads, state, params)
        ref_updates, ref_state = plain(_values(grads), ref_state, _values(params))
        for name in SHAPES:
            assert not isinstance(updates[name], ScaledArray)
            # float32 rounding order of the global-norm sum (one reduction in both)
            np.testing.assert_allclose(updates[name], ref_updates[name], rtol=1e-6, atol=0)
    leaves = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, ScaledArray))
    assert all(not isinstance(x, ScaledArray) for x in leaves)
    for a, b in zip(leaves, jax.tree_util.tree_leaves(ref_state)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)


def _reductions(compiled_text: str) -> int:
    return len(re.findall(r"\breduce\(", compiled_text))


def test_unscaled_step_compiles_without_scale_guards():
    """As many reductions as the plain step: the global norm's sums. The scaled optimizer
    adds its power guards before g * g. (The input guard of the step's float32 arguments,
    here the gradients, is off: in a training step they are computed inside.)"""
    params, grads = _params({k: 0 for k in SHAPES}), _grads(10, {k: 0 for k in SHAPES})
    with scalify.ScalifyConfig(input_drift_window=None):
        _check_reductions(params, grads)


def _check_reductions(params, grads):

    def compiled(tx, g, p):
        return jax.jit(scalify.scalify(_step(tx))).lower(g, tx.init(p), p).compile().as_text()

    plain_tx = _tx()
    values = _values(params)
    plain = jax.jit(_step(plain_tx)).lower(_values(grads), plain_tx.init(values), values)
    plain_reductions = _reductions(plain.compile().as_text())
    unscaled = _reductions(compiled(so.unscaled(_tx()), grads, params))
    # the scaled optimizer: moments as ScaledArrays, guarded at the input and before g * g
    scaled_tx = _tx()
    scaled_state = jax.tree_util.tree_map(
        lambda x: ScaledArray(x, jnp.ones((), jnp.float32)) if x.dtype == jnp.float32 and x.ndim else x,
        scaled_tx.init(values))
    scaled = jax.jit(scalify.scalify(_step(scaled_tx))).lower(grads, scaled_state, params)
    scaled_reductions = _reductions(scaled.compile().as_text())
    assert unscaled == plain_reductions, (unscaled, plain_reductions)
    assert scaled_reductions > plain_reductions, (scaled_reductions, plain_reductions)


def test_unscaled_outside_scalify():
    params, grads = _params(EXPONENTS), _grads(10, EXPONENTS)
    tx = so.unscaled(_tx())
    updates, _ = tx.update(grads, tx.init(params), params)
    ref, _ = _tx().update(_values(grads), _tx().init(_values(params)), _values(params))
    for name in SHAPES:
        np.testing.assert_allclose(updates[name], ref[name], rtol=1e-6, atol=0)
    # plain float leaves pass through as float32 values
    plain_updates, _ = tx.update(_values(grads), tx.init(_values(params)), _values(params))
    for name in SHAPES:
        np.testing.assert_allclose(plain_updates[name], ref[name], rtol=1e-6, atol=0)


def _fp16_state_tx(unscaled_values):
    return so.unscaled(so.scaled_state(_tx(), jnp.float16, unscaled_values=unscaled_values))


@pytest.mark.parametrize("jit", [False, True])
def test_unscaled_with_a_float16_stored_state_matches_the_same_optimizer_outside_scalify(jit):
    """`unscaled(scaled_state(..., unscaled_values=True))` (recipe #4's optimizer): the Adam
    moments stored as scaled FP16, decoded to plain float32 values for the update. The same
    updates and stored state as the same transformation outside scalify (plain JAX), at
    gradient scales 2^-40 to 2^40; the moments stay ScaledArray FP16."""
    params, grads = _params({k: -e for k, e in EXPONENTS.items()}), _grads(10, EXPONENTS)
    per_step, state, ref_state = _inside_and_outside(_fp16_state_tx(True), grads, params, jit)
    for updates, ref_updates in per_step:
        for name in SHAPES:
            assert not isinstance(updates[name], ScaledArray)
            np.testing.assert_allclose(updates[name], ref_updates[name], rtol=1e-6, atol=0)
    moments = [x for _, x in _scaled_leaves(state)]
    assert len(moments) == 2 * len(SHAPES) and all(m.data.dtype == jnp.float16 for m in moments)
    ref_moments = [x for _, x in _scaled_leaves(ref_state)]
    for a, b in zip(moments, ref_moments):
        np.testing.assert_allclose(a.to_array(jnp.float32), b.to_array(jnp.float32), rtol=1e-3, atol=0)


def test_unscaled_with_a_float16_stored_state_has_only_the_encode_reductions():
    """Plain float32 optimizer math: the plain step's reductions (the global norm) plus one
    max-reduction per stored moment (Adam's two moments of each leaf; the input guard of the
    step's arguments is off here, as for the gradients above); the scaled decode
    (unscaled_values=False) runs AdamW on scaled moments, with their scale arithmetic in
    the compiled step."""
    from scalify.inspect import hlo_instruction_count

    params, grads = _params({k: 0 for k in SHAPES}), _grads(10, {k: 0 for k in SHAPES})

    def compiled(tx, g, p, fn=scalify.scalify):
        return jax.jit(fn(_step(tx))).lower(g, tx.init(p), p).compile()

    with scalify.ScalifyConfig(input_drift_window=None):
        plain_tx = _tx()
        plain = compiled(plain_tx, _values(grads), _values(params), fn=lambda f: f)
        values = compiled(_fp16_state_tx(True), grads, params)
        scaled = compiled(_fp16_state_tx(False), grads, params)
    plain_reductions = _reductions(plain.as_text())
    assert _reductions(values.as_text()) == plain_reductions + 2 * len(SHAPES)
    assert hlo_instruction_count(values) < hlo_instruction_count(scaled)


@pytest.mark.parametrize("jit", [False, True])
def test_unscaled_with_a_stored_state_of_several_formats_matches_outside_scalify(jit):
    """A stored state whose leaves take different formats (a function of the leaf's path:
    float16, bfloat16, E4M3 with 2 binades of margin): inside scalify each format's scales
    are placed as one vector (`codecs.encode_scaled`), and every moment keeps its own format
    and the stored values of the same transformation outside scalify, at gradient scales
    2^-40 to 2^40. Tolerance: the moments are rounded to their format, whose half ulp is
    2^-11 (float16), 2^-8 (bfloat16) and 2^-4 (E4M3) relative; one rounding may land on
    the other side where the float32 update differs in its last bit."""
    formats = {"w": jnp.float16, "b": jnp.bfloat16, "emb": jnp.float8_e4m3fn}
    rtol = {"w": 2.0**-10, "b": 2.0**-7, "emb": 2.0**-3}

    def dtype(path, leaf):
        return formats[path[-1].key] if leaf.ndim else None

    tx = so.unscaled(so.scaled_state(_tx(), dtype, margin=2, unscaled_values=True))
    params, grads = _params({k: -e for k, e in EXPONENTS.items()}), _grads(20, EXPONENTS)
    _, state, ref_state = _inside_and_outside(tx, grads, params, jit)
    ours, theirs = _scaled_leaves(state), _scaled_leaves(ref_state)
    assert [n for n, _ in ours] == [n for n, _ in theirs] and len(ours) == 2 * len(SHAPES)
    for (name, a), (_, b) in zip(ours, theirs):
        assert a.data.dtype == formats[name], (name, a.data.dtype)
        np.testing.assert_allclose(a.to_array(jnp.float32), b.to_array(jnp.float32), rtol=rtol[name], atol=0)
