"""Scale rules of structural ops (scalify/rules/structural.py).

Model invariance: with float32 data and power-of-two scales != 1, `scalify(f)` equals `f` on
the materialised inputs (exactly: these ops do no rounding), including 0/inf/nan values and
non-scalar scales (per-row, per-column, per-element). Low precision: float16 data at scales
where the plain float16 values would overflow or underflow stays finite and accurate.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import scalify
from scalify import ScaledArray, scaled_array
from scalify.core.pow2 import is_pow2

SCALE_KINDS = ["scalar", "row", "col", "full"]


# -- helpers ------------------------------------------------------------------------------
def _scale(shape, kind, seed):
    rng = np.random.default_rng(seed + 100)
    if kind == "scalar":
        return 2.0 ** (-5 if seed % 2 else 7)
    sshape = {
        "row": (shape[0],) + (1,) * (len(shape) - 1),
        "col": (shape[-1],),
        "full": tuple(shape),
    }[kind]
    return 2.0 ** rng.integers(-8, 9, size=sshape).astype(np.float32)


def _data(shape, seed, special=True, dtype=np.float32):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if special and x.size >= 8:
        flat = x.reshape(-1)
        flat[[1, 3, 5, 7]] = [0.0, np.inf, -np.inf, np.nan]
    return x.astype(dtype)


def _scaled(shape, kind="scalar", seed=0, special=True, dtype=np.float32):
    return scaled_array(_data(shape, seed, special, dtype), _scale(shape, kind, seed))


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, ScaledArray))


def _assert_invariant(f, *args, rtol=0.0):
    """scalify(f)(*args) == f(*materialised args); every scale is a power of two."""
    out = scalify.scalify(f)(*args)
    ref = f(*scalify.asarray(args))
    out_l, ref_l = _leaves(out), _leaves(ref)
    assert len(out_l) == len(ref_l)
    for o, r in zip(out_l, ref_l):
        if isinstance(o, ScaledArray):
            assert is_pow2(np.asarray(o.scale)).all(), o.scale
            o = o.to_array(jnp.float32)
        o, r = np.asarray(o), np.asarray(r)
        assert o.shape == r.shape
        if np.issubdtype(r.dtype, np.floating):
            np.testing.assert_allclose(o.astype(np.float32), r.astype(np.float32), rtol=rtol, atol=0)
        else:
            np.testing.assert_array_equal(o, r)
    return out


IDX = np.array([1, -1, 0, -4, 2])
OOB = np.array([1, 9, -9, -1])

# One-input ops on x: f32[4, 6].
UNARY = {
    "reshape_merge": lambda x: x.reshape(3, 8),
    "reshape_split": lambda x: x.reshape(4, 2, 3),
    "reshape_ones": lambda x: x.reshape(1, 4, 1, 6, 1),
    "ravel": lambda x: x.ravel(),
    "expand_dims": lambda x: jnp.expand_dims(x, 1),
    "broadcast_to": lambda x: jnp.broadcast_to(x, (3, 4, 6)),
    "repeat": lambda x: jnp.repeat(x, 2, axis=0),
    "transpose": lambda x: x.T,
    "squeeze": lambda x: lax.squeeze(x[:, None], (1,)),
    "rev": lambda x: lax.rev(x, (0, 1)),
    "slice": lambda x: x[1:4:2, 1:6:2],
    "index_neg": lambda x: x[-1],
    "gather_neg": lambda x: x[IDX],
    "gather_2d": lambda x: x[IDX[:2], IDX[2:4]],
    "gather_fill_value": lambda x: x.at[OOB].get(mode="fill", fill_value=3.0),
    "gather_fill_nan": lambda x: x.at[OOB].get(mode="fill"),
    "gather_clip": lambda x: x.at[OOB].get(mode="clip"),
    "tile": lambda x: jnp.tile(x, (2, 3)),
    "split": lambda x: tuple(lax.split(x, (1, 3, 2), axis=1)),
    "unstack": lambda x: tuple(jnp.unstack(x, axis=0)),
    "copy": lambda x: lax.copy_p.bind(x),
    "device_put": lambda x: jax.device_put(x),
    "sort": lambda x: lax.sort(x, dimension=1),
    "sort_dim0": lambda x: lax.sort(x, dimension=0),
    "argsort": lambda x: lax.sort((x, lax.broadcasted_iota(jnp.int32, x.shape, 1)), num_keys=1),
    "top_k": lambda x: lax.top_k(x, 3),
    "bitcast": lambda x: lax.bitcast_convert_type(x, jnp.int32),
    "pad_zero": lambda x: lax.pad(x, 0.0, [(1, 2, 1), (0, -1, 0)]),
    "pad_value": lambda x: lax.pad(x, 3.0, [(1, 2, 1), (2, 0, 0)]),
    "pad_neg_inf": lambda x: lax.pad(x, -jnp.inf, [(0, 1, 0), (1, 1, 1)]),
    "set_zero": lambda x: x.at[1:3].set(0.0),
    "add_const": lambda x: x.at[np.array([0, 0, -1])].add(2.5),
    "mul_const": lambda x: x.at[np.array([0, 0, -1])].multiply(4.0),
    "max_const": lambda x: x.at[np.array([0, 2])].max(0.5),
    "dus_self": lambda x: lax.dynamic_update_slice(x, x[:2, :3] * 8.0, (1, 2)),
    "concat_self": lambda x: jnp.concatenate([x, x[:2] * 4.0], axis=0),
    "stack_self": lambda x: jnp.stack([x, x * 0.25], axis=1),
}


@pytest.mark.parametrize("kind", SCALE_KINDS)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_invariance(name, kind):
    _assert_invariant(UNARY[name], _scaled((4, 6), kind, seed=len(name)))


@pytest.mark.parametrize("kind", SCALE_KINDS)
def test_approx_max_k(kind):
    # No special values: approx_max_k's NaN ordering on CPU is not what is tested here.
    _assert_invariant(lambda x: lax.approx_max_k(x, 2), _scaled((4, 6), kind, special=False))


@pytest.mark.parametrize("kind", SCALE_KINDS)
def test_dynamic_slice_and_update(kind):
    x = _scaled((5, 6), kind, seed=1)
    u = _scaled((2, 3), "scalar", seed=2)
    for idx in ([1, 2], [4, -3], [-7, 9]):  # the last two are clamped
        i = jnp.asarray(idx, jnp.int32)
        _assert_invariant(lambda x, i: lax.dynamic_slice(x, (i[0], i[1]), (2, 3)), x, i)
        _assert_invariant(lambda x, u, i: lax.dynamic_update_slice(x, u, (i[0], i[1])), x, u, i)


# Two-input ops: x: f32[4, 6] and y (shape per op), with different scales.
BINARY = {
    "concatenate": ((3, 6), lambda x, y: jnp.concatenate([x, y, x], axis=0)),
    "concatenate_ax1": ((4, 2), lambda x, y: jnp.concatenate([y, x], axis=1)),
    "stack": ((4, 6), lambda x, y: jnp.stack([x, y])),
    "scatter_set": ((2, 6), lambda x, y: x.at[np.array([3, -4])].set(y)),
    "scatter_set_unique": ((2, 6), lambda x, y: x.at[np.array([3, -4])].set(y, unique_indices=True)),
    "scatter_set_dup": ((2, 6), lambda x, y: x.at[np.array([2, 2])].set(y)),
    "scatter_set_oob": ((2, 6), lambda x, y: x.at[np.array([1, 7])].set(y, mode="drop")),
    "scatter_add": ((3, 6), lambda x, y: x.at[np.array([0, -1, 0])].add(y)),
    "scatter_sub": ((3, 6), lambda x, y: x.at[np.array([0, -1, 0])].subtract(y)),
    "scatter_mul": ((3, 6), lambda x, y: x.at[np.array([0, -1, 0])].multiply(y)),
    "scatter_max": ((3, 6), lambda x, y: x.at[np.array([0, -1, 0])].max(y)),
    "scatter_min": ((3, 6), lambda x, y: x.at[np.array([0, -1, 0])].min(y)),
    "sort_key_value": ((4, 6), lambda x, y: lax.sort((x, y), dimension=1, num_keys=1)),
    "sort_two_keys": ((4, 6), lambda x, y: lax.sort((jnp.round(x), y, x), dimension=1, num_keys=2)),
    "pad_scaled_value": ((), lambda x, y: lax.pad(x, y, [(1, 1, 0), (0, 2, 1)])),
}


@pytest.mark.parametrize(
    "xkind, ykind", [("scalar", "scalar"), ("scalar", "row"), ("row", "scalar"), ("col", "row"), ("full", "row")]
)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_invariance(name, xkind, ykind):
    yshape, f = BINARY[name]
    if yshape == ():
        ykind = "scalar"
    x = _scaled((4, 6), xkind, seed=3)
    y = _scaled(yshape, ykind, seed=4, special=len(yshape) > 0 and not name.startswith("sort"))
    _assert_invariant(f, x, y)


def _pool(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2), (1, 2, 2), "VALID")


@pytest.mark.parametrize("scaled_operand", [False, True])
@pytest.mark.parametrize("kind", SCALE_KINDS)
def test_max_pool_jvp_and_vjp(kind, scaled_operand):
    """select_and_gather_add (max-pool JVP) and select_and_scatter_add (its transpose)."""
    x = _scaled((2, 4, 6), kind, seed=12, special=False)
    if not scaled_operand:
        x = x.to_array()
    t = _scaled((2, 4, 6), kind, seed=13)
    ct = _scaled((2, 2, 3), kind, seed=14)
    _assert_invariant(lambda x, t: jax.jvp(_pool, (x,), (t,))[1], x, t)
    _assert_invariant(lambda x, ct: jax.vjp(_pool, x)[1](ct)[0], x, ct)


def test_sort_keys_on_data_with_nonscalar_scale():
    # Data in increasing order, scales in decreasing order: the values' order differs.
    x = scaled_array(np.array([[1.0, 1.5, 1.75, 2.0]], np.float32), np.array([8.0, 4.0, 2.0, 1.0], np.float32))
    out = scalify.scalify(lambda x: lax.sort(x, dimension=1))(x)
    np.testing.assert_array_equal(out.to_array(), [[2.0, 3.5, 6.0, 8.0]])


# -- the scale stays scalar / small ---------------------------------------------------------
# gather_fill_value and mul_const are documented to produce a per-element scale.
@pytest.mark.parametrize("name", sorted(set(UNARY) - {"gather_fill_value", "mul_const"}))
def test_scalar_scale_stays_scalar(name):
    out = scalify.scalify(UNARY[name])(_scaled((4, 6), "scalar", seed=5))
    for o in _leaves(out):
        if isinstance(o, ScaledArray):
            assert np.shape(o.scale) == ()


@pytest.mark.parametrize(
    "f, expected",
    [
        (lambda x: x.T, (1, 4)),
        (lambda x: x.reshape(4, 2, 3), (4, 1, 1)),
        (lambda x: x.reshape(1, 4, 1, 6, 1), (1, 4, 1, 1, 1)),
        (lambda x: jnp.broadcast_to(x, (3, 4, 6)), (1, 4, 1)),
        (lambda x: x[1:3, ::2], (2, 1)),
        (lambda x: lax.rev(x, (0, 1)), (4, 1)),
        (lambda x: jnp.tile(x, (2, 3)), (8, 1)),
        (lambda x: jnp.concatenate([x, x]), (8, 1)),
        (lambda x: lax.pad(x, 0.0, [(1, 1, 0), (0, 0, 0)]), (6, 1)),
    ],
)
def test_row_scale_stays_small(f, expected):
    x = _scaled((4, 6), "row", seed=6)
    out = _assert_invariant(f, x)
    assert np.shape(out.scale) == expected


def test_pad_zero_keeps_scale_and_data():
    x = _scaled((4, 6), "scalar", seed=7)
    out = scalify.scalify(lambda x: lax.pad(x, 0.0, [(1, 1, 0), (0, 0, 0)]))(x)
    assert float(out.scale) == float(x.scale)
    np.testing.assert_array_equal(np.asarray(out.data)[1:-1], np.asarray(x.data))


def test_concatenate_takes_largest_scale():
    x, y = _scaled((2, 3), seed=1), _scaled((2, 3), seed=2)  # scales 2^-5, 2^7
    out = scalify.scalify(lambda x, y: jnp.concatenate([x, y]))(x, y)
    assert float(out.scale) == 2.0**7


@pytest.mark.parametrize("jit", [False, True])
def test_concatenate_constants_next_to_per_row_scales_of_unrelated_shapes(jit):
    """0 and inf blocks ("any scale" constants) between operands with per-row scales (4, 1)
    and (2, 1), which do not broadcast together: equal to plain JAX."""
    x, y = _scaled((4, 3), "row", seed=3, special=False), _scaled((2, 3), "row", seed=4, special=False)

    def f(x, y):
        return jnp.concatenate([x, jnp.zeros((1, 3)), y, jnp.full((1, 3), -jnp.inf)])

    g = jax.jit(scalify.scalify(f)) if jit else scalify.scalify(f)
    np.testing.assert_array_equal(np.asarray(g(x, y).to_array()), f(x.to_array(), y.to_array()))


def test_gather_int_indices_stay_plain():
    x = _scaled((4, 6), "scalar", seed=8)
    vals, idx = scalify.scalify(lambda x: lax.top_k(x, 2))(x)
    assert isinstance(vals, ScaledArray) and not isinstance(idx, ScaledArray)
    assert idx.dtype == jnp.int32


def test_bitcast_reads_bits_of_value():
    x = scaled_array(np.array([1.0, -1.5], np.float32), 2.0**10)
    bits = scalify.scalify(lambda x: lax.bitcast_convert_type(x, jnp.uint32))(x)
    np.testing.assert_array_equal(bits, np.array([1024.0, -1536.0], np.float32).view(np.uint32))


def test_jnp_wrappers_with_jit():
    """jnp.sort/flip/pad/take wrap their lax op in a `jit`: needs the control-flow rules."""
    x = _scaled((4, 6), "row", seed=9)
    _assert_invariant(lambda x: jnp.sort(x, axis=0), x)
    _assert_invariant(lambda x: jnp.flip(x, 1), x)
    _assert_invariant(lambda x: jnp.pad(x, ((1, 0), (2, 1))), x)
    _assert_invariant(lambda x: jnp.take(x, OOB, axis=1, mode="fill", fill_value=-2.0), x)
    _assert_invariant(lambda x: jnp.take_along_axis(x, jnp.argsort(x, axis=1), axis=1), x)


# -- low precision --------------------------------------------------------------------------
LOW = {
    "transpose_reshape": lambda x, y: x.T.reshape(2, 3, 4),
    "concatenate": lambda x, y: jnp.concatenate([x, y]),
    "pad": lambda x, y: lax.pad(x, jnp.array(0, x.dtype), [(1, 1, 1), (0, 2, 0)]),
    "gather": lambda x, y: x[IDX],
    "scatter_add": lambda x, y: x.at[np.array([0, 2, 0, 3])].add(y),
    "dynamic_update_slice": lambda x, y: lax.dynamic_update_slice(x, y[:2, :3], (1, 2)),
    "sort": lambda x, y: lax.sort((x, y), dimension=1, num_keys=1),
}


@pytest.mark.parametrize("log2_scale", [20, -30])
@pytest.mark.parametrize("name", sorted(LOW))
def test_float16_out_of_range_values(name, log2_scale):
    """float16 data at 2^20 (overflows plain float16) or 2^-30 (underflows it)."""
    f = LOW[name]
    x = scaled_array(_data((4, 6), 10, special=False, dtype=np.float16), 2.0**log2_scale)
    y = scaled_array(_data((4, 6), 11, special=False, dtype=np.float16), 2.0 ** (log2_scale - 2))
    xs, ys = x.to_array(jnp.float32), y.to_array(jnp.float32)
    plain = f(xs.astype(jnp.float16), ys.astype(jnp.float16))
    plain = _leaves(plain)[0].astype(jnp.float32)
    ref = _leaves(f(xs, ys))[0]
    assert not np.allclose(plain, ref, rtol=1e-2, atol=0), "plain float16 was expected to fail"
    out = _leaves(scalify.scalify(f)(x, y))[0]
    assert out.dtype == jnp.float16 and np.isfinite(np.asarray(out.data, np.float32)).all()
    np.testing.assert_allclose(out.to_array(jnp.float32), ref, rtol=1e-3, atol=0)
