"""FP16 scaled master weights: `scaled_params` and `apply_updates` (round-to-nearest and
stochastic rounding)."""
import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend.core import Var

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


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_apply_updates_inside_scalify_matches_plain(rounding):
    """Bit-equal inside and outside scalify; inside, the new scales' maxima in one variadic
    reduction per shape (no stacked copy of the leaves), none for the float16 conversion of
    data the scale already placed."""
    p16 = so.scaled_params(PARAMS, jnp.float16)
    u = jax.tree.map(lambda p: 1e-4 * jnp.ones(p.shape) if jnp.issubdtype(p.dtype, jnp.floating) else None, PARAMS)
    key = jax.random.key(3)

    def f(p, u, key):
        return so.apply_updates(p, u, rounding=rounding, key=key)

    plain = jax.jit(f)(p16, u, key)
    scaled = jax.jit(scalify.scalify(f))(p16, u, key)
    assert jax.tree.structure(plain) == jax.tree.structure(scaled)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(scaled)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with scalify.ScalifyConfig(input_drift_window=None):
        jaxpr = str(jax.make_jaxpr(scalify.scalify(f))(p16, u, key))
    shapes = {x.shape for x in jax.tree.leaves(u) if x is not None}
    assert jaxpr.count("reduce_max") == 0 and jaxpr.count(" reduce[") == len(shapes), jaxpr.count(" reduce[")


def test_stochastic_rounding_needs_a_key():
    with pytest.raises(ValueError, match="PRNG key"):
        so.apply_updates(so.scaled_params({"w": jnp.ones(3)}), {"w": jnp.ones(3)}, rounding="stochastic")


def test_adam_with_float16_moments_from_fp16_masters_keeps_small_gradients():
    """`optax.adam(...).init(fp16 masters)` makes float16 moments (optax follows the params'
    dtype). A gradient whose data sit far below its scale (a zero-in-exact-arithmetic
    gradient computed as a residue: data ~1e-5 at scale 2^-2, as for a bias before
    BatchNorm) gives Adam's `1e-3 * g^2` data far below float16's subnormals; the cast
    guard (`cast_drift_window`) keeps the second moment's history, so the scalified update
    equals float32 Adam's. Without it the stored moment is 0, and when the gradient drops
    the update grows to many times the learning rate."""
    tx = optax.adam(1e-3)
    params = so.scaled_params({"b": jnp.full((4,), 1e-3)}, jnp.float16)
    g = jnp.array([1e-6, -2e-6, 3e-6, 1e-5], jnp.float32)
    grads = [g, g, g, g * 1e-2]  # the last gradient drops: Adam's update leans on v's history

    def run(**config):
        # the gradients enter as they leave a backward pass, data not moved to unit
        with scalify.ScalifyConfig(input_drift_window=None, **config):
            step = jax.jit(scalify.scalify(lambda g, s, p: tx.update(g, s, p)))
            state = tx.init(params)
            assert state[0].nu["b"].dtype == jnp.float16
            for gi in grads:
                u, state = step({"b": ScaledArray(gi * 4, jnp.float32(0.25))}, state, params)
        return np.asarray(scalify.asarray(u["b"]), np.float32)

    ref_state = tx.init({"b": jnp.zeros(4, jnp.float32)})
    for gi in grads:
        ref, ref_state = tx.update({"b": gi}, ref_state)
    ref = np.abs(np.asarray(ref["b"]))
    np.testing.assert_allclose(np.abs(run()), ref, rtol=2e-3)
    assert np.all(np.abs(run(cast_drift_window=None)) > 3 * ref)


def test_scale_from_previous_is_new_when_the_binade_holds():
    """Updates that keep each tensor's largest weight in its binade: "previous" chooses the
    scale "new" chooses, so the encoded masters are bit-equal, in and outside scalify."""
    p16 = so.scaled_params(PARAMS, jnp.float16)
    w = PARAMS["w"]
    u = {"w": -1e-3 * w, "b": jnp.full((64,), 0.0), "step": None}  # |w| shrinks by 0.1%

    def f(p, u, scale_from):
        return so.apply_updates(p, u, scale_from=scale_from)

    for fn in (jax.jit(f, static_argnums=2), jax.jit(scalify.scalify(f), static_argnums=2)):
        new, prev = fn(p16, u, "new"), fn(p16, u, "previous")
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(prev)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _inputs_of(jaxpr, outvars) -> set:
    """The variables of `jaxpr` that `outvars` depend on, through its equations."""
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    seen, todo = set(), [v for v in outvars if isinstance(v, Var)]
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in producer:
            todo.extend(x for x in producer[v].invars if isinstance(x, Var))
    return seen


@pytest.mark.parametrize("growth", [2.0**-20, 0.5, 3.0, 2.0**14])
def test_scale_from_previous_keeps_the_previous_scale(growth):
    """The scale comes from the weights before the update: after an update that multiplies
    the largest weight by (1 + growth) the data max is (1 + growth) times the previous one
    (unit-scale data, at most 2: 2^14 of growth still fits float16's max, 65504), and the
    value equals "new"'s to float16 rounding. The one (variadic) reduction reads the stored
    masters, not the update."""
    p = so.scaled_params({"w": jnp.array([[2.0, -1.0], [0.5, 2.0**-10]])}, jnp.float16)
    u = {"w": jnp.array([[2.0 * growth, 0.0], [0.0, 0.0]])}
    prev = so.apply_updates(p, u, scale_from="previous")["w"]
    new = so.apply_updates(p, u, scale_from="new")["w"]
    assert float(prev.scale) == float(p["w"].scale)
    d0 = float(jnp.max(jnp.abs(p["w"].data.astype(jnp.float32))))
    assert float(jnp.max(jnp.abs(prev.data.astype(jnp.float32)))) == pytest.approx(d0 * (1 + growth), rel=2.0**-10)
    # atol: "new" flushes values 2^-24 below its maximum to float16 zero
    ref = np.asarray(new.to_array(jnp.float32))
    np.testing.assert_allclose(np.asarray(prev.to_array(jnp.float32)), ref, rtol=2.0**-10,
                               atol=np.abs(ref).max() * 2.0**-24)
    closed = jax.make_jaxpr(lambda p, u: so.apply_updates(p, u, scale_from="previous"))(p, u)
    (reduce,) = [e for e in closed.jaxpr.eqns if e.primitive.name in ("reduce", "reduce_max")]
    update_input = closed.jaxpr.invars[-1]  # u["w"]; the stored masters come first
    assert update_input not in _inputs_of(closed.jaxpr, reduce.invars)
    # It reads them in float16, outside scalify and inside: a float32 copy of a master
    # would be a value the step's other readers of it (the FP8 weight cast) could share,
    # which XLA then writes and holds to the reduction.
    inside = jax.make_jaxpr(scalify.scalify(lambda p, u: so.apply_updates(p, u, scale_from="previous")))(p, u)
    for jaxpr in (closed.jaxpr, inside.jaxpr):
        (reduce,) = [e for e in jaxpr.eqns if e.primitive.name in ("reduce", "reduce_max")]
        assert [v.aval.dtype for v in reduce.invars] == [jnp.float16, jnp.float16]  # operand, initial


def test_scale_from_previous_starts_zero_tensors_at_scale_one_and_adapts():
    """A zero-initialised matrix has no maximum: scale 1 for its first update, then the
    scale of that update's values on the next one."""
    p = so.scaled_params({"w": jnp.zeros((8, 8))}, jnp.float16)
    u = {"w": jnp.full((8, 8), 3e-3)}
    p1 = so.apply_updates(p, u, scale_from="previous")
    assert float(p1["w"].scale) == 1.0
    np.testing.assert_allclose(np.asarray(p1["w"].to_array(jnp.float32)), 3e-3, rtol=2.0**-11)
    p2 = so.apply_updates(p1, u, scale_from="previous")
    assert 1.0 < float(jnp.max(jnp.abs(p2["w"].data.astype(jnp.float32)))) <= 4.0
    np.testing.assert_allclose(np.asarray(p2["w"].to_array(jnp.float32)), 6e-3, rtol=2.0**-10)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("start", [0.0, 1e-6])
def test_scale_from_previous_places_vectors_from_their_new_value(start, jit):
    """A bias from zero, a layer-scale gain from 1e-6: one update of 3e-3 grows them by
    orders of magnitude. Vectors (and scalars) take their scale from the updated value,
    as "new" does: data in [1, 2) after every update, values "new"'s; a matrix at the
    same values keeps the previous scale (its data 3e-3 / 1e-6 ~ 2^11.6 away from unit)."""
    params = {"g": jnp.full((8,), start), "w": jnp.full((8, 8), start)}
    p = so.scaled_params(params, jnp.float16)
    u = {"g": jnp.full((8,), 3e-3), "w": jnp.full((8, 8), 3e-3)}
    fn = functools.partial(so.apply_updates, scale_from="previous")
    fn = jax.jit(fn) if jit else fn
    for _ in range(2):
        new = so.apply_updates(p, u, scale_from="new")
        p = fn(p, u)
        g = np.abs(np.asarray(p["g"].data, np.float32))
        assert 1.0 <= g.max() < 2.0
        np.testing.assert_array_equal(np.asarray(p["g"].to_array(jnp.float32)),
                                      np.asarray(new["g"].to_array(jnp.float32)))
    if start:  # the matrix, from 1e-6: its first update encoded at the previous scale
        w1 = fn(so.scaled_params(params, jnp.float16), u)["w"]
        assert np.abs(np.asarray(w1.data, np.float32)).max() > 2.0**10


def test_scale_from_is_checked():
    p = so.scaled_params({"w": jnp.ones(3)}, jnp.float16)
    with pytest.raises(ValueError, match="scale_from must be one of"):
        so.apply_updates(p, {"w": jnp.ones(3)}, scale_from="old")
    with pytest.raises(ValueError, match="headroom"):
        so.apply_updates(p, {"w": jnp.ones(3)}, scale_from="previous", margin=0)


def _value_and_scale(x):
    """Inside scalify: (value, scale) of a float32 leaf."""
    data, scale = scalify.get_data_scale(x)
    return data * scale, scale


@pytest.mark.parametrize("exp", [-40, -3, 0, 7, 40])
def test_float32_scale_from_previous_places_the_new_value_and_keeps_the_values(exp):
    """Float32 masters (scalified, scales 2^-40..2^40): the new value is optax's, bit for bit;
    its scale is the power of two of the largest weight before the update (data of that
    weight in [1, 2)), not the one the `add` rule gives `p + u`; outside scalify the
    option changes nothing. A vector (a bias at zero before its first update) takes the
    scale of its updated value."""
    w = PARAMS["w"] * np.float32(2.0**exp)
    params = {"w": w, "b": jnp.zeros((64,)), "step": jnp.int32(3)}
    u = {"w": -1e-3 * w + np.float32(2.0**exp * 1e-5), "b": jnp.full((64,), 2e-3, jnp.float32), "step": None}

    def f(p, u, mode):
        out = so.apply_updates(p, u, float32_scale_from=mode)
        return {k: _value_and_scale(out[k]) for k in ("w", "b")}

    sp = scalify.as_scaled_array(params)
    with scalify.ScalifyConfig(input_drift_window=None):  # keep the arguments' scales as given
        prev = jax.jit(scalify.scalify(f), static_argnums=2)(sp, u, "previous")
        add = jax.jit(scalify.scalify(f), static_argnums=2)(sp, u, None)
    ref = optax.apply_updates({k: params[k] for k in ("w", "b")}, {k: u[k] for k in ("w", "b")})
    for k in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(prev[k][0]), np.asarray(ref[k]))
        np.testing.assert_array_equal(np.asarray(add[k][0]), np.asarray(ref[k]))
    wmax = float(jnp.max(jnp.abs(w)))
    assert float(prev["w"][1]) == 2.0 ** np.floor(np.log2(wmax))
    assert float(prev["b"][1]) == 2.0 ** np.floor(np.log2(2e-3))  # a vector: from its new value
    outside = so.apply_updates(params, u, float32_scale_from="previous")
    for k in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(outside[k]), np.asarray(ref[k]))


def test_float32_scale_from_previous_is_one_reduction_per_shape_and_checked():
    """The maxima of the previous weights: one variadic reduction per shape (two same-shaped
    tensors, one reduce), none of the new values; their scales from one vector (the
    exponent arithmetic traced once for the three tensors)."""
    params = {"a": PARAMS["w"], "b": 2 * PARAMS["w"], "c": jnp.ones((5,))}
    u = jax.tree.map(lambda p: 1e-3 * jnp.ones_like(p), params)
    with scalify.ScalifyConfig(input_drift_window=None):
        jaxpr = str(jax.make_jaxpr(scalify.scalify(
            lambda p, u: so.apply_updates(p, u, float32_scale_from="previous")))(scalify.as_scaled_array(params), u))
    assert jaxpr.count("reduce_max") == 0 and jaxpr.count(" reduce[") == 2, jaxpr.count(" reduce[")
    assert jaxpr.count("shift_right_arithmetic") == 1, jaxpr.count("shift_right_arithmetic")
    with pytest.raises(ValueError, match="float32_scale_from"):
        so.apply_updates(params, u, float32_scale_from="new")


def test_float32_scale_from_previous_adds_the_unscaled_values():
    """Scaled float32 masters and scaled updates: each new value is one float32 add of the
    two unscaled values (exact as optax's), not the `add` rule of two differently scaled
    operands (its scale ratios: integer exponent arithmetic and clamps per leaf); the sum
    is then placed at the previous weights' scale by `at_scales`, whose plain-value
    placement is a multiply by 1/scale."""
    params = {"a": PARAMS["w"], "b": 2 * PARAMS["w"], "c": jnp.ones((5,))}
    u = jax.tree.map(lambda p: 1e-3 * jnp.ones_like(p), params)
    with scalify.ScalifyConfig(input_drift_window=None):
        jaxpr = jax.make_jaxpr(scalify.scalify(lambda p, u: so.apply_updates(p, u, float32_scale_from="previous")))(
            *scalify.as_scaled_array((params, u)))
    eqns = collections.Counter(e.primitive.name for e in jaxpr.jaxpr.eqns)
    # Three leaves' sums and `scale_for`'s one exponent add; no clamp of a scale ratio.
    assert eqns["add"] == 4 and eqns["clamp"] == 0, eqns


@pytest.mark.parametrize("exponent", [-100, -24, 0, 24, 100])
def test_scale_from_previous_takes_the_maximum_of_the_stored_value_at_any_scale(exponent):
    """The previous maximum is read from the stored float16 data times its power-of-two
    scale: the new scale is the one the float32 value's finite maximum gives, for scales
    across float32's range (an infinite element is left out), eagerly and under jit."""
    from scalify.optim.codecs import scale_for
    data = np.array([[1.5, -3.0], [np.inf, 2.0**-14]], np.float16)
    p = {"w": ScaledArray(jnp.asarray(data), jnp.float32(2.0**exponent))}
    u = {"w": jnp.zeros((2, 2), jnp.float32)}
    value = data.astype(np.float32) * np.float32(2.0**exponent)
    want = float(scale_for(np.max(np.abs(value[np.isfinite(value)])), jnp.float16, 15))
    for fn in (so.apply_updates, jax.jit(so.apply_updates, static_argnames="scale_from")):
        assert float(fn(p, u, scale_from="previous")["w"].scale) == want
