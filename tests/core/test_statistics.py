"""Delayed statistics: measured sites decide from the previous step's record."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalify
from scalify import ScaledArray
from scalify.core.statistics import NO_RECORD, delayed_statistics
from scalify.ops.casts import cast

E4M3 = jnp.float8_e4m3fn
# The cast's own drift guard is the one site (no guard on the scalified function's input).
NO_INPUT_GUARD = scalify.ScalifyConfig(input_drift_window=None)


def _cast_fp8(x):
    return cast(x, E4M3)


def _run(x, previous, jit=True):
    """(output, records) of the FP8 cast of `x` (a bfloat16 ScaledArray: one drift guard)."""

    def run(x, previous):
        with delayed_statistics(previous) as stats:
            y = scalify.scalify(_cast_fp8)(x)
        return y, stats.recorded()

    with NO_INPUT_GUARD:
        return (jax.jit(run) if jit else run)(x, previous)


def _scaled(top_exponent, scale_exponent=0):
    data = jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32) * 2.0**top_exponent
    return ScaledArray(data.astype(jnp.bfloat16), jnp.float32(2.0**scale_exponent))


@pytest.mark.parametrize("jit", [True, False])
def test_a_site_records_the_power_of_two_of_its_largest_value(jit):
    x = _scaled(12, scale_exponent=-3)
    _, records = _run(x, None, jit)
    np.testing.assert_array_equal(records, [2.0 ** (12 - 3)])


@pytest.mark.parametrize("jit", [True, False])
def test_without_a_record_the_propagated_scale_is_kept(jit):
    # data max 2^12 is beyond E4M3 (448): the measuring guard would move it to unit; with no
    # record yet the data keep their scale and saturate.
    y, records = _run(_scaled(12), jnp.full((1,), NO_RECORD, jnp.float32), jit)
    assert float(y.scale) == 1.0
    assert float(jnp.max(jnp.abs(y.data.astype(jnp.float32)))) == 448.0
    np.testing.assert_array_equal(records, [2.0**12])


@pytest.mark.parametrize("jit", [True, False])
def test_with_the_previous_record_the_site_decides_as_the_measuring_guard(jit):
    x = _scaled(12, scale_exponent=5)
    with NO_INPUT_GUARD:
        measured = scalify.scalify(_cast_fp8)(x)
    y, records = _run(x, jnp.asarray([2.0**17], jnp.float32), jit)
    assert float(y.scale) == float(measured.scale) == 2.0**17
    np.testing.assert_array_equal(y.data.astype(jnp.float32), measured.data.astype(jnp.float32))
    np.testing.assert_array_equal(records, [2.0**17])


def test_a_record_of_values_holds_when_an_earlier_site_moves_the_scale():
    # The same values at another data/scale split (as after an earlier site's move): the
    # record is of values, so the decision is the same value-level placement.
    a, b = _scaled(12, scale_exponent=0), _scaled(2, scale_exponent=10)
    ya, _ = _run(a, jnp.asarray([2.0**12], jnp.float32))
    yb, _ = _run(b, jnp.asarray([2.0**12], jnp.float32))
    np.testing.assert_array_equal(ya.to_array(jnp.float32), yb.to_array(jnp.float32))


def test_counting_measures_and_records():
    x = _scaled(12)
    y, records = _run(x, None)
    with NO_INPUT_GUARD:
        measured = scalify.scalify(_cast_fp8)(x)
    assert float(y.scale) == float(measured.scale)
    assert records.shape == (1,)


def test_sites_in_a_loop_body_measure_and_do_not_record():
    def body(x):
        def step(c, _):  # an FP8 cast of bfloat16 data: a guard in the body
            return cast(cast(c, E4M3), jnp.bfloat16), None

        y, _ = jax.lax.scan(step, x, None, length=2)
        return _cast_fp8(y)

    def run(x, previous):
        with delayed_statistics(previous) as stats:
            y = scalify.scalify(body)(x)
        return y, stats.recorded()

    with NO_INPUT_GUARD:
        _, records = jax.jit(run)(_scaled(12), None)
    assert records.shape == (1,)  # the cast after the loop, not the carry guard inside it


def test_zero_values_record_nothing_and_are_kept():
    zero = ScaledArray(jnp.zeros((8,), jnp.bfloat16), jnp.float32(4.0))
    y, records = _run(zero, jnp.full((1,), NO_RECORD, jnp.float32))
    assert float(y.scale) == 4.0 and np.isnan(records).all()


def test_a_state_of_another_step_is_an_error():
    with pytest.raises(ValueError, match="another step"):
        _run(_scaled(3), jnp.zeros((2,), jnp.float32))


@pytest.mark.parametrize("jit", [True, False])
def test_a_stale_placement_saturates_finite_values_and_keeps_inf(jit):
    """A float16 placement from a record 2^20 below this step's values: the finite values
    beyond float16 clip to its largest value (never inf); an inf of the data stays inf."""
    from scalify.rules.common import place_measured

    acc = jnp.array([2.0**20, -(2.0**20), 1.0, jnp.inf], jnp.float32)

    def run(acc, previous):
        with delayed_statistics(previous):
            return place_measured(acc, jnp.float32(1.0), jnp.float16).data

    data = (jax.jit(run) if jit else run)(acc, jnp.ones((1,), jnp.float32))
    fmax = float(jnp.finfo(jnp.float16).max)
    np.testing.assert_array_equal(np.asarray(data, np.float32), [fmax, -fmax, 1.0, np.inf])


@pytest.mark.parametrize("jit", [True, False])
def test_a_float16_convert_without_a_record_saturates_and_keeps_nan(jit):
    """float32 -> float16 behind the convert's drift guard, no record yet: the data keep
    their scale, the values beyond float16 (inf too) clip to its largest value (never inf:
    an inf in a gradient would turn the update into NaN), NaN stays."""
    x = ScaledArray(jnp.array([2.0**20, -(2.0**100), 1.0, jnp.inf, jnp.nan], jnp.float32), jnp.float32(1.0))

    def run(x, previous):
        with delayed_statistics(previous) as stats:
            y = scalify.scalify(lambda v: v.astype(jnp.float16))(x)
        return y, stats.recorded()

    with NO_INPUT_GUARD:
        y, records = (jax.jit(run) if jit else run)(x, jnp.full((1,), NO_RECORD, jnp.float32))
    fmax = float(jnp.finfo(jnp.float16).max)
    assert float(y.scale) == 1.0 and records.shape == (1,)
    np.testing.assert_array_equal(np.asarray(y.data, np.float32), [fmax, -fmax, 1.0, fmax, np.nan])


def test_a_record_estimate_takes_the_drift_factor_of_the_measuring_guard():
    """`guards._record_factor`, the factor of an estimate from a record (a power of two, inf
    or NaN), is `_drift_factor`'s on every such value."""
    from scalify.core.guards import _drift_factor, _record_factor

    m = np.concatenate([2.0 ** np.arange(-126, 128), [np.inf, np.nan]]).astype(np.float32)
    for lo, hi in [(4, 8), (4, 15), (51, 52), (2, 3)]:
        for top in (2.0**-100, 1.0, 2.0**100):
            want = _drift_factor(jnp.asarray(m), jnp.float32(top), lo, hi)
            np.testing.assert_array_equal(np.asarray(_record_factor(jnp.asarray(m), lo, hi)), np.asarray(want))


@pytest.mark.parametrize("jit", [True, False])
def test_one_guard_per_data_scale_and_window(jit):
    """Two FP8 casts of the same data at the same scale take one drift guard (one record,
    the same placement: attention's query, key and value projections quantise one input);
    a cast to another format, whose window differs, takes its own."""
    x = _scaled(12, scale_exponent=-3)

    def run(x, previous, formats):
        with delayed_statistics(previous) as stats:
            ys = scalify.scalify(lambda v: [cast(v, f) for f in formats])(x)
        return ys, stats.recorded()

    with NO_INPUT_GUARD:
        run_ = jax.jit(run, static_argnums=2) if jit else run
        (a, b), records = run_(x, None, (E4M3, E4M3))
        (c, d), both = run_(x, None, (E4M3, jnp.float8_e5m2))
        (single,), _ = run_(x, None, (E4M3,))
    np.testing.assert_array_equal(records, [2.0 ** (12 - 3)])
    assert len(both) == 2
    for y in (a, b, c):
        assert float(y.scale) == float(single.scale)
        np.testing.assert_array_equal(y.data.astype(jnp.float32), single.data.astype(jnp.float32))
