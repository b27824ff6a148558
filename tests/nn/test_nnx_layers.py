"""scalify.nn.nnx: the linen scalify.nn layers' math with NNX parameters."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import scalify
from scalify.nn import Dense as LinenDense
from scalify.nn import LayerNorm as LinenLayerNorm
from scalify.nn import nnx as snnx
from scalify.ops.fp8 import E4M3, E5M2

RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.standard_normal((4, 32)), jnp.float32)
ROLES = dict(input_dtype=E4M3, kernel_dtype=E4M3, grad_dtype=E5M2, output_dtype=jnp.bfloat16)


def test_default_is_nnx_linear():
    layer, ref = snnx.Dense(32, 16, rngs=nnx.Rngs(0)), nnx.Linear(32, 16, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(layer.kernel[...], ref.kernel[...])
    np.testing.assert_array_equal(layer(X), ref(X))


@pytest.mark.parametrize("roles,layout", [({}, "in_out"), (dict(ROLES, scaling="jit"), "out_in")],
                         ids=["plain", "fp8-jit-out_in"])
def test_same_as_linen_dense_inside_scalify(roles, layout):
    """Same params, scaled: the scalified output and gradients equal the linen layer's."""
    layer = snnx.Dense(32, 16, kernel_layout=layout, rngs=nnx.Rngs(0), **roles)
    nnx.update(layer, scalify.as_scaled_array(nnx.state(layer, nnx.Param)))
    linen = LinenDense(16, kernel_layout=layout, **roles)
    params = {"kernel": layer.kernel.get_value(), "bias": layer.bias.get_value()}

    def nnx_loss(layer, x):
        return jnp.sum(jnp.square(layer(x).astype(jnp.float32)))

    def linen_loss(params, x):
        return jnp.sum(jnp.square(linen.apply({"params": params}, x).astype(jnp.float32)))

    gdef, state = nnx.split(layer)
    got = jax.jit(scalify.scalify(lambda p, x: jax.value_and_grad(nnx_loss)(nnx.merge(gdef, p), x)))
    loss, grads = got(state, X)
    ref_loss, ref_grads = jax.jit(scalify.scalify(jax.value_and_grad(linen_loss)))(params, X)
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(ref_loss))
    for name in ("kernel", "bias"):
        np.testing.assert_array_equal(np.asarray(getattr(grads, name).get_value()),
                                      np.asarray(ref_grads[name]))


def test_fp8_training_step_in_place():
    """An FP8 NNX model trained with nnx.jit(scalify(step)): params updated in place,
    loss decreasing."""
    fp8 = functools.partial(snnx.Dense, **ROLES, scaling="jit")
    model = nnx.Sequential(fp8(32, 32, rngs=nnx.Rngs(0)), jax.nn.relu, fp8(32, 4, rngs=nnx.Rngs(1)))
    nnx.update(model, scalify.as_scaled_array(nnx.state(model, nnx.Param)))
    opt = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
    y = jnp.asarray(RNG.standard_normal((4, 4)), jnp.float32)

    @nnx.jit
    @scalify.scalify
    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(jnp.square(m(x).astype(jnp.float32) - y)))(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, X, y)) for _ in range(3)]
    assert int(opt.step.get_value()) == 3
    assert losses[2] < losses[0]


def test_delayed_scaling_is_linen_only():
    with pytest.raises(ValueError, match="does not support delayed scaling"):
        snnx.Dense(32, 16, scaling="delayed", rngs=nnx.Rngs(0))


def test_layer_norm_same_as_linen_inside_scalify():
    x = scalify.as_scaled_array(X * 2.0**20)  # scaled far from 1: the scaled rule normalises data
    layer = snnx.LayerNorm(32, grad_rescale=True, rngs=nnx.Rngs(0))
    linen = LinenLayerNorm(grad_rescale=True)
    v = linen.init(jax.random.PRNGKey(0), X)
    f = scalify.scalify(lambda m, x: m(x))
    np.testing.assert_array_equal(np.asarray(f(layer, x)), np.asarray(scalify.scalify(linen.apply)(v, x)))
    np.testing.assert_allclose(np.asarray(layer(X)), np.asarray(nnx.LayerNorm(32, rngs=nnx.Rngs(0))(X)),
                               rtol=1e-5, atol=1e-5)
