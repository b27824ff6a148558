"""Reduction scale rules: model invariance, non-scalar scales, masks, low precision."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import scalify
from scalify import ScaledArray, scaled_array

SHAPE = (4, 6)


def _values(seed, shape=SHAPE):
    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def _scaled(x, scale, dtype=np.float32):
    """ScaledArray of value x with power-of-two scale(s) (exact data = x / scale)."""
    scale = np.asarray(scale, np.float32)
    return scaled_array((np.asarray(x, np.float64) / scale).astype(dtype), scale)


# Scalar, per-row, per-column and per-element scales.
LAYOUTS = {
    "scalar": np.float32(2.0**-5),
    "rows": (2.0 ** np.array([-6, -1, 0, 7], np.float32)).reshape(4, 1),
    "cols": 2.0 ** np.array([-3, 4, 0, 1, -8, 2], np.float32),
    "full": 2.0 ** np.random.RandomState(9).randint(-8, 8, SHAPE).astype(np.float32),
}


def _value(out):
    return np.asarray(out.to_array(np.float32) if isinstance(out, ScaledArray) else out)


def _check(f, *xs, rtol=1e-6, atol=0.0):
    out = scalify.scalify(f)(*xs)
    ref = f(*[x.to_array(np.float32) if isinstance(x, ScaledArray) else x for x in xs])
    np.testing.assert_allclose(_value(out), np.asarray(ref), rtol=rtol, atol=atol)
    if isinstance(out, ScaledArray):
        assert scalify.is_pow2(np.asarray(out.scale)).all()
        assert out.dtype == xs[0].dtype
    return out


REDUCTIONS = {
    "sum_0": lambda x: lax.reduce_sum(x, (0,)),
    "sum_1": lambda x: lax.reduce_sum(x, (1,)),
    "sum_all": lambda x: lax.reduce_sum(x, (0, 1)),
    "max_0": lambda x: lax.reduce_max(x, (0,)),
    "max_1": lambda x: lax.reduce_max(x, (1,)),
    "min_all": lambda x: lax.reduce_min(x, (0, 1)),
    "prod_0": lambda x: lax.reduce_prod(x, (0,)),
    "prod_1": lambda x: lax.reduce_prod(x, (1,)),
    "argmax_0": lambda x: lax.argmax(x, 0, jnp.int32),
    "argmin_1": lambda x: lax.argmin(x, 1, jnp.int32),
    "cumsum_0": lambda x: lax.cumsum(x, 0),
    "cumsum_1_rev": lambda x: lax.cumsum(x, 1, reverse=True),
    "cumprod_1": lambda x: lax.cumprod(x, 1),
    "cumprod_0_rev": lambda x: lax.cumprod(x, 0, reverse=True),
    "cummax_1": lambda x: lax.cummax(x, 1),
    "cummin_0": lambda x: lax.cummin(x, 0),
    "cumlogsumexp_1": lambda x: lax.cumlogsumexp(x, 1),
    "window_sum": lambda x: lax.reduce_window(x, 0.0, lax.add, (2, 3), (1, 2), "VALID"),
    "window_sum_rows": lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2), (1, 1), "SAME"),
    "window_max": lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (2, 1), "SAME"),
    "window_min": lambda x: lax.reduce_window(x, jnp.inf, lax.min, (1, 3), (1, 1), "VALID"),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reduction_model_invariance(name, layout):
    _check(REDUCTIONS[name], _scaled(_values(0), LAYOUTS[layout]))


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reduction_special_values(name):
    """-inf masks, +inf, nan and zeros behave as in plain JAX."""
    x = _values(1)
    x[0, :3] = -np.inf  # masked entries
    x[1, :] = -np.inf  # a fully masked row
    x[2, 2] = np.nan
    x[3, :2] = 0.0
    x[3, 4] = np.inf
    _check(REDUCTIONS[name], _scaled(x, 2.0**7))


@pytest.mark.usefixtures("arguments_as_given")
def test_reduce_sum_scale_is_s_sqrt_n():
    x = _scaled(_values(0, (4, 64)), 2.0**-5)
    out = _check(lambda v: lax.reduce_sum(v, (1,)), x)
    assert float(out.scale) == 2.0**-5 * 8  # sqrt(64) = 8
    out = _check(lambda v: lax.cumsum(v, 1), x)
    assert float(out.scale) == 2.0**-5 * 8
    out = _check(lambda v: lax.reduce_max(v, (1,)), x)
    assert float(out.scale) == 2.0**-5


@pytest.mark.usefixtures("arguments_as_given")
def test_reduce_prod_scale_is_exact_power():
    x = _scaled(_values(0), 2.0**-5)
    out = _check(lambda v: lax.reduce_prod(v, (1,)), x)
    assert float(out.scale) == 2.0**-30
    out = _check(lambda v: lax.cumprod(v, 1), x)
    np.testing.assert_array_equal(np.asarray(out.scale).ravel(), 2.0 ** (-5.0 * np.arange(1, 7)))


@pytest.mark.parametrize("scale", [2.0**64, 2.0**-64])
def test_reduce_prod_scale_overflow_guard(scale):
    """s^N beyond float32 is clipped; the value is then what materialising gives (inf / 0),
    with no NaN from 0 * inf."""
    x = np.array([[1.0, 1.5, 3.0, 2.0], [0.0, 1.0, 1.0, 1.0]], np.float32)
    sx = scaled_array(x, np.float32(scale))
    for f in (lambda v: lax.reduce_prod(v, (1,)), lambda v: lax.cumprod(v, 1)):
        out = _value(scalify.scalify(f)(sx))
        ref = np.asarray(f(sx.to_array(np.float32)))
        # Where plain float32 meets 0 * inf depends on the reduction order (CPU and GPU
        # differ): compare where it is not NaN; the scaled result is never NaN.
        ok = ~np.isnan(ref)
        np.testing.assert_allclose(out[ok], ref[ok], rtol=1e-6, atol=0)
        assert not np.isnan(out).any()
    # Plain float32 overflows mid-product (2^64 * 1.5 * 2^64 = inf, then inf * 0 = nan);
    # the scaled product is exact: 0.
    y = scaled_array(np.array([[1.0, 1.5, 0.0, 2.0]], np.float32), np.float32(scale))
    out = scalify.scalify(lambda v: lax.reduce_prod(v, (1,)))(y)
    assert _value(out)[0] == 0.0


def test_reduce_sum_empty_axis():
    x = _scaled(np.zeros((3, 0), np.float32), 2.0**3)
    out = _check(lambda v: lax.reduce_sum(v, (1,)), x)
    assert float(out.scale) > 0


# ---------------------------------------------------------------------------------------
# Low precision
# ---------------------------------------------------------------------------------------
def test_float16_sum_would_overflow():
    """4096 values ~1000: plain float16 sums overflow (> 65504); scaled data stay ~unit."""
    x = np.abs(_values(0, (2, 4096))) * np.float32(1024.0)
    sx = _scaled(x, 2.0**10, np.float16)
    out = scalify.scalify(lambda v: lax.reduce_sum(v, (1,)))(sx)
    assert out.dtype == jnp.float16
    assert float(out.scale) == 2.0**16
    np.testing.assert_allclose(_value(out), x.sum(1), rtol=2e-3)
    assert np.isinf(np.asarray(lax.reduce_sum(jnp.asarray(x, jnp.float16), (1,)))).all()


def test_float16_prod_would_underflow():
    x = np.abs(_values(0, (3, 8))) * np.float32(2.0**-10) + np.float32(2.0**-12)
    sx = _scaled(x, 2.0**-10, np.float16)
    out = scalify.scalify(lambda v: lax.reduce_prod(v, (1,)))(sx)
    np.testing.assert_allclose(_value(out), np.prod(x.astype(np.float64), 1), rtol=1e-2)
    assert (np.asarray(lax.reduce_prod(jnp.asarray(x, jnp.float16), (1,))) == 0).all()


@pytest.mark.parametrize("scale", [2.0**20, 2.0**-24])
def test_float16_softmax_and_logsumexp_at_extreme_scales(scale):
    """Logits x ~ N(0, 1)*scale in float16 data: out of float16's range in plain JAX."""
    x = _values(0) * np.float32(scale)
    sx = _scaled(x, scale, np.float16)
    ref_sm = jax.nn.softmax(x, axis=-1)
    out = scalify.scalify(lambda v: jax.nn.softmax(v, axis=-1))(sx)
    np.testing.assert_allclose(_value(out), ref_sm, rtol=5e-3, atol=1e-6)
    out = scalify.scalify(lambda v: jax.nn.logsumexp(v, axis=-1))(sx)
    np.testing.assert_allclose(_value(out), jax.nn.logsumexp(x, axis=-1), rtol=5e-3)


# ---------------------------------------------------------------------------------------
# jax.nn / jnp compositions in float32 (model invariance)
# ---------------------------------------------------------------------------------------
def _masked(v, mask):
    return jnp.where(mask, v, -jnp.inf)


COMPOSITES = {
    "softmax": lambda v, m: jax.nn.softmax(v, axis=-1),
    "softmax_axis0": lambda v, m: jax.nn.softmax(v, axis=0),
    "log_softmax": lambda v, m: jax.nn.log_softmax(v, axis=-1),
    "logsumexp": lambda v, m: jax.nn.logsumexp(v, axis=-1),
    "logsumexp_all": lambda v, m: jax.nn.logsumexp(v),
    "masked_softmax": lambda v, m: jax.nn.softmax(_masked(v, m), axis=-1),
    "masked_logsumexp": lambda v, m: jax.nn.logsumexp(_masked(v, m), axis=-1),
    "masked_softmax_where": lambda v, m: jax.nn.softmax(v, axis=-1, where=m),
    "mean": lambda v, m: jnp.mean(v, axis=-1),
    "var": lambda v, m: jnp.var(v, axis=-1),
    "std_all": lambda v, m: jnp.std(v),
    "norm": lambda v, m: jnp.linalg.norm(v, axis=-1),
    "max_min": lambda v, m: jnp.max(v, axis=0) - jnp.min(v, axis=0),
    "argmax": lambda v, m: jnp.argmax(v, axis=-1),
    "cumsum": lambda v, m: jnp.cumsum(v, axis=-1),
}

# Sums of differently-rounded terms (var: the mean is subtracted; softmax: exp(x - max) /
# sum) are identical in float32; only the few ops that add terms of different scales
# (log_softmax: x - max - log(sum)) may differ in the last bit.
_RTOL = {"log_softmax": 2e-6, "var": 2e-6, "std_all": 2e-6}


def _sum_order_atol(x, axis):
    """Bound on the difference of two float32 means of x along `axis` that add the same
    terms in different orders: each sum is within (n-1)*u*sum|x| of the exact one (u = 2^-24),
    so two orders differ by at most 2(n-1)*u*sum|x|, divided by n for the mean.

    The order of a `reduce` is the backend's choice: XLA:CPU adds a row in index order in
    every program, XLA:GPU's reduction kernels add in an order of its own that need not be
    the same in the scalified program (the sum alone) and the plain one (jnp.mean's sum
    fused with its division). With cancellation (|sum x| << sum|x|) different orders differ
    by far more than rtol * |mean|: _values(2)'s third row has sum|x| / |sum x| = 156.
    Scalify's power-of-two scales change no term's rounding, so with one order the two are
    equal (as on CPU)."""
    x = np.asarray(x, np.float64)
    n = x.shape[axis]
    return float(2 * (n - 1) * 2.0**-24 * np.max(np.sum(np.abs(x), axis=axis)) / n)


@pytest.mark.parametrize("layout", ["scalar", "rows"])
@pytest.mark.parametrize("name", sorted(COMPOSITES))
def test_jax_nn_compositions(name, layout):
    f = COMPOSITES[name]
    x = _values(2)
    mask = np.ones(SHAPE, bool)
    mask[0, :2] = False
    mask[1, :] = False  # fully masked row: nan (softmax) / -inf (logsumexp) as in JAX
    sx = _scaled(x, LAYOUTS[layout])
    atol = _sum_order_atol(x, -1) if name == "mean" else 0.0  # signed terms: order matters
    _check(f, sx, mask, rtol=_RTOL.get(name, 1e-6), atol=atol)


def test_softmax_masked_minus_inf_keeps_data_scale():
    """-inf mask values take the logits' scale ("any scale") and vanish in the softmax."""
    x = _scaled(_values(3), 2.0**-6)
    mask = np.tril(np.ones(SHAPE, bool))
    f = lambda v, m: jax.nn.softmax(_masked(v, m), axis=-1)  # noqa: E731
    out = _check(f, x, mask)
    probs = _value(out)
    assert (probs[~mask] == 0).all()
    np.testing.assert_allclose(probs.sum(-1)[mask.any(-1)], 1.0, rtol=1e-6)


def test_grad_of_logsumexp():
    x = _scaled(_values(4), 2.0**5)
    f = jax.grad(lambda v: jax.nn.logsumexp(v * 0.5))
    _check(f, x)


def test_softmax_temperature_sqrt_n():
    """Attention-style logits: q.k / sqrt(d) at a small scale (sums of d products)."""
    d = 16
    q, k = _scaled(_values(5, (4, d)), 2.0**-3), _scaled(_values(6, (6, d)), 2.0**-4)
    f = lambda a, b: jax.nn.softmax(a @ b.T / math.sqrt(d), axis=-1)  # noqa: E731
    _check(f, q, k, rtol=2e-6)


# Ops that combine elements whose scales differ (stacked per-step values of a scan, one scale
# per step), over the steps: (function, its float64 reference).
OVER_STEPS = {
    "sum": (lambda x: jnp.sum(x, 0), lambda v: v.sum(0)),
    "mean": (lambda x: jnp.mean(x, 0), lambda v: v.mean(0)),
    "max": (lambda x: jnp.max(x, 0), lambda v: v.max(0)),
    "cumsum": (lambda x: jnp.cumsum(x, 0), lambda v: v.cumsum(0)),
    "argmax": (lambda x: jnp.argmax(x, 0), lambda v: v.argmax(0)),
    "sort": (lambda x: jnp.sort(x, 0), lambda v: np.sort(v, 0)),
    "top_k": (lambda x: lax.top_k(x.T, 3)[0], lambda v: -np.sort(-v.T, 1)[:, :3]),
    "flatten_max": (lambda x: jnp.max(x), lambda v: v.max()),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", sorted(OVER_STEPS))
def test_ops_over_steps_ignore_the_scale_of_an_all_zero_step(name, jit):
    """float16 per-step values, one scale per step: the last step is exactly zero and kept the
    scale its zeros started with (2^1), the other steps sit near 2^-30 (plain float16 cannot
    hold them at all). The common scale the op needs is the largest among non-zero elements:
    equal to float64 to float16 rounding (the largest scale of all flushed every other
    step)."""
    f, ref_fn = OVER_STEPS[name]
    rng = np.random.default_rng(11)
    data = rng.standard_normal((6, 8)).astype(np.float16)
    data[-1] = 0
    steps = np.float32([2.0**-30, 2.0**-29, 2.0**-31, 2.0**-30, 2.0**-28, 2.0]).reshape(6, 1)
    x = scaled_array(data, steps)
    out = (jax.jit(scalify.scalify(f)) if jit else scalify.scalify(f))(x)
    ref = ref_fn(data.astype(np.float64) * steps)
    if name == "argmax":
        np.testing.assert_array_equal(np.asarray(out), ref)
        return
    got = np.asarray(out.to_array(np.float32), np.float64)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2.0**-9 * np.max(np.abs(ref)))
