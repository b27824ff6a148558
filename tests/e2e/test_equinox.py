"""Equinox modules through `scalify`: inside an `eqx.Module` only arrays are traced, as with
`eqx.filter_jit` (Python fields such as a dropout rate stay Python values).

float32 with ScaledArray params trains as plain Equinox: losses equal to 1e-6 relative,
parameters at rtol 1e-6 plus atol 1e-5 * lr (Adam normalises each gradient component, so a
near-cancelling gradient's last-bit difference between the two differently fused programs
moves a parameter by a fraction of lr, not of the parameter: see tests/e2e/test_nnx.py).
"""
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scalify

LR = 1e-3


class Model(eqx.Module):
    mlp: eqx.nn.MLP
    drop: eqx.nn.Dropout
    temperature: float  # a Python field, read as a Python value

    def __init__(self, key):
        self.mlp = eqx.nn.MLP(8, 4, 16, depth=1, activation=jax.nn.gelu, key=key)
        self.drop = eqx.nn.Dropout(p=0.0)
        self.temperature = 2.0

    def __call__(self, x):
        if self.temperature <= 0:  # Python control flow on the field
            raise ValueError("temperature must be positive")
        return self.drop(self.mlp(x)) / self.temperature


def _data():
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    y = jax.random.normal(jax.random.PRNGKey(2), (16, 4))
    return x, y


def loss_fn(model, x, y):
    return jnp.mean(jnp.square(jax.vmap(model)(x) - y))


def make_step(opt):
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


def test_multihead_attention_with_python_dropout_rate():
    """MultiheadAttention keeps `dropout_p=0.0` in a Python field: traced, Dropout would ask
    for a key; static, the scalified attention equals plain Equinox."""
    mha = eqx.nn.MultiheadAttention(2, 8, key=jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 8))
    f = eqx.filter_jit(scalify.scalify(lambda m, x: m(x, x, x)))
    # Equal up to float32 rounding: the scalified call is one compiled program, the plain
    # one runs op by op (a GPU fuses and orders the sums differently: a few ulp).
    np.testing.assert_allclose(np.asarray(f(mha, x)), np.asarray(mha(x, x, x)), rtol=1e-6, atol=1e-7)
    out = f(scalify.as_scaled_array(mha), x)
    assert isinstance(out, scalify.ScaledArray)
    np.testing.assert_allclose(np.asarray(out), np.asarray(mha(x, x, x)), rtol=1e-5, atol=1e-6)


def test_module_as_the_function():
    """scalify(model) passes the module as an argument (as eqx.filter_jit(model) does):
    its ScaledArray arrays are traced, its Python fields static."""
    ref = Model(jax.random.PRNGKey(0))
    x = jnp.ones(8)
    out = scalify.scalify(scalify.as_scaled_array(ref))(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref(x)), rtol=1e-6)


def test_as_scaled_array_converts_only_module_arrays():
    model = scalify.as_scaled_array(Model(jax.random.PRNGKey(0)))
    assert isinstance(model.mlp.layers[0].weight, scalify.ScaledArray)
    assert model.temperature == 2.0 and type(model.temperature) is float
    assert model.drop.p == 0.0 and type(model.drop.p) is float
    assert scalify.as_scaled_array(1.5).scale == 1  # outside modules, Python floats split


def test_python_fields_static_python_arguments_traced():
    """A Python field of a module is part of the cache key; a Python number passed as an
    argument is traced (one trace for every learning rate, as jax.jit)."""
    f = scalify.scalify(lambda m, x, lr: m(x) * lr)
    model, x = Model(jax.random.PRNGKey(0)), jnp.ones(8)
    f(model, x, 0.1)
    f(model, x, 0.2)
    assert f.cache_size() == 1
    hotter = eqx.tree_at(lambda m: m.temperature, model, 4.0)
    np.testing.assert_allclose(np.asarray(f(hotter, x, 1.0)), np.asarray(model(x)) / 2, rtol=1e-6)
    assert f.cache_size() == 2


def test_adam_training_loop_float32_equals_plain_equinox():
    opt = optax.adam(LR)
    step = make_step(opt)
    ref = Model(jax.random.PRNGKey(0))
    model = scalify.as_scaled_array(ref)
    ref_state = opt.init(eqx.filter(ref, eqx.is_array))
    state = opt.init(eqx.filter(model, eqx.is_array))
    ref_step, s_step = eqx.filter_jit(step), eqx.filter_jit(scalify.scalify(step))
    x, y = _data()
    for _ in range(3):
        ref, ref_state, ref_loss = ref_step(ref, ref_state, x, y)
        model, state, loss = s_step(model, state, x, y)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert isinstance(model.mlp.layers[0].weight, scalify.ScaledArray)  # still scaled
    assert type(model.temperature) is float and model.mlp.activation is jax.nn.gelu
    got = jax.tree.leaves(eqx.filter(scalify.asarray(model), eqx.is_array))
    want = jax.tree.leaves(eqx.filter(ref, eqx.is_array))
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-5 * LR)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes need Python 3.11")
def test_traced_python_number_error_names_scalify_and_the_fix():
    """A Python number outside a module is traced; a function that needs it as a Python
    value fails in JAX, and the error says that scalify traced it and how to make it
    static."""

    def scaled_by(x, rate):
        return x if rate == 0 else x * rate

    with pytest.raises(jax.errors.TracerBoolConversionError) as err:
        scalify.scalify(scaled_by)(jnp.ones(3), 0.0)
    note = "\n".join(getattr(err.value, "__notes__", []))
    assert "scalify(scaled_by) traced the Python number(s) at args[1]" in note
    assert "static_argnums" in note
    out = scalify.scalify(scaled_by, static_argnums=1)(jnp.ones(3), 0.0)
    np.testing.assert_array_equal(np.asarray(out), np.ones(3))
