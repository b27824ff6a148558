"""scalify.inspect.scale_health: per-equation data statistics, flags and advice."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalify
from scalify.inspect.health import scale_health


def _drifted(shape=(8, 16), bits=30, dtype=jnp.float32):
    """Data 2^-bits at scale 2^bits (scale_health's step must not rebalance its arguments)."""
    x = jax.random.normal(jax.random.PRNGKey(0), shape, jnp.float32)
    return scalify.ScaledArray((x * 2.0**-bits).astype(dtype), jnp.asarray(2.0**bits, jnp.float32))


@pytest.fixture(autouse=True)
def _keep_arguments_as_given():
    """The input guard would move drifted arguments back to unit data before the step."""
    with scalify.ScalifyConfig(input_drift_window=None):
        yield


def test_correlated_data_drift_through_a_matmul_chain_with_the_input_guard_on():
    """A matmul's rule assumes independent unit data (output RMS sqrt(K)); all-ones operands
    give K instead, so the data grow by sqrt(K) = 2^3 per matmul while the value stays right."""
    with scalify.ScalifyConfig():
        ones = scalify.as_scaled_array(jnp.ones((64, 64)))

        def chain(x, w):
            for _ in range(10):
                x = x @ w / 64.0
            return x

        out, report = scale_health(chain, scalify.as_scaled_array(jnp.ones((4, 64))), ones)
    np.testing.assert_allclose(np.asarray(out.to_array()), 1.0)
    first = report.first("drift")
    assert first is not None and first.primitive in ("dot_general", "div"), str(report)
    assert first.log2_rms > 23


def test_unit_data_are_healthy_and_outputs_unchanged():
    x = scalify.as_scaled_array(jax.random.normal(jax.random.PRNGKey(1), (8, 16)))
    fn = lambda x: jnp.tanh(x @ x.T) * 2.0  # noqa: E731
    out, report = scale_health(fn, x)
    # scale_health runs the step op by op: compare with the eager scalified step (XLA:CPU's
    # fused tanh differs from the op-by-op one in the last bit on some CPUs).
    expected = scalify.scalify(fn)(x)
    np.testing.assert_array_equal(np.asarray(out.to_array()), np.asarray(expected.to_array()))
    assert len(report.rows) >= 3
    assert report.flagged == []
    assert [r.index for r in report.rows] == sorted(r.index for r in report.rows)
    assert all(abs(r.log2_rms) < 4 for r in report.rows)


def test_drift_is_flagged_at_the_users_line_with_advice():
    def fn(x):
        y = x * 3.0  # the first equation that sees the drifted data
        return jnp.sum(y)

    _, report = scale_health(fn, _drifted(bits=30))
    first = report.first("drift")
    assert first is not None and first.primitive == "mul"
    assert "test_health.py" in first.source
    assert first.log2_rms == pytest.approx(-30, abs=1)
    assert first.log2_scale == pytest.approx(31.6, abs=1)  # 2^30 * 3 rounded to a power of two
    assert "dynamic_rescale_l2" in first.advice()
    assert "first problem" in str(report) and "test_health.py" in str(report)
    # The advised fix removes the flag.
    _, fixed = scale_health(lambda x: fn(scalify.dynamic_rescale_l2(x)), _drifted(bits=30))
    assert fixed.first("drift") is None


def test_small_drift_is_not_flagged_and_threshold_is_configurable():
    _, report = scale_health(lambda x: x * 3.0, _drifted(bits=10))
    assert report.first("drift") is None  # float32 resolves 23 bits
    _, strict = scale_health(lambda x: x * 3.0, _drifted(bits=10), drift_bits={jnp.float32: 8})
    assert strict.first("drift") is not None


def test_backward_rows_are_marked_and_advised_on_the_gradient():
    w = scalify.as_scaled_array(jax.random.normal(jax.random.PRNGKey(2), (16, 16)))

    def loss(w, x):  # d loss / d w = x^T (1 - tanh^2): x's drift reaches the gradient
        return jnp.sum(jnp.tanh(dynamic_rescale(x @ w)))

    dynamic_rescale = scalify.dynamic_rescale_l2  # the forward is healthy after it
    _, report = scale_health(jax.grad(loss), w, _drifted((4, 16), bits=30))
    back = [r for r in report.flagged if r.backward]
    assert back, str(report)
    assert "dynamic_rescale_l2_grad" in back[0].advice()


def test_nonfinite_and_float16_underflow_are_flagged():
    # created: log(0) = -inf from finite inputs, then inf - inf = nan from inputs without nan
    x = scalify.as_scaled_array(jnp.array([1.0, 0.0, 2.0, 4.0]))
    _, report = scale_health(lambda x: jnp.log(x) - jnp.log(x), x)
    flagged = [r.primitive for r in report.rows if "nonfinite" in r.flags]
    assert set(flagged) == {"log", "sub"} and report.first("nonfinite").primitive == "log", str(report)
    # carried: a -inf mask through where, x - max and exp (Flax-style attention) is not a
    # problem, and the report says so
    logits = scalify.as_scaled_array(jnp.arange(8.0).reshape(2, 4))
    mask = jnp.array([[True, True, False, False], [True, False, True, False]])

    def softmax(z):
        z = jnp.where(mask, z, -jnp.inf)
        return jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))

    _, report = scale_health(softmax, logits)
    assert report.first("nonfinite") is None, str(report)
    assert any(r.nonfinite for r in report.rows)  # the masked entries are still counted
    # float16 data with most values below float16's smallest normal (2^-14).
    d = jnp.full((64,), 2.0**-20, jnp.float16)
    _, report16 = scale_health(lambda x: x * 2.0, scalify.ScaledArray(d, jnp.float32(1.0)))
    row = report16.first("underflow")
    assert row is not None and row.subnormal_share > 0.9 and row.dtype == "float16"


def test_loop_bodies_report_each_iteration():
    def fn(x):
        return jax.lax.fori_loop(0, 3, lambda i, c: c * 2.0, x)

    _, report = scale_health(fn, scalify.as_scaled_array(jnp.ones((4,))))
    muls = [r for r in report.rows if r.primitive == "mul"]
    assert len(muls) == 3


def test_plot_writes_a_figure(tmp_path):
    _, report = scale_health(lambda x: x * 3.0, _drifted(bits=30))
    path = tmp_path / "health.png"
    report.plot(str(path))
    assert path.stat().st_size > 1000


def test_inside_jit_is_an_error_that_says_what_to_do():
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(lambda x: scale_health(lambda y: y * 2.0, x)[0])(scalify.as_scaled_array(jnp.ones(3)))


def test_first_out_of_range_is_the_overflow_that_reaches_the_outputs_not_an_absorbed_one():
    """log(0) = -inf made and dropped again by exp (as a -inf mask under a softmax) is not
    the cause; exp of a value near 2^14, an inf that reaches the output, is."""
    x = scalify.as_scaled_array(jnp.array([0.0, 0.5, 1.0, 2.0]))

    def absorbed_only(x):
        return jnp.exp(jnp.log(x)) + x  # log(0) = -inf, exp(-inf) = 0

    out, report = scale_health(absorbed_only, x)
    assert np.isfinite(np.asarray(out.to_array())).all()
    assert report.first("nonfinite").primitive == "log"  # created, flagged...
    assert report.first_out_of_range() is None  # ... but dropped: not out of range
    assert [r.primitive for r in report.absorbed()] == ["log"]
    assert "dropped later" in str(report)

    def overflowing(x):
        y = absorbed_only(x)
        return y * jnp.exp(x * 2.0**14)  # THE OVERFLOW

    out, report = scale_health(overflowing, x)
    assert np.isinf(np.asarray(out.to_array())).any() and report.outputs_nonfinite
    first = report.first_out_of_range()
    assert first.primitive == "exp" and first.phase == "forward", str(report)
    with open(__file__) as f:
        line = next(i for i, t in enumerate(f, start=1) if "# THE OVERFLOW" in t and "line =" not in t)
    assert first.source.startswith(f"{__file__}:{line} "), str(report)
    chain = report.chain(first)
    assert chain[0][1].primitive == "mul" and chain[0][1].nonfinite == 0
    assert "first data out of range: #" in str(report) and "how the data got there" in str(report)
    assert report.absorbed()[0].primitive == "log"  # listed, before the cause


def test_phases_forward_backward_optimizer_and_library_calls_named_at_the_users_line():
    """Equations of the transpose are `backward`, those under jvp `forward`, those after the
    backward pass outside differentiation `optimizer`; an equation inside a jitted library
    function (jax.nn.silu) carries the user's line that called it."""
    import optax

    w = scalify.as_scaled_array(jax.random.normal(jax.random.PRNGKey(3), (8, 8)))
    x = jax.random.normal(jax.random.PRNGKey(4), (4, 8))
    opt = optax.sgd(0.1)

    def step(w, x):
        g = jax.grad(lambda w: jnp.sum(jax.nn.silu(x @ w)))(w)  # THE MODEL LINE
        return optax.apply_updates(w, opt.update(g, opt.init(w))[0])

    _, report = scale_health(step, w, x)
    phases = [r.phase for r in report.rows]
    assert set(phases) == {"forward", "backward", "optimizer"}, phases
    assert phases == sorted(phases, key=("forward", "backward", "optimizer").index)
    with open(__file__) as f:
        line = next(i for i, t in enumerate(f, start=1) if "# THE MODEL LINE" in t and "line =" not in t)
    logistic = [r for r in report.rows if r.primitive == "logistic"]
    assert logistic and all(r.source.startswith(f"{__file__}:{line} ") for r in logistic), str(report)
    assert all("site-packages" not in r.source for r in report.rows), [r.source for r in report.rows]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.float8_e4m3fn])
def test_host_and_device_statistics_agree(dtype):
    """Concrete values are measured by NumPy on a CPU host and by a jitted reduction on an
    accelerator: both give the same statistics (nan, inf, zero data and, for 16- and 8-bit
    data, subnormals included: XLA flushes float32 subnormals to zero)."""
    from scalify.inspect.health import _device_statistics, _host_statistics

    sub = float(jnp.finfo(dtype).tiny) / 4 if dtype != jnp.float32 else 0.5
    values = np.array([0.0, 1.5, -3.0, sub, 2.0, np.nan, np.inf, -np.inf, 0.25], np.float32)
    if dtype == jnp.float8_e4m3fn:  # no inf in E4M3FN
        values = values[np.isfinite(values) | np.isnan(values)]
    x = scalify.ScaledArray(jnp.asarray(values).astype(dtype), jnp.asarray([2.0**-3], jnp.float32))
    host = np.asarray(_host_statistics(x), np.float64)
    device = np.asarray(jax.device_get(_device_statistics(x)), np.float64)
    np.testing.assert_allclose(host, device, rtol=1e-6)
    assert host[4] == 1 and host[3] == (dtype != jnp.float32)  # one nan, a subnormal
