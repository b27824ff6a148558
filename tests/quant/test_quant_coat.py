import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from scalify.quant import (
    coat_dequantize,
    coat_expansion_exponent,
    coat_quantize,
    default_target_range,
    format_info,
)

E4M3 = jnp.float8_e4m3fn


def _groups(a, g):
    a = np.asarray(a, np.float64)
    n = a.shape[-1]
    pad = -n % g
    a = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    return a.reshape(*a.shape[:-1], -1, g)


def adam_moments(seed=0, shape=(128, 1024), steps=10):
    """Adam moments from a few optax.scale_by_adam steps on random gradients whose scale
    varies per row and column (heavy-tailed, like per-unit gradient magnitudes)."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.standard_normal((shape[0], 1))) * np.exp(rng.standard_normal((1, shape[1])))
    grads = (rng.standard_t(4, (steps, *shape)) * scale * 1e-3).astype(np.float32)
    tx = optax.scale_by_adam(b1=0.9, b2=0.999)
    params = jnp.zeros(shape, jnp.float32)

    @jax.jit
    def run(grads):
        def step(state, g):
            _, state = tx.update(g, state, params)
            return state, None

        state, _ = jax.lax.scan(step, tx.init(params), grads)
        return state.mu, state.nu

    m, v = run(grads)
    return np.asarray(m), np.asarray(v)


@pytest.mark.parametrize("expand", [True, False])
@pytest.mark.parametrize("shape, group_size", [((4, 256), 128), ((3, 2, 200), 64)], ids=str)
def test_shapes_and_round_trip(shape, group_size, expand):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape))).astype(np.float32)
    data, scale, k = coat_quantize(x, group_size, E4M3, expand)
    ng = -(-shape[-1] // group_size)
    assert data.shape == x.shape and data.dtype == jnp.dtype(E4M3)
    assert scale.shape == k.shape == shape[:-1] + (ng,)
    assert scale.dtype == k.dtype == jnp.float32
    y = np.asarray(coat_dequantize(data, scale, k, group_size))
    assert y.shape == x.shape and not np.isnan(y).any()
    assert np.linalg.norm(y - x) / np.linalg.norm(x) < 0.05
    if not expand:
        np.testing.assert_array_equal(np.asarray(k), 1.0)
        amax = np.abs(_groups(x, group_size)).max(-1)
        np.testing.assert_allclose(np.asarray(scale), amax / 448.0, rtol=1e-6)


def test_expansion_exponent_fills_target_range():
    x = np.random.default_rng(1).standard_normal((8, 128)).astype(np.float32)
    data, scale, k = coat_quantize(x)
    xg = np.abs(_groups(x, 128))
    amax, amin = xg.max(-1), np.where(xg > 0, xg, np.inf).min(-1)
    target = default_target_range(E4M3)
    assert target == 448.0**2 / 2
    np.testing.assert_allclose(np.log(amax / amin) * np.asarray(k), np.log(target), rtol=1e-5)
    d = np.abs(_groups(np.asarray(data).astype(np.float32), 128))
    np.testing.assert_array_equal(d.max(-1), 448.0)  # the group max maps to fmax
    # the group min maps to ~fmax / target = 2/448, rounded to the subnormal grid 2^-9
    np.testing.assert_allclose(np.where(d > 0, d, np.inf).min(-1), 2 / 448, atol=2.0**-10)


def test_relative_error_shrinks_by_k():
    """In FP8's normal range the relative error u = 2^-4 becomes ~u/k after |q|^(1/k)."""
    info = format_info(E4M3)
    x = np.random.default_rng(2).standard_normal((16, 128)).astype(np.float32)
    data, scale, k = coat_quantize(x)
    y = np.asarray(coat_dequantize(data, scale, k))
    q = np.abs(np.asarray(data).astype(np.float32))
    rel = np.abs(y - x) / np.abs(x)
    kk = np.repeat(np.asarray(k), 128, -1)
    normal = q >= info.min_normal
    bound = (1 + info.unit_roundoff) ** (1 / kk) - 1
    assert np.all(rel[normal] <= bound[normal] * 1.001 + 1e-6)


def test_zeros_constant_and_empty_groups():
    x = np.zeros((3, 128), np.float32)
    x[1] = 0.5  # single magnitude: no range to expand
    x[2, :64] = -2.0
    data, scale, k = coat_quantize(x)
    y = np.asarray(coat_dequantize(data, scale, k))
    assert not np.isnan(y).any()
    np.testing.assert_array_equal(y[0], 0.0)
    np.testing.assert_allclose(y[1:], x[1:], rtol=1e-6)
    assert float(k[0, 0]) == 1.0


def test_huge_range_compresses_without_underflow():
    x = np.array([[1e20, -1e-10, 3.0, 0.0]], np.float32)  # range 1e30 > target: k < 1
    data, scale, k = coat_quantize(x, group_size=4)
    kk = float(k[0, 0])
    assert 0.125 < kk < 1
    y = np.asarray(coat_dequantize(data, scale, k, group_size=4))
    assert y[0, 3] == 0 and np.all(np.sign(y[0, :3]) == np.sign(x[0, :3]))
    # relative error bound (1 + u)^(1/k) - 1, u = 2^-4 (sub-normal q: up to 2^-1)
    np.testing.assert_allclose(y[0, :3], x[0, :3], rtol=(1 + 2.0**-1) ** (1 / kk) - 1)


def test_errors():
    x = np.ones((1, 4), np.float32)
    data, scale, k = coat_quantize(x, group_size=4)
    with pytest.raises(ValueError, match="target_range"):
        coat_quantize(x, group_size=4, target_range=0.5)
    with pytest.raises(ValueError, match="as returned by coat_quantize"):
        coat_dequantize(data, scale, k, group_size=2)


def test_expansion_exponent_helper():
    k = coat_expansion_exponent(jnp.array([100.0, 1.0, 0.0]), jnp.array([1.0, 1.0, 0.0]), 1e4)
    np.testing.assert_allclose(np.asarray(k), [2.0, 64.0, 1.0], rtol=1e-6)


def test_under_jit_and_e5m2():
    x = np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32)
    f = jax.jit(lambda v: coat_dequantize(*coat_quantize(v, 128, jnp.float8_e5m2), 128))
    y = np.asarray(f(x))
    assert np.linalg.norm(y - x) / np.linalg.norm(x) < 0.05


def test_expansion_lowers_adam_update_error():
    """COAT Table 1 direction: with E4M3 per-group (G=128) moments, dynamic range expansion
    lowers the error of the Adam update m / (sqrt(v) + eps) versus plain per-group scaling."""
    m, v = adam_moments()
    eps = 1e-8
    ref = m / (np.sqrt(v) + eps)
    errs, m_errs = {}, {}
    for expand in (False, True):
        mq = np.asarray(coat_dequantize(*coat_quantize(m, 128, E4M3, expand)))
        vq = np.asarray(coat_dequantize(*coat_quantize(v, 128, E4M3, expand)))
        upd = mq / (np.sqrt(np.maximum(vq, 0)) + eps)
        errs[expand] = np.mean(np.abs(upd - ref))
        m_errs[expand] = np.linalg.norm(mq - m) / np.linalg.norm(m)
    assert errs[True] < errs[False], errs
    assert errs[True] < 0.5 * errs[False], errs
    assert m_errs[True] < m_errs[False], m_errs
