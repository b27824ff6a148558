"""The scalify transform itself: tracing, caching, arguments, metadata, errors."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive

import scalify
from benchmarks.data_barrier_cpu import residual_chain  # the chain the benchmark sizes
from scalify import ScaledArray


def _xy():
    x = scalify.scaled_array(np.linspace(-1, 1, 8, dtype=np.float32), 2.0**-5)
    y = scalify.scaled_array(np.linspace(2, 3, 8, dtype=np.float32), 2.0**7)
    return x, y


def test_no_scaled_input_is_bit_identical_to_plain_jax():
    def f(x, w):
        return jnp.tanh(x @ w).sum() * 3.0 + jnp.maximum(x, 0.5).mean()

    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8))
    w = jax.random.normal(jax.random.PRNGKey(1), (8, 8))
    chex.assert_trees_all_equal(jax.jit(scalify.scalify(f))(x, w), jax.jit(f)(x, w))
    # and the jaxpr has exactly the same equations
    plain = jax.make_jaxpr(f)(x, w)
    scaled = jax.make_jaxpr(scalify.scalify(f))(x, w)
    assert [e.primitive for e in plain.eqns] == [e.primitive for e in scaled.eqns]


def test_outputs_are_scaled_and_match_plain_values():
    x, y = _xy()
    f = lambda a, b: a * b + a
    out = scalify.scalify(f)(x, y)
    assert isinstance(out, ScaledArray)
    np.testing.assert_allclose(out.to_array(), f(x.to_array(), y.to_array()), rtol=1e-6)


def test_kwargs_python_scalars_and_static_arguments():
    x, _ = _xy()

    def f(a, b, *, factor, name="x", use=True):
        assert isinstance(name, str)
        return a * factor + b if use else a

    sf = scalify.scalify(f)
    out = sf(x, 1.5, factor=2.0, name="hello")
    np.testing.assert_allclose(out.to_array(), x.to_array() * 2.0 + 1.5, rtol=1e-6)
    out2 = sf(x, 1.5, factor=2.0, name="hello", use=False)
    np.testing.assert_array_equal(out2.to_array(), x.to_array())


def test_traced_jaxprs_are_cached():
    x, y = _xy()
    calls = []

    def f(a, b):
        calls.append(1)
        return a * b

    sf = scalify.scalify(f)
    sf(x, y)
    sf(x, y)
    assert len(calls) == 1 and sf.cache_size() == 1
    sf(x.data, y)  # a different structure (unscaled first input) re-traces
    assert len(calls) == 2
    with scalify.ScalifyConfig(rounding_mode="up"):
        sf(x, y)
    assert len(calls) == 3


def test_scalify_under_jit_and_inside_other_transforms():
    x, y = _xy()
    f = lambda a, b: (a * b - b).sum()
    out = jax.jit(scalify.scalify(f))(x, y)
    np.testing.assert_allclose(out.to_array(), f(x.to_array(), y.to_array()), rtol=1e-6)


def test_broadcast_scalar_constants_are_split_exactly():
    x, _ = _xy()
    out = scalify.scalify(lambda a: a * 0.375)(x)
    # 0.375 = 1.5 * 2^-2: the scale picks up the exact power of two
    assert float(out.scale) == 2.0**-5 * 0.25
    np.testing.assert_array_equal(out.to_array(), x.to_array() * 0.375)


def test_any_scale_values_take_the_scale_of_the_other_operand():
    # -inf mask as in attention: the -inf must not drag the scale to 1
    x = scalify.scaled_array(np.arange(6, dtype=np.float32).reshape(2, 3), 2.0**-10)
    mask = np.array([[True, False, True], [True, True, False]])
    out = scalify.scalify(lambda a: jnp.where(mask, a, -jnp.inf))(x)
    expected = np.where(mask, x.to_array(), -np.inf)
    np.testing.assert_array_equal(out.to_array(), expected)
    assert float(out.scale) == 2.0**-10
    relu = scalify.scalify(lambda a: jnp.maximum(a, 0.0))(x)
    assert float(relu.scale) == 2.0**-10


def test_unsupported_primitive_error_names_primitive_line_and_ways_out():
    mystery_p = Primitive("mystery_op")
    mystery_p.def_impl(lambda x: x)
    mystery_p.def_abstract_eval(lambda x: x)

    def f(a):
        return mystery_p.bind(a)  # the line the error must point at

    x, _ = _xy()
    with pytest.raises(scalify.UnsupportedPrimitiveError) as info:
        scalify.scalify(f)(x)
    msg = str(info.value)
    assert "mystery_op" in msg
    assert "test_interpreter.py" in msg
    assert "register_scale_rule" in msg and "custom_scale" in msg
    # without a scaled input the primitive is simply bound
    np.testing.assert_array_equal(scalify.scalify(f)(x.data), x.data)


def test_registering_a_rule_in_a_few_lines():
    double_p = Primitive("double_for_test")
    double_p.def_impl(lambda x: 2 * x)
    double_p.def_abstract_eval(lambda x: x)

    @scalify.register_scale_rule(double_p)
    def _double_rule(x):
        """double(x): scale 2*s, data unchanged (exact)."""
        return ScaledArray(x.data, x.scale * 2)

    x, _ = _xy()
    out = scalify.scalify(double_p.bind)(x)
    np.testing.assert_array_equal(out.data, x.data)
    np.testing.assert_array_equal(out.to_array(), 2 * x.to_array())
    assert scalify.registered_rules()[double_p].family == "test_interpreter"


def test_registering_over_a_builtin_rule_needs_override():
    from jax import lax

    builtin = scalify.registered_rules()[lax.cbrt_p].fn
    with pytest.raises(ValueError, match="already has a scale rule.*override=True"):
        scalify.register_scale_rule(lax.cbrt_p)(lambda x, **params: x)
    assert scalify.registered_rules()[lax.cbrt_p].fn is builtin
    calls = []

    def mine(x, **params):
        calls.append(1)
        return builtin(x, **params)

    try:
        scalify.register_scale_rule(lax.cbrt_p, override=True)(mine)
        x, _ = _xy()
        scalify.scalify(jnp.cbrt)(x)
        assert calls
    finally:
        scalify.register_scale_rule(lax.cbrt_p, override=True)(builtin)
    assert scalify.registered_rules()[lax.cbrt_p].fn is builtin


def test_buggy_rule_output_is_reported():
    bad_p = Primitive("bad_for_test")
    bad_p.def_impl(lambda x: x)
    bad_p.def_abstract_eval(lambda x: x)
    scalify.register_scale_rule(bad_p)(lambda x: ScaledArray(x.data[:1], x.scale))
    x, _ = _xy()
    with pytest.raises(AssertionError, match="bug in the rule"):
        scalify.scalify(bad_p.bind)(x)


def test_returning_a_constructed_scaled_array_is_an_error():
    x, _ = _xy()
    with pytest.raises(scalify.ScaledTypeError, match="set_scaling"):
        scalify.scalify(lambda a: scalify.scaled_array(a, 1.0))(x)


# ---------------------------------------------------------------------------------------
# Scale barrier (ScalifyConfig.scale_barrier)
# ---------------------------------------------------------------------------------------
def _mlp_grad(n_layers):
    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w) + x
        return (x * x).sum()

    ws = [scalify.as_scaled_array(0.3 * jax.random.normal(jax.random.PRNGKey(i), (16, 16)))
          for i in range(n_layers)]
    x = scalify.as_scaled_array(jax.random.normal(jax.random.PRNGKey(99), (4, 16)))
    return scalify.scalify(jax.grad(loss)), ws, x


def _barrier_divisions(fn, *args):
    """The barrier's ops in the traced jaxpr: scalar divisions by its run-time `one`
    (`sqrt(convert(s0 > -inf))`; other scalar divisions are scale arithmetic)."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    converted = {
        e.outvars[0] for e in jaxpr.eqns
        if e.primitive is jax.lax.convert_element_type_p and e.invars[0].aval.dtype == np.bool_
    }
    ones = {e.outvars[0] for e in jaxpr.eqns if e.primitive is jax.lax.sqrt_p and e.invars[0] in converted}
    return sum(
        1 for e in jaxpr.eqns
        if e.primitive is jax.lax.div_p and e.outvars[0].aval.ndim == 0 and e.invars[1] in ones
    )


@pytest.mark.usefixtures("arguments_as_given")
def test_scale_barrier_depth_sets_how_many_scale_ops_it_cuts_and_keeps_values():
    counts, grads = {}, {}
    for every in (0, 1, 4, 16):
        fn, ws, x = _mlp_grad(6)  # a new function: jax.jit and make_jaxpr cache their traces
        with scalify.ScalifyConfig(scale_barrier=every, input_drift_window=None):
            counts[every] = _barrier_divisions(fn, ws, x)
            grads[every] = [g.to_array() for g in jax.jit(fn)(ws, x)]
    assert counts[0] < counts[16] < counts[4] < counts[1]
    for every in (1, 4, 16):
        chex.assert_trees_all_equal(grads[every], grads[0])


@pytest.mark.usefixtures("arguments_as_given")
def test_scale_barrier_skips_rules_that_pass_a_scale_through():
    x = scalify.scaled_array(np.ones((4, 8), np.float32), 2.0**-3)
    f = lambda a: jnp.transpose(a.reshape(8, 4)).astype(jnp.float16)[None]
    # the cast guard (cast_drift_window) may move float16 data to unit: a new scale
    with scalify.ScalifyConfig(scale_barrier=1, input_drift_window=None, power_drift_window=None,
                               cast_drift_window=None):
        assert _barrier_divisions(scalify.scalify(f), x) == 0
        assert _barrier_divisions(scalify.scalify(lambda a: a * a), x) == 1
    # The power guard of `a * a` cuts its factor (scale_flow.cut_scale).
    with scalify.ScalifyConfig(scale_barrier=1, input_drift_window=None):
        assert _barrier_divisions(scalify.scalify(lambda a: a * a), x) == 2


def _float16_product():
    """A product of two float16 tensors (measured placement, `rules.common.place_measured`)."""
    x = scalify.scaled_array(np.linspace(-1, 1, 32, dtype=np.float16).reshape(4, 8), 2.0**-3)
    y = scalify.scaled_array(np.linspace(1, 2, 32, dtype=np.float16).reshape(4, 8), 2.0**5)
    return scalify.scalify(lambda a, b: a * b), x, y


@pytest.mark.usefixtures("arguments_as_given")
def test_a_measured_placement_cuts_the_scale_it_makes():
    """The output scale of a measured placement is the barrier's division itself: its
    consumers read it rather than re-compute the product scale and the factor behind it."""
    fn, x, y = _float16_product()
    with scalify.ScalifyConfig(scale_barrier=16):
        jaxpr = jax.make_jaxpr(fn)(x, y)
        out = fn(x, y)
    made_by = {v: e for e in jaxpr.eqns for v in e.outvars}
    scale = made_by[jaxpr.jaxpr.outvars[1]]
    assert scale.primitive is jax.lax.div_p and scale.outvars[0].aval.ndim == 0, scale
    exact = np.asarray(x.to_array(), np.float32) * np.asarray(y.to_array(), np.float32)
    np.testing.assert_array_equal(np.asarray(out.to_array(), np.float32), exact.astype(np.float16))


@pytest.mark.usefixtures("arguments_as_given")
def test_scale_barrier_skips_a_scale_that_was_cut_where_it_was_made():
    fn, x, y = _float16_product()
    with scalify.ScalifyConfig(scale_barrier=1):
        assert _barrier_divisions(fn, x, y) == 1


@pytest.mark.parametrize("bad", [-1, 1.5, "8"])
def test_scale_barrier_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="scale_barrier"):
        scalify.ScalifyConfig(scale_barrier=bad)


# ---------------------------------------------------------------------------------------
# Data barrier (ScalifyConfig.data_barrier)
# ---------------------------------------------------------------------------------------
def _full_shape_divisions(fn, ws, x) -> int:
    # divisions of the data's shape (the input guard divides its 1-d vector of scales)
    return sum(1 for e in jax.make_jaxpr(fn)(ws, x).eqns
               if e.primitive is jax.lax.div_p and e.outvars[0].aval.shape == x.shape)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_data_barrier_computes_a_narrow_residual_stream_once(dtype):
    """The sums of narrow data are computed in float32 between a widening and a narrowing
    convert; XLA:CPU copies a chain of them into every fusion that reads any value of it
    (quadratic in depth). The data barrier divides each sum by the run-time one: the same
    values, a program that grows linearly."""
    from scalify.inspect import hlo_instruction_count

    sizes, outs, divisions = {}, {}, {}
    for on in (False, True):
        for n in (4, 8):
            fn, ws, x = residual_chain(n, dtype)  # a new function: jax.jit caches its traces
            with scalify.ScalifyConfig(data_barrier=on):
                compiled = jax.jit(fn).lower(ws, x).compile()
                sizes[on, n] = hlo_instruction_count(compiled)
                outs[on, n] = compiled(ws, x)
                divisions[on, n] = _full_shape_divisions(fn, ws, x)
                if n == 4:  # eagerly too (jit and eager sum in different orders)
                    outs[on, "eager"] = fn(ws, x)
    for n in (4, 8, "eager"):
        chex.assert_trees_all_equal(outs[True, n], outs[False, n])
    for n in (4, 8):
        assert divisions[False, n] == 0 and divisions[True, n] == n  # one per residual add
    # Measured (jax 0.10, CPU): 523 -> 1,675 instructions from 4 to 8 layers without the
    # barrier (3.2x for 2x the layers), 318 -> 656 with it (2.06x).
    assert sizes[False, 8] > 2.8 * sizes[False, 4]
    assert sizes[True, 8] < 2.3 * sizes[True, 4]
    assert sizes[True, 8] < 0.5 * sizes[False, 8]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float8_e4m3fn])
def test_data_barrier_at_extreme_scales(dtype):
    """x <- x * w + x is linear in x: with x at scale 2^-40 or 2^40 the stream's data are
    those at scale 1 and its scale moves by the same power of two, barrier on or off,
    eagerly and under jit (float16 or FP8 alone would flush or overflow at these values)."""
    def f(ws, x):
        for w in ws:
            x = x * w + x
        return x

    ws = [scalify.scaled_array(np.full((8, 8), 0.5 + i / 8), 1.0, dtype=dtype) for i in range(3)]
    outs = {}
    for on in (False, True):
        for s in (2.0**-40, 1.0, 2.0**40):
            x = scalify.scaled_array(np.linspace(-1, 1, 64).reshape(8, 8), s, dtype=dtype)
            with scalify.ScalifyConfig(data_barrier=on, input_drift_window=None):
                fn = scalify.scalify(f)
                outs[on, s] = (fn(ws, x), jax.jit(fn)(ws, x))
    for on in (False, True):
        for s in (2.0**-40, 2.0**40):
            for eager_or_jit in (0, 1):
                got, unit = outs[on, s][eager_or_jit], outs[on, 1.0][eager_or_jit]
                np.testing.assert_array_equal(np.asarray(got.data, np.float32), np.asarray(unit.data, np.float32))
                assert float(got.scale) == s * float(unit.scale)
                chex.assert_trees_all_equal(got, outs[not on, s][eager_or_jit])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_data_barrier_leaves_float32_and_bfloat16_sums_as_they_are(dtype):
    # float32 sums are not computed between converts; XLA:CPU does not copy bfloat16 chains.
    fn, ws, x = residual_chain(3, dtype)
    with scalify.ScalifyConfig(data_barrier=True):
        assert _full_shape_divisions(fn, ws, x) == 0


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_data_barrier_rejects_non_bool_values(bad):
    with pytest.raises(ValueError, match="data_barrier must be a bool"):
        scalify.ScalifyConfig(data_barrier=bad)


# -- differentiating a scalified function from outside ------------------------------------
def _cubic(a):
    return a * a * a + a


def test_outer_grad_wrt_scaled_input_is_the_value_gradient():
    x_plain = np.array([0.5, -1.25, 2.0, 3.0], np.float32)
    want = 3 * x_plain**2 + 1
    for scale in (1.0, 2.0**-7, 2.0**9):
        x = scalify.as_scaled_array(x_plain, scale=scale)
        loss = lambda a: scalify.scalify(_cubic)(a).to_array().sum()  # noqa: E731
        for grad in (jax.grad(loss), jax.jit(jax.grad(loss))):
            g = grad(x)
            assert isinstance(g, ScaledArray)
            np.testing.assert_allclose(g.to_array(), want, rtol=1e-6)
            # the data slot is the pytree derivative d/d data = dL/dx * scale
            np.testing.assert_allclose(g.data, want * scale, rtol=1e-6)


def test_outer_grad_through_the_data_of_a_scaled_array_matches_plain_jax():
    """A ScaledArray built from a differentiated plain array: the chain rule goes through
    the data slot and gives plain JAX's gradient."""
    w = np.array([[0.5, -1.0], [2.0, 0.25]], np.float32)
    s = 2.0**-4

    def loss(w, x):
        out = scalify.scalify(lambda a, b: jnp.tanh(a @ b).sum())(ScaledArray(w, jnp.float32(s)), x)
        return out.to_array() * 3.0

    x = jnp.ones((2, 3), jnp.float32)
    want = jax.grad(lambda w, x: jnp.tanh((w * s) @ x).sum() * 3.0)(w, x)
    np.testing.assert_allclose(jax.grad(loss)(w, x), want, rtol=1e-6)
    # a differentiated plain input next to a scaled one, and a closed-over traced value
    xs = scalify.as_scaled_array(x, scale=2.0**3)
    got = jax.grad(lambda w: scalify.scalify(lambda b: (jnp.sin(w) @ b).sum())(xs).to_array())(w)
    want = jax.grad(lambda w: (jnp.sin(w) @ (x)).sum())(w)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_outer_forward_and_values_are_unchanged_under_grad():
    x = scalify.as_scaled_array(np.array([1.5, -2.0], np.float32), scale=2.0**-3)
    value, g = jax.value_and_grad(lambda a: scalify.scalify(_cubic)(a).to_array().sum())(x)
    np.testing.assert_allclose(value, np.sum(_cubic(x.to_array())), rtol=1e-6)
    np.testing.assert_allclose(g.to_array(), 3 * x.to_array() ** 2 + 1, rtol=1e-6)


def test_outer_grad_of_a_scaled_output_says_what_to_do_and_the_advice_works():
    """`jax.grad(scalify(f))` with `f` returning a ScaledArray: JAX needs an array output.
    scalify's error names both fixes, and both give plain JAX's gradient."""
    x = scalify.as_scaled_array(np.array([1.5, -2.0, 0.25], np.float32), scale=2.0**-5)
    f = lambda a: (a * a * a).sum()  # noqa: E731
    for grad in (jax.grad, jax.value_and_grad):
        with pytest.raises(scalify.OuterTransformError, match=r"to_array\(\)\)`.*scalify\(jax.grad\(f\)\)"):
            grad(scalify.scalify(f))(x)
    want = 3 * x.to_array() ** 2
    outside = jax.grad(lambda a: scalify.scalify(f)(a).to_array())(x)
    inside = scalify.scalify(jax.grad(f))(x)
    np.testing.assert_allclose(outside.to_array(), want, rtol=1e-6)
    np.testing.assert_allclose(inside.to_array(), want, rtol=1e-6)
    # jnp functions outside scalify keep their own message
    with pytest.raises(scalify.ScaledTypeError, match="inside a function transformed"):
        jnp.sin(x)


# -- static arguments and the trace cache ---------------------------------------------------
def test_static_argnums_and_argnames_are_python_values_and_cache_keys():
    x, _ = _xy()
    seen = []

    def f(a, n, *, mode):
        seen.append((type(n), mode))
        assert isinstance(n, int) and isinstance(mode, str)
        return a * float(n) if mode == "mul" else a + float(n)

    sf = scalify.scalify(f, static_argnums=1, static_argnames="mode")
    np.testing.assert_allclose(sf(x, 3, mode="mul").to_array(), x.to_array() * 3, rtol=1e-6)
    np.testing.assert_allclose(sf(x, 3, mode="add").to_array(), x.to_array() + 3, rtol=1e-6)
    sf(x, 3, mode="mul")
    assert len(seen) == 2 and sf.cache_size() == 2
    sf(x, 4, mode="mul")  # a new static value re-traces
    assert len(seen) == 3
    # the same under jit (static values never become tracers)
    out = jax.jit(lambda a: sf(a, 2, mode="mul"))(x)
    np.testing.assert_allclose(out.to_array(), x.to_array() * 2, rtol=1e-6)


def _repeat_and_tile(a, n):
    """`n` as a loop count, a shape and a value."""
    for _ in range(n):
        a = a * 2.0
    return jnp.concatenate([a] * n) + jnp.ones((n * a.shape[0],)) * n


@pytest.mark.parametrize("static", ["argnums", "argnames"])
def test_static_arguments_of_an_outer_jit_are_python_values_inside_scalify(static):
    """`jax.jit(scalify(f), static_argnums=...)` alone: the outer jit passes the Python int
    to scalify, which keeps it a Python value (usable as a shape or a loop count) instead of
    tracing it; results equal plain JAX."""
    x, _ = _xy()
    kw = {"static_argnums": 1} if static == "argnums" else {"static_argnames": "n"}
    sf = jax.jit(scalify.scalify(_repeat_and_tile), **kw)
    plain = jax.jit(_repeat_and_tile, **kw)
    for n in (1, 3):
        got = sf(x, n) if static == "argnums" else sf(x, n=n)
        want = plain(x.to_array(), n) if static == "argnums" else plain(x.to_array(), n=n)
        assert got.shape == want.shape == (n * x.shape[0],) + x.shape[1:]
        np.testing.assert_array_equal(got.to_array(), want)
    # A float static in the outer jit, used as a value (a literal inside scalify).
    f = jax.jit(scalify.scalify(lambda a, c: a * c + c), static_argnums=1)
    np.testing.assert_allclose(f(x, 0.3).to_array(), x.to_array() * 0.3 + 0.3, rtol=1e-6)


def test_python_numbers_stay_traced_when_scalify_is_called_eagerly():
    """Outside any JAX transform, Python numbers are traced as jax.jit traces them: a new
    value does not re-trace."""
    x, _ = _xy()
    sf = scalify.scalify(lambda a, c: a * c)
    for c in (0.5, 1.5, 2.5):
        np.testing.assert_allclose(sf(x, c).to_array(), x.to_array() * c, rtol=1e-6)
    assert sf.cache_size() == 1
    with pytest.raises(jax.errors.TracerIntegerConversionError):
        scalify.scalify(_repeat_and_tile)(x, 2)


def test_unhashable_static_value_is_an_error_naming_the_argument():
    x, _ = _xy()

    class Opts:  # not hashable
        __hash__ = None

    with pytest.raises(scalify.ScaledTypeError, match=r"argument 'opts'.*not hashable.*functools.partial"):
        scalify.scalify(lambda a, opts: a, static_argnames="opts")(x, opts=[1, 2])
    with pytest.raises(scalify.ScaledTypeError, match=r"\[1\].*Opts.*not hashable"):
        scalify.scalify(lambda a, o: a)(x, Opts())


def test_trace_cache_is_bounded():
    x, _ = _xy()
    sf = scalify.scalify(lambda a, n: a * float(n), static_argnums=1)
    for n in range(70):
        sf(x, n)
    assert sf.cache_size() == 64


def test_unsupported_primitive_inside_a_jax_library_function_names_the_user_line():
    import inspect

    x = scalify.as_scaled_array(jnp.eye(3, dtype=jnp.float32) * 4.0)

    def f(a):
        return jnp.linalg.cholesky(a) * 2.0  # the line the error must point at

    line = inspect.getsourcelines(f)[1] + 1
    with pytest.raises(scalify.UnsupportedPrimitiveError, match="cholesky") as info:
        scalify.scalify(f)(x)
    assert f"test_interpreter.py:{line}" in str(info.value)
    # the library function itself scalified: the message names the call site
    with pytest.raises(scalify.UnsupportedPrimitiveError) as info:
        scalify.scalify(jnp.linalg.cholesky)(x)
    msg = str(info.value)
    assert "(at )" not in msg and "cholesky called at" in msg and "test_interpreter.py" in msg


def test_input_guard_reduces_arguments_of_one_shape_together_each_on_its_own_max():
    """The input guard measures every wide-float argument's max |data|; arguments of one
    shape and dtype (a model's layers, an optimizer's moments) are stacked into one
    reduction, each still moved by its own maximum: float32 data at 2^-30, 2^20 and 1 in
    one group leave at unit max-abs data, values unchanged."""
    rng = np.random.RandomState(0)
    exps = (-30, 20, 0)
    xs = [scalify.scaled_array((rng.randn(4, 3) * 2.0**e).astype(np.float32), np.float32(2.0**-e))
          for e in exps]
    odd = scalify.scaled_array(rng.randn(5).astype(np.float32) * np.float32(2.0**40), np.float32(1.0))

    def f(a, b, c, d):
        return a, b, c, d

    jaxpr = jax.make_jaxpr(scalify.scalify(f))(*xs, odd)
    assert str(jaxpr).count("reduce_max") == 2  # one for the (4, 3) group, one for `odd`
    outs = jax.jit(scalify.scalify(f))(*xs, odd)
    for x, o, drifted in zip([*xs, odd], outs, (True, True, False, True)):
        np.testing.assert_array_equal(o.to_array(np.float32), x.to_array(np.float32))
        if drifted:  # moved by its own max to unit max-abs data
            m = float(np.max(np.abs(np.asarray(o.data))))
            assert 1.0 <= m < 2.0, m
        else:  # inside the window [2^-2, 2^2]: left as it is
            np.testing.assert_array_equal(np.asarray(o.data), np.asarray(x.data))


def test_emitted_ops_keep_the_users_name_scope_and_line():
    """Profiles and compiled HLO name the model's ops: what a rule emits carries the
    user's named scope (e.g. Flax's module path) and source line, as plain JAX's ops do."""

    def f(x, y):
        with jax.named_scope("block_0"):
            with jax.named_scope("mlp"):
                h = x * y  # the user's line
            return jnp.tanh(h) + 1.0

    sa = scalify.as_scaled_array(jnp.ones((4, 8)))
    closed = jax.make_jaxpr(scalify.scalify(f))(sa, sa)
    stacks = {e.primitive.name: [] for e in closed.jaxpr.eqns}
    for e in closed.jaxpr.eqns:
        stacks[e.primitive.name].append(str(e.source_info.name_stack))
    assert "block_0/mlp" in stacks["mul"], stacks  # (the input guard's ops come first, unnamed)
    assert stacks["tanh"] == ["block_0"], stacks
    lines = [fr.line_num for e in closed.jaxpr.eqns if e.primitive.name == "mul"
             for fr in (e.source_info.traceback.frames if e.source_info.traceback else ())
             if fr.file_name == __file__]
    assert lines, "the data multiply should point at the test's own line"
    hlo = jax.jit(scalify.scalify(f)).lower(sa, sa).as_text(debug_info=True)
    assert "block_0/mlp" in hlo


@pytest.mark.usefixtures("metadata_in_cache_key")
def test_rule_scopes_name_each_rules_operations_and_change_nothing_else():
    """ScalifyConfig(rule_scopes=True): the compiled program's op names carry
    "scalify.<primitive>" for the operations each rule emitted; the values are the same, and
    the default names no rule."""
    import re

    def f(x, y):
        return jnp.sum(jnp.tanh(x * y + 1.0))

    x = scalify.scaled_array(np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8), 2.0**-3)
    y = scalify.scaled_array(np.full((4, 8), 0.5, np.float32), 2.0**4)
    outs, names = [], []
    for on in (False, True):
        with scalify.ScalifyConfig(rule_scopes=on):
            step = jax.jit(scalify.scalify(f))
            outs.append(np.asarray(step(x, y).to_array()))
            names.append(set(re.findall(r"scalify\.[a-z_]+", step.lower(x, y).compile().as_text())))
    assert names[0] == set()
    assert {"scalify.mul", "scalify.add", "scalify.tanh", "scalify.reduce_sum"} <= names[1]
    np.testing.assert_array_equal(outs[0], outs[1])
