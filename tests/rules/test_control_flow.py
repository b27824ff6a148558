"""Control-flow and call rules: model invariance in float32, kept call options, derivatives."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import primitives as jprims

import scalify
from scalify import ScaledArray, scaled_array
from _jaxpr_testing import equations

S_LO, S_HI = 2.0**-5, 2.0**7


def _scaled(x, scale, dtype=np.float32):
    """ScaledArray of value x with a power-of-two scale (exact: data = x / scale)."""
    scale = np.asarray(scale, np.float32)
    return scaled_array((np.asarray(x, np.float64) / scale).astype(dtype), scale)


def _value(x):
    return np.asarray(x.to_array(np.float32) if isinstance(x, ScaledArray) else x)


def _plain(tree):
    return scalify.asarray(tree)


def _check(f, *args, rtol=1e-6, jit=False):
    """scalify(f)(*args) equals f on the values of args; returns the scalified output."""
    g = scalify.scalify(f)
    out = jax.jit(g)(*args) if jit else g(*args)
    ref = f(*_plain(args))
    out_leaves = jax.tree_util.tree_leaves(out, is_leaf=scalify.is_scaled_leaf)
    ref_leaves = jax.tree_util.tree_leaves(ref)
    assert len(out_leaves) == len(ref_leaves)
    for o, r in zip(out_leaves, ref_leaves):
        assert np.shape(_value(o)) == np.shape(r)
        np.testing.assert_allclose(_value(o), np.asarray(r), rtol=rtol, atol=0)
        if isinstance(o, ScaledArray):
            assert scalify.is_pow2(np.asarray(o.scale)).all()
    return out


def _find(f, *args, primitive):
    closed = jax.make_jaxpr(f)(*args)
    return [e for e in equations(closed) if e.primitive is primitive]


X = np.array([0.5, -1.25, 3.0, 0.0, 2.5, -0.75], np.float32)
XS = np.arange(1, 13, dtype=np.float32).reshape(4, 3) / 8 - 0.7


# ---------------------------------------------------------------------------------------
# jit
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [S_LO, S_HI])
@pytest.mark.parametrize("outer_jit", [False, True])
def test_nested_jit_is_kept_with_its_name(scale, outer_jit):
    @functools.partial(jax.jit, keep_unused=True, inline=False)
    def inner_fn(a, b):
        return a * b + a, b * 2

    def f(a, b):
        return jax.jit(lambda a, b: inner_fn(a, b)[0] - b)(a, b)

    a, b = _scaled(X, scale), _scaled(X[::-1].copy(), S_HI)
    out = _check(f, a, b, jit=outer_jit)
    assert isinstance(out, ScaledArray)
    (eqn,) = [e for e in _find(scalify.scalify(f), a, b, primitive=jprims.jit_p)
              if e.params["name"] == "inner_fn"]
    (plain,) = [e for e in jax.make_jaxpr(f)(X, X).eqns[0].params["jaxpr"].eqns
                if e.primitive is jprims.jit_p]
    assert eqn.params["keep_unused"] and eqn.params["inline"] == plain.params["inline"]


def test_jit_donation_goes_to_data_only():
    f = jax.jit(lambda a, b: a * b, donate_argnums=0)
    a, b = _scaled(X, S_LO), _scaled(X, S_HI)
    (eqn,) = _find(scalify.scalify(f), a, b, primitive=jprims.jit_p)
    # leaves: a.data, a.scale, b.data, b.scale
    assert eqn.params["donated_invars"] == (True, False, False, False)
    out = scalify.scalify(f)(_scaled(X, S_LO), b)
    np.testing.assert_array_equal(_value(out), X * X)


def test_jit_sharding_goes_to_data():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    f = jax.jit(lambda a: a * 2, in_shardings=sharding, out_shardings=sharding)
    a = _scaled(X, S_LO)
    _check(f, a)
    (eqn,) = _find(scalify.scalify(f), a, primitive=jprims.jit_p)
    assert eqn.params["in_shardings"][0] == sharding
    assert eqn.params["out_shardings"][0] == sharding


@pytest.mark.usefixtures("arguments_as_given")
def test_where_with_inf_literal_keeps_any_scale():
    """jnp.where is a jit named _where receiving a -inf literal: -inf must stay -inf and
    take the scale of the other branch (no NaN)."""
    f = lambda x: jnp.where(x > 0, x, -jnp.inf)
    out = _check(f, _scaled(X, S_HI))
    assert np.asarray(out.scale) == S_HI
    out = _check(lambda x: jax.nn.softmax(jnp.where(x > 0, x, -jnp.inf)), _scaled(X, S_LO))


def test_jit_cache_reuses_compiled_call(monkeypatch):
    from scalify.rules import control_flow

    made = []
    make_jit = control_flow._make_jit
    monkeypatch.setattr(control_flow, "_make_jit", lambda *a: made.append(1) or make_jit(*a))
    f = scalify.scalify(jax.jit(lambda a: a * 3.0))
    f(_scaled(X, S_LO))
    out = f(_scaled(X, S_HI))  # another scale value, same avals: the same jit
    assert len(made) == 1
    np.testing.assert_allclose(_value(out), X * 3.0, rtol=1e-6)


def test_jit_cache_is_bounded(monkeypatch):
    from scalify.core.lru import LRUCache
    from scalify.rules import control_flow

    assert control_flow._JIT_CACHE.maxsize <= 64
    monkeypatch.setattr(control_flow, "_JIT_CACHE", LRUCache(2))
    for n in range(4):
        scalify.scalify(jax.jit(lambda a, n=n: a * float(n + 1)))(_scaled(X[:2], S_LO))
    assert len(control_flow._JIT_CACHE) == 2


def test_closed_call():
    def g(a, b):
        return (a * b - a,)

    def f(a, b):
        closed = jax.make_jaxpr(g)(a, b)
        params = jprims.closed_call_p.get_bind_params(dict(call_jaxpr=closed))
        return jprims.closed_call_p.bind(a, b, **params)[0]

    a, b = _scaled(X, S_LO), _scaled(X + 1, S_HI)
    _check(f, a, b)
    assert _find(scalify.scalify(f), a, b, primitive=jprims.closed_call_p)


# ---------------------------------------------------------------------------------------
# scan, fori_loop, while_loop
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("outer_jit", [False, True])
def test_scan_carry_becomes_scaled(reverse, outer_jit):
    """Initial carry unscaled (0.0), made scaled by the body: promoted in the initial value.
    Scaled xs and ys; a const closed over."""
    w = _scaled(np.float32(1.5), S_HI)

    def f(xs, w):
        def body(c, x):
            c = c * w + x
            return c, jnp.tanh(c) * x
        return lax.scan(body, jnp.zeros(3), xs, reverse=reverse)

    carry, ys = _check(f, _scaled(XS, S_LO), w, jit=outer_jit)
    assert isinstance(carry, ScaledArray) and isinstance(ys, ScaledArray)
    assert ys.scale.shape == (4, 1)  # per-iteration scales broadcast to the stacked data


def test_scan_per_row_xs_scale_and_unroll():
    """xs with one scale per row (sliced per iteration) and a scalar-scaled carry."""
    xs = scaled_array(XS / np.float32([[2.0], [0.25], [8.0], [1.0]]),
                      np.float32([[2.0], [0.25], [8.0], [1.0]]))

    def f(xs, c0):
        return lax.scan(lambda c, x: (c + x * x, c * x), c0, xs, unroll=2)

    _check(f, xs, _scaled(np.ones(3, np.float32), S_LO))


@pytest.mark.parametrize("loop", ["scan", "while"])
@pytest.mark.parametrize("jit", [False, True])
def test_zeros_carry_next_to_inputs_with_unrelated_scale_shapes(loop, jit):
    """A zeros initial carry takes the largest scale of the loop's inputs: per-row scales
    of xs (4, 1) and of w (2, 1) do not broadcast against each other, and the reference is
    their largest value (the backward scan of Flax's bidirectional LSTM example met this)."""
    row = np.float32([[2.0], [0.25], [8.0], [2.0**-30]])
    xs = scaled_array(XS / row, row)
    w = scaled_array(np.float32([[0.5, -1.0, 0.75], [1.0, 2.0, -0.5]]), np.float32([[2.0**20], [0.5]]))

    if loop == "scan":
        def f(xs, w):
            return lax.scan(lambda c, x: (c + x * w[0], c), jnp.zeros(3, jnp.float32), xs)
    else:
        def f(xs, w):
            def body(state):
                i, c = state
                return i + 1, c + xs[i] * w[0]
            return lax.while_loop(lambda s: s[0] < 4, body, (0, jnp.zeros(3, jnp.float32)))

    _check(f, xs, w, jit=jit)

def test_scan_carry_scale_shape_widens():
    """The body makes the carry's scale per-column: the carried scale takes that shape."""
    col = scaled_array(np.ones((1, 3), np.float32), np.float32([[2.0, 0.5, 4.0]]))

    def f(c0, col):
        def body(c, _):
            return c * col[0], c
        return lax.scan(body, c0, None, length=3)

    carry, ys = _check(f, _scaled(np.array([1.0, 2.0, 3.0], np.float32), S_LO), col)
    assert np.shape(carry.scale) == (3,)
    assert ys.scale.shape == (3, 3)


def test_scan_ys_unscaled_and_int():
    def f(xs):
        def body(c, x):
            return (c[0] + 1, c[1] + x), (c[0], jnp.float32(2.0))
        return lax.scan(body, (0, jnp.zeros(3)), xs)

    _check(f, _scaled(XS, S_HI))


@pytest.mark.parametrize("static_bounds", [True, False])
def test_fori_loop(static_bounds):
    def f(x, n):
        n = 3 if static_bounds else n
        return lax.fori_loop(0, n, lambda i, c: c * x + jnp.float32(1.0), jnp.zeros_like(x))

    _check(f, _scaled(X, S_LO), 3, jit=not static_bounds)


def test_while_loop_scaled_carry_and_cond_on_scaled_value():
    def f(x):
        def cond(c):
            return jnp.max(jnp.abs(c[1])) < 100.0
        def body(c):
            return c[0] + 1, c[1] * 2.0 + x
        return lax.while_loop(cond, body, (0, x))

    _check(f, _scaled(X, S_HI))
    _check(f, _scaled(X, S_LO), jit=True)


# ---------------------------------------------------------------------------------------
# cond / switch
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("outer_jit", [False, True])
def test_switch_branches_differ_in_scaledness(index, outer_jit):
    per_row = scaled_array(np.ones((2, 3), np.float32), np.float32([[4.0], [0.5]]))

    def f(i, x, r):
        branches = [
            lambda x, r: (x * 2.0, x[0]),  # scalar scale, scaled
            lambda x, r: (jnp.ones((2, 3)), jnp.full(3, 7.0)),  # unscaled
            lambda x, r: (x * r, x[1] * 3.0),  # per-row scale
        ]
        return lax.switch(i, branches, x, r)

    out = _check(f, index, _scaled(XS[:2], S_HI), per_row, jit=outer_jit)
    assert isinstance(out[0], ScaledArray) and np.shape(out[0].scale) == (2, 1)
    assert isinstance(out[1], ScaledArray)


@pytest.mark.parametrize("pred", [True, False])
def test_cond(pred):
    def f(p, x):
        return lax.cond(p, lambda x: jnp.exp(x), lambda x: -x, x)

    _check(f, pred, _scaled(X, S_LO))


# ---------------------------------------------------------------------------------------
# checkpoint / remat
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("prevent_cse", [True, False])
def test_checkpoint_keeps_policy(prevent_cse):
    policy = jax.checkpoint_policies.nothing_saveable

    def f(x, y):
        return jax.checkpoint(lambda x: jnp.tanh(x * y) * x, policy=policy,
                              prevent_cse=prevent_cse)(x)

    args = _scaled(X, S_LO), _scaled(X + 1, S_HI)
    _check(f, *args)
    (eqn,) = _find(scalify.scalify(f), *args, primitive=jprims.remat_p)
    assert eqn.params["policy"] is policy
    assert eqn.params["prevent_cse"] == prevent_cse


# ---------------------------------------------------------------------------------------
# custom_jvp / custom_vjp: forward and jax.grad(scalify(f))
# ---------------------------------------------------------------------------------------
@jax.custom_jvp
def _triple(x):
    return x * 3.0


# Deliberately not the derivative of x*3: proves the custom rule is used.
_triple.defjvp(lambda primals, tangents: (_triple(primals[0]), tangents[0] * 7.0))


@jax.custom_vjp
def _mul_vjp(x, y):
    return x * y


_mul_vjp.defvjp(
    lambda x, y: (x * y, (x, y)),
    lambda res, g: (g * res[1] * 5.0, g * res[0] * 11.0),  # deliberately not x*y's
)


CUSTOM = {
    "relu": jax.nn.relu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_erf": functools.partial(jax.nn.gelu, approximate=False),
    "softplus": jax.nn.softplus,
    "silu": jax.nn.silu,
    "user_custom_jvp": lambda x: _triple(x) * x,
    "user_custom_vjp": lambda x: _mul_vjp(x, jnp.tanh(x)),
}


@pytest.mark.parametrize("name", sorted(CUSTOM))
@pytest.mark.parametrize("scale", [S_LO, S_HI])
def test_custom_derivatives_forward_and_grad_of_scalify(name, scale):
    fn = CUSTOM[name]
    x = X + np.float32(0.125)
    _check(fn, _scaled(x, scale))

    def loss_scalified(x):
        out = scalify.scalify(fn)(scalify.as_scaled_array(x, scale))
        return jnp.sum(_value_traced(out) * jnp.arange(1.0, 7.0))

    def loss(x):
        return jnp.sum(fn(x) * jnp.arange(1.0, 7.0))

    g = jax.grad(loss_scalified)(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(g), np.asarray(jax.grad(loss)(x)), rtol=1e-6, atol=0)


def _value_traced(x):
    return x.to_array() if isinstance(x, ScaledArray) else x


def test_custom_rules_are_really_used():
    x = jnp.asarray(X)
    g = jax.grad(lambda x: jnp.sum(_value_traced(
        scalify.scalify(_triple)(scalify.as_scaled_array(x, S_LO)))))(x)
    np.testing.assert_array_equal(np.asarray(g), 7.0)
    g = jax.grad(lambda x: jnp.sum(_value_traced(
        scalify.scalify(_mul_vjp)(scalify.as_scaled_array(x, S_LO), jnp.full(6, 2.0)))))(x)
    np.testing.assert_array_equal(np.asarray(g), 10.0)


def test_custom_vjp_grad_wrt_both_scaled_inputs_under_jit():
    def f(a, b):
        return jnp.sum(scalify.scalify(_mul_vjp)(a, b).to_array())

    a, b = _scaled(X, S_LO), _scaled(X + 2, S_HI)
    ga, gb = jax.jit(jax.grad(f, argnums=(0, 1)))(a, b)
    # d/d data = dL/dx * scale; the scale slot is 1 / scale so that the value is dL/dx
    gxa, gxb = (X + 2) * 5.0, X * 11.0
    np.testing.assert_allclose(np.asarray(ga.data), gxa * S_LO, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gb.data), gxb * S_HI, rtol=1e-6)
    assert float(ga.scale) == 1 / S_LO and float(gb.scale) == 1 / S_HI
    np.testing.assert_allclose(np.asarray(ga.to_array()), gxa, rtol=1e-6)


# ---------------------------------------------------------------------------------------
# scalify(jax.grad(f)) with control flow inside
# ---------------------------------------------------------------------------------------
def _loop_model(w, x):
    def body(c, xi):
        c = jax.checkpoint(lambda c: jnp.tanh(c * w + xi),
                           policy=jax.checkpoint_policies.nothing_saveable)(c)
        return c, c * xi
    c, ys = lax.scan(body, jnp.zeros(3), x)
    c = lax.cond(jnp.sum(c) > 0, lambda c: c * 2.0, lambda c: jnp.exp(c), c)
    return jnp.sum(c * c) + jnp.sum(ys)


def test_scalify_of_grad_with_scan_cond_checkpoint():
    g = jax.grad(_loop_model, argnums=(0, 1))
    w = _scaled(np.array([0.5, -1.0, 2.0], np.float32), S_HI)
    _check(g, w, _scaled(XS, S_LO), rtol=2e-6, jit=True)
    remats = _find(scalify.scalify(g), w, _scaled(XS, S_LO), primitive=jprims.remat_p)
    assert any(e.params["differentiated"] for e in remats)  # the backward recomputation
    assert all(e.params["policy"] is jax.checkpoint_policies.nothing_saveable for e in remats)


def test_grad_of_scalify_with_scan_cond_checkpoint():
    w, x = np.array([0.5, -1.0, 2.0], np.float32), XS

    def loss(w, x):
        return scalify.scalify(_loop_model)(scalify.as_scaled_array(w, S_HI),
                                            scalify.as_scaled_array(x, S_LO)).to_array()

    got = jax.grad(loss, argnums=(0, 1))(w, x)
    ref = jax.grad(_loop_model, argnums=(0, 1))(w, x)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6)


# ---------------------------------------------------------------------------------------
# Flax: nn.scan over layers + nn.remat
# ---------------------------------------------------------------------------------------
def test_flax_scan_over_layers_with_remat():
    nn = pytest.importorskip("flax.linen")

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.Dense(4)(x)
            return x + jax.nn.gelu(h), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            layers = nn.scan(nn.remat(Layer), variable_axes={"params": 0},
                             split_rngs={"params": True}, length=2)
            x, _ = layers()(x, None)
            return x

    model = Stack()
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    params = model.init(jax.random.PRNGKey(0), x)
    assert _find(model.apply, params, x, primitive=lax.scan_p)
    sparams = scalify.as_scaled_array(params, S_LO)
    _check(model.apply, sparams, _scaled(x, S_HI), rtol=2e-6, jit=True)

    def loss(p, x):
        return jnp.sum(model.apply(p, x) ** 2)

    _check(jax.grad(loss), sparams, _scaled(x, S_HI), rtol=2e-6, jit=True)


# ---------------------------------------------------------------------------------------
# Sharding constraint, optimization barrier
# ---------------------------------------------------------------------------------------
@pytest.mark.usefixtures("arguments_as_given")
def test_sharding_constraint_applies_to_data():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    f = lambda x: lax.with_sharding_constraint(x * 2.0, sharding)
    out = _check(f, _scaled(X, S_LO))
    assert out.scale == 2 * S_LO
    assert _find(scalify.scalify(f), _scaled(X, S_LO), primitive=jprims.sharding_constraint_p)


@pytest.mark.usefixtures("arguments_as_given")
def test_optimization_barrier_passes_scales_through():
    f = lambda x, i: lax.optimization_barrier((x * 2.0, i, jnp.float32(1.5)))
    out = _check(f, _scaled(X, S_HI), 3)
    assert out[0].scale == 2 * S_HI


# ---------------------------------------------------------------------------------------
# Low precision: the scale keeps float16 data in range through a loop
# ---------------------------------------------------------------------------------------
def test_scan_float16_extreme_scale():
    """Values ~2^-30 underflow float16 (smallest subnormal ~6e-8); the scale 2^-30 keeps
    the data near 1 through the loop and the cond."""
    tiny = 2.0**-30
    xs_val = (np.arange(1, 7, dtype=np.float32).reshape(3, 2) / 4) * tiny

    def f(xs):
        def body(c, x):
            c = lax.cond(jnp.float32(1.0) > 0, lambda c: c + x, lambda c: c, c)
            return c, c * 2.0
        return lax.scan(body, jnp.zeros(2, xs.dtype), xs)

    assert not np.asarray(f(jnp.asarray(xs_val, jnp.float16))[0]).any()  # plain fp16 underflows
    carry, ys = scalify.scalify(f)(_scaled(xs_val, tiny, dtype=np.float16))
    assert carry.dtype == jnp.float16
    ref_c, ref_ys = f(xs_val)
    np.testing.assert_allclose(_value(carry), ref_c, rtol=1e-3)
    np.testing.assert_allclose(_value(ys), ref_ys, rtol=1e-3)


# ---------------------------------------------------------------------------------------
# loop drift guard (ScalifyConfig.carry_drift_window)
# ---------------------------------------------------------------------------------------
@pytest.mark.usefixtures("arguments_as_given")
@pytest.mark.parametrize("loop", ["scan", "while"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_loop_drift_guard_keeps_mismatched_carries_finite(loop, dtype):
    """A carry whose data and scale disagree (data 2^-e at scale 2^e, value ~1) squared
    each iteration: the static rule doubles the mismatch per iteration (scale 2^2e, 2^4e,
    ...) until data underflows and the scale overflows. The guard rescales the carry to
    unit max-abs data whenever it leaves [2^-8, 2^8], and the result stays exact."""
    e = 12 if dtype == np.float32 else 6
    x = (np.linspace(0.5, 1.5, 8) ** (1 / 16)).astype(dtype)  # x^(2^4) in [0.5, 1.5]
    sx = scalify.scaled_array(x * dtype(2.0**-e), np.float32(2.0**e))

    def f(c):
        if loop == "scan":
            return lax.scan(lambda c, _: (c * c, None), c, None, length=4)[0]
        return lax.fori_loop(0, 4, lambda i, c: c * c, c)

    ref = x.astype(np.float64) ** 16
    out = scalify.scalify(f)(sx)
    value = np.asarray(out.to_array(np.float32), np.float64)
    np.testing.assert_allclose(value, ref, rtol=1e-5 if dtype == np.float32 else 2e-2)
    data = np.abs(np.asarray(out.data, np.float32))
    assert 2.0**-9 <= data.max() <= 2.0**9
    with scalify.ScalifyConfig(carry_drift_window=None, power_drift_window=None, input_drift_window=None):
        unguarded = np.asarray(scalify.scalify(f)(sx).to_array(np.float32))
    if dtype == np.float32:  # the guards are what keeps it exact
        assert not np.allclose(unguarded, ref, rtol=2e-2)
    else:  # a float16 product of two tensors is placed from its maximum, guards or not
        np.testing.assert_allclose(unguarded, ref, rtol=2e-2)


def test_drift_guard_leaves_unit_scaled_carries_alone():
    x = _scaled(X, S_HI)  # data ~ unit: inside the window, so nothing is rescaled
    f = lambda c: lax.scan(lambda c, _: (c * 0.5 + c, None), c, None, length=3)[0]  # noqa: E731
    out = scalify.scalify(f)(x)
    with scalify.ScalifyConfig(carry_drift_window=None):
        ref = scalify.scalify(f)(x)
    np.testing.assert_array_equal(np.asarray(out.data), np.asarray(ref.data))
    np.testing.assert_array_equal(np.asarray(out.scale), np.asarray(ref.scale))


def test_carry_drift_window_is_validated():
    with pytest.raises(ValueError, match="carry_drift_window"):
        scalify.ScalifyConfig(carry_drift_window=-1)


@pytest.mark.parametrize("jit", [False, True])
def test_polyval_from_a_zero_carry_at_scales_near_the_top_of_float32(jit):
    """`jnp.polyval` runs Horner's rule in a scan from a zero carry: the carry starts at the
    bottom scale (a zero has any scale), not at x's, whose square (2^128) left float32's
    range and flushed the leading coefficient (a finite wrong value before). x at 2^64:
    0.3 x^2 - 1.2 x + 0.5 is just below float32's max, equal to float64."""
    data = np.float32([1.25, -1.5, 0.75, 1.0])
    c = np.float32([0.3, -1.2, 0.5])
    x = scaled_array(data, np.float32(2.0**64))
    f = lambda x: jnp.polyval(c, x)  # noqa: E731
    out = (jax.jit(scalify.scalify(f)) if jit else scalify.scalify(f))(x)
    ref = np.polyval(c.astype(np.float64), data.astype(np.float64) * 2.0**64)
    np.testing.assert_allclose(np.asarray(out.to_array(np.float32), np.float64), ref, rtol=1e-6)
