"""`scaled_state` / `quantized_state`: exactness, low-precision range, composition with
optax wrappers, scaled params, and the scalify interpreter."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scalify
import scalify.optim as so
from scalify import ScaledArray

PARAMS = {
    "w": jax.random.normal(jax.random.key(0), (16, 32)),
    "b": jnp.zeros((32,)),
    "emb": jax.random.normal(jax.random.key(1), (8, 16)),
}
GRADS = [
    jax.tree.map(lambda p, i=i: 1e-2 * jax.random.normal(jax.random.key(10 + i), p.shape), PARAMS)
    for i in range(4)
]
SCHEDULE = optax.linear_schedule(1e-2, 1e-3, 3)


def _trajectory(tx, params=PARAMS, grads=GRADS, jit=False):
    """Updates of 4 steps (params fixed). Eager by default: the small ops are compiled
    once per process and shared by all tests, which is cheaper than one jit per
    optimizer; `jit=True` for transformations with control flow (MultiSteps' cond)."""
    update = jax.jit(tx.update) if jit else tx.update
    state = tx.init(params)
    outs = []
    for g in grads:
        u, state = update(g, state, params)
        outs.append(u)
    return outs, state


def _assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _assert_trees_close(a, b, rtol=1e-6):
    """Equal up to float32 rounding: XLA may fuse (and contract to FMA) two different
    programs differently, so exact storage is checked to 1e-6 of each leaf's largest
    value, not bit for bit."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        y = np.asarray(y)
        np.testing.assert_allclose(np.asarray(x), y, rtol=0, atol=rtol * np.max(np.abs(y), initial=1e-30))


def _float_leaves(tree):
    return [x for x in jax.tree.leaves(tree, is_leaf=so.is_stored_leaf) if isinstance(x, ScaledArray)]


def test_scaled_state_float32_is_exact():
    """With float32 data and power-of-two scales storage is exact: same updates."""
    ref, _ = _trajectory(optax.adamw(SCHEDULE, weight_decay=0.1))
    out, state = _trajectory(so.scaled_state(optax.adamw(SCHEDULE, weight_decay=0.1), jnp.float32))
    _assert_trees_close(out, ref)
    assert len(_float_leaves(state)) == 6  # mu and nu of three params; count stays int


@pytest.mark.parametrize("dtype,rtol", [(jnp.float16, 4e-3), (jnp.bfloat16, 3e-2)])
def test_scaled_state_low_precision_close(dtype, rtol):
    ref, _ = _trajectory(optax.adamw(1e-2))
    out, state = _trajectory(so.scaled_state(optax.adamw(1e-2), dtype))
    _assert_trees_close(out, ref, rtol=rtol)
    for leaf in _float_leaves(state):
        assert leaf.data.dtype == jnp.dtype(dtype) and leaf.scale.dtype == jnp.float32
    assert state.inner[0].count.dtype == jnp.int32


@dataclasses.dataclass(frozen=True)
class _PlainCast:
    """Unscaled low-precision storage, to show what the scale buys."""

    dtype: object

    def encode(self, x, like=None):
        return x.astype(self.dtype)

    def decode(self, x):
        return x.astype(jnp.float32)


@pytest.mark.parametrize("log2_grad", [-40, 20])
def test_scaled_state_float16_at_extreme_gradient_scales(log2_grad):
    """Gradients of 2^-40 (v ~ 2^-80 underflows float16) or 2^20 (v ~ 2^40 overflows):
    the scaled FP16 state gives Adam's updates; plain float16 storage does not."""
    grads = [jax.tree.map(lambda g: g * 2.0 ** (log2_grad + 7), gs) for gs in GRADS]
    ref, _ = _trajectory(optax.adam(1e-2, eps=0.0), grads=grads)
    out, _ = _trajectory(so.scaled_state(optax.adam(1e-2, eps=0.0)), grads=grads)
    _assert_trees_close(out, ref, rtol=4e-3)
    naive, _ = _trajectory(so.quantized_state(optax.adam(1e-2, eps=0.0), _PlainCast(jnp.float16)), grads=grads)
    bad = [
        not np.allclose(np.asarray(x), np.asarray(y), rtol=0.1, atol=1e-4)
        for x, y in zip(jax.tree.leaves(naive), jax.tree.leaves(ref))
    ]
    assert any(bad)


def test_scaled_state_per_leaf_dtype_and_min_size():
    def dtype(path, leaf):
        names = {getattr(k, "name", None) for k in path}
        return jnp.float8_e4m3fn if "mu" in names else jnp.float16

    tx = so.scaled_state(optax.adam(1e-2), dtype, min_size=100)
    state = tx.init(PARAMS)
    adam = state.inner[0]
    assert adam.mu["w"].data.dtype == jnp.float8_e4m3fn and adam.nu["w"].data.dtype == jnp.float16
    assert not isinstance(adam.mu["b"], ScaledArray)  # 32 < min_size elements: kept as is


COMPOSITIONS = {
    "chain_clip_outside": lambda w: optax.chain(optax.clip_by_global_norm(0.05), w(optax.adamw(SCHEDULE))),
    "chain_clip_inside": lambda w: w(optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(SCHEDULE))),
    "inject_inside": lambda w: w(optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE, b1=0.8)),
    "inject_outside": lambda w: optax.inject_hyperparams(lambda learning_rate: w(optax.adamw(learning_rate)))(
        learning_rate=3e-3
    ),
    "multisteps_outside": lambda w: optax.MultiSteps(w(optax.adamw(1e-2)), 2),
    "multisteps_inside": lambda w: w(optax.MultiSteps(optax.adamw(1e-2), 2).gradient_transformation()),
    "masked": lambda w: optax.masked(w(optax.adamw(1e-2)), {"w": True, "b": False, "emb": True}),
    "multi_transform": lambda w: optax.multi_transform(
        {"a": w(optax.adamw(1e-2)), "s": optax.sgd(1e-1, momentum=0.9)}, {"w": "a", "b": "s", "emb": "a"}
    ),
}


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_composition_exact_in_float32(name):
    """Every composition gives the unwrapped optimizer's updates with float32 storage (to
    float32 rounding), and stores ScaledArray leaves in its state."""
    make = COMPOSITIONS[name]
    jit = name.startswith("multisteps")
    ref, _ = _trajectory(make(lambda t: t), jit=jit)
    out, state = _trajectory(make(lambda t: so.scaled_state(t, jnp.float32)), jit=jit)
    _assert_trees_close(out, ref)
    assert _float_leaves(state)


def test_inject_hyperparams_inside_stays_writable():
    tx = so.scaled_state(optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2))
    state = tx.init(PARAMS)
    hp = state.inner.hyperparams
    assert not isinstance(hp["learning_rate"], ScaledArray)  # scalars kept (min_size=2)
    hp["learning_rate"] = jnp.float32(0.0)
    u, _ = jax.jit(tx.update)(GRADS[0], state, PARAMS)
    assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(u))


def test_multi_transform_mixing_variants():
    """Route embeddings to float32 AdamW (as the 8-bit paper does) and the rest to 8-bit."""
    tx = optax.multi_transform(
        {"q": so.adamw_8bit(1e-2, min_size=2), "f": optax.adamw(1e-2)}, {"w": "q", "b": "q", "emb": "f"}
    )
    out, state = _trajectory(tx)
    ref, _ = _trajectory(optax.adamw(1e-2))
    _assert_trees_close(out[-1]["emb"], ref[-1]["emb"])
    np.testing.assert_allclose(np.asarray(out[-1]["w"]), np.asarray(ref[-1]["w"]), atol=1e-3)
    leaves = jax.tree.leaves(state, is_leaf=so.is_stored_leaf)
    assert sum(isinstance(x, so.BlockwiseArray) for x in leaves) == 4


def test_scaled_params_pass_through_update():
    """FP16 scaled master weights as `params` (weight decay reads their values)."""
    params16 = so.scaled_params(PARAMS, jnp.float16)
    out, _ = _trajectory(so.scaled_state(optax.adamw(1e-2, weight_decay=0.5), jnp.float32), params=params16)
    ref, _ = _trajectory(optax.adamw(1e-2, weight_decay=0.5), params=so.values(params16))
    _assert_trees_close(out, ref)


def test_update_inside_scalify():
    """`scalify(update)` sees the ScaledArray leaves as scaled inputs and returns the same
    state (bit for bit) and the same updates (to float32 rounding) as the plain update,
    with FP16 scaled master weights as params; `apply_updates` inside scalify too.
    ScaledArray leaves of two dtypes (FP8-LM: E4M3 m, FP16 v) and container leaves (COAT)
    in one optimizer, to compile once."""
    tx = optax.multi_transform(
        {"fp8lm": so.adamw_fp8lm(1e-2, weight_decay=0.1), "coat": so.adamw_coat(1e-2)},
        {"w": "fp8lm", "b": "fp8lm", "emb": "coat"},
    )
    params = so.scaled_params(PARAMS, jnp.float16)
    state = tx.init(params)

    def step(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return so.apply_updates(params, updates), updates, state

    plain, scaled = jax.jit(step), jax.jit(scalify.scalify(step))
    p1, s1, p2, s2 = params, state, params, state
    for g in GRADS[:3]:
        p1, u1, s1 = plain(g, s1, p1)
        p2, u2, s2 = scaled(g, s2, p2)
        assert jax.tree.structure(s1) == jax.tree.structure(s2)
        assert jax.tree.structure(p1) == jax.tree.structure(p2)
        _assert_trees_equal(s2, s1)
        np.testing.assert_allclose(
            np.concatenate([np.ravel(x) for x in jax.tree.leaves(so.values(u2))]),
            np.concatenate([np.ravel(x) for x in jax.tree.leaves(u1)]),
            rtol=1e-6,
            atol=1e-9,
        )
        p2 = jax.tree.map(lambda a, b: b, p2, p1)  # continue from identical params
