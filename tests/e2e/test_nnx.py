"""Flax NNX modules and optimizers through `scalify`: in-place semantics, as with `nnx.jit`.

float32 with ScaledArray params trains as plain NNX: losses equal to 1e-6 relative. The
parameters are compared at rtol 1e-6 plus atol 1e-5 * lr: the two programs are fused
differently by XLA, so gradients differ in their last bits, and Adam normalises each
gradient component (m / sqrt(v)), so a component whose gradient is a near-cancelling sum
(a bias) moves by ~lr whatever its size; its last-bit gradient difference becomes an update
difference relative to lr, not to the (possibly near-zero) parameter.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import scalify
from scalify.core.errors import ScaledTypeError

LR = 1e-3


class MLP(nnx.Module):
    def __init__(self, rngs, dropout=0.0):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.gelu(self.l1(x))))


def _data(dtype=jnp.float32):
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8)).astype(dtype)
    y = jax.random.normal(jax.random.PRNGKey(2), (16, 4)).astype(dtype)
    return x, y


def step(model, optimizer, x, y):
    def loss_fn(model):
        return jnp.mean(jnp.square(model(x) - y))

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _scaled_model(seed=0):
    model = MLP(nnx.Rngs(seed))
    nnx.update(model, scalify.as_scaled_array(nnx.state(model, nnx.Param)))
    return model


def _params(model):
    return jax.tree.leaves(scalify.asarray(nnx.state(model, nnx.Param)))


def _linear():
    return nnx.Linear(8, 4, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("wrap", ["scalify", "scalify(nnx.jit)"])
def test_step_updates_model_and_optimizer_in_place(wrap):
    """The silent no-op is gone: optimizer.update inside scalify changes the caller's model
    and optimizer (plain params: bit-identical to the plain NNX step)."""
    ref, model = _linear(), _linear()
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    before = _params(model)
    s_step = scalify.scalify(step) if wrap == "scalify" else scalify.scalify(nnx.jit(step))
    loss = s_step(model, opt, *_data())
    ref_loss = (step if wrap == "scalify" else nnx.jit(step))(ref, ref_opt, *_data())
    assert int(opt.step.get_value()) == 1
    assert float(loss) == float(ref_loss)
    for a, b, b0 in zip(_params(model), _params(ref), before):
        assert not np.array_equal(a, b0)
        np.testing.assert_array_equal(a, b)


def test_adam_training_loop_float32_equals_plain_nnx():
    ref = MLP(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.adam(LR), wrt=nnx.Param)
    model = _scaled_model()
    opt = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    ref_step = nnx.jit(step)
    s_step = nnx.jit(scalify.scalify(step))
    x, y = _data()
    for _ in range(3):
        ref_loss = ref_step(ref, ref_opt, x, y)
        loss = s_step(model, opt, x, y)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert int(opt.step.get_value()) == 3
    assert isinstance(model.l1.kernel.get_value(), scalify.ScaledArray)  # still scaled
    for got, want in zip(_params(model), _params(ref)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5 * LR)


def test_returned_argument_nodes_are_the_callers():
    """`return model, optimizer, loss` (the pytree style) returns the caller's objects,
    updated, as nnx.jit does."""
    model = _linear()
    nnx.update(model, scalify.as_scaled_array(nnx.state(model, nnx.Param)))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def step_returning(model, optimizer, x, y):
        return model, optimizer, step(model, optimizer, x, y)

    out_model, out_opt, loss = scalify.scalify(step_returning)(model, opt, *_data())
    assert out_model is model and out_opt is opt
    assert int(opt.step.get_value()) == 1 and np.isfinite(float(loss))


def test_jax_jit_around_returns_the_updated_nodes():
    """jax.jit runs the function on pytree copies of the modules (in-place updates stay
    inside, as without scalify); a step that returns the nodes trains under jax.jit."""
    ref, model = _linear(), _linear()
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def step_returning(model, optimizer, x, y):
        return model, optimizer, step(model, optimizer, x, y)

    new_model, new_opt, loss = jax.jit(scalify.scalify(step_returning))(model, opt, *_data())
    ref_loss = step(ref, ref_opt, *_data())
    assert int(new_opt.step.get_value()) == 1 and new_model is not model
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)  # jit vs eager order
    for a, b in zip(_params(new_model), _params(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_shared_variables_and_rng_state():
    """A Variable shared by two modules is updated once and stays shared; the dropout RNG
    count advances in place, so two calls draw different masks."""
    model = MLP(nnx.Rngs(0), dropout=0.5)
    model.l1_alias = model.l1  # the same Linear under two names
    x, _ = _data()
    fwd = scalify.scalify(lambda m, x: m(x))
    a, b = fwd(model, x), fwd(model, x)
    assert not np.array_equal(np.asarray(a), np.asarray(b))

    def bump(model):
        model.l1.bias.set_value(model.l1.bias.get_value() + 1.0)

    scalify.scalify(bump)(model)
    assert model.l1_alias is model.l1
    np.testing.assert_array_equal(model.l1_alias.bias.get_value(), np.ones(16, np.float32))


def test_module_or_bound_method_as_the_function():
    """scalify(module) and scalify(module.method) pass the module as an argument: its
    ScaledArray params are traced (not captured as constants, where operators on them
    would fail) and its RNG state advances in place."""
    model = _linear()
    nnx.update(model, scalify.as_scaled_array(nnx.state(model, nnx.Param)))
    x, _ = _data()
    ref = _linear()
    np.testing.assert_allclose(np.asarray(scalify.scalify(model)(x)), np.asarray(ref(x)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(scalify.scalify(model.__call__)(x)), np.asarray(ref(x)), rtol=1e-6)
    drop = nnx.Dropout(0.5, rngs=nnx.Rngs(3))
    f = scalify.scalify(drop)
    assert not np.array_equal(np.asarray(f(x)), np.asarray(f(x)))
    assert int(drop.rngs.count.get_value()) == 2


def test_structural_change_raises():
    model = MLP(nnx.Rngs(0))

    def grow(model):
        model.extra = nnx.Param(jnp.zeros(3))

    with pytest.raises(ScaledTypeError, match="changed the structure of an NNX argument"):
        scalify.scalify(grow)(model)


def test_float16_compute_training_close_to_float32():
    """A linear layer's params as float16 data with power-of-two scales, float16 inputs: the
    scalified Adam loop stays finite and within float16's rounding of the float32 loop."""
    old = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", None)  # XLA:CPU: no "highest" f16 dots
    try:
        ref, model = _linear(), _linear()
        ref_opt = nnx.Optimizer(ref, optax.adam(LR), wrt=nnx.Param)
        nnx.update(model, scalify.as_scaled_array(nnx.state(model, nnx.Param)))
        nnx.update(model, jax.tree.map(lambda p: p.astype(jnp.float16), nnx.state(model, nnx.Param),
                                       is_leaf=scalify.is_scaled_leaf))
        opt = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
        s_step, ref_step = nnx.jit(scalify.scalify(step)), nnx.jit(step)
        for _ in range(2):
            ref_loss = ref_step(ref, ref_opt, *_data())
            loss = s_step(model, opt, *_data(jnp.float16))
            assert model.kernel.get_value().dtype == jnp.float16
            # float16 data: a relative rounding of 2^-11 per op, a few dozen ops deep
            np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-2)
        for got, want in zip(_params(model), _params(ref)):
            got = np.asarray(got, np.float32)
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-3)
    finally:
        jax.config.update("jax_default_matmul_precision", old)
