"""Stock Flax NNX and Equinox models, written as their users write them, through `scalify`.

The NNX model is a pre-LayerNorm transformer block of `nnx.Linear`, `nnx.LayerNorm` and
`nnx.MultiHeadAttention` (causal mask), trained with `nnx.Optimizer` under
`nnx.jit(scalify.scalify(step))` (in place); the Equinox models are `eqx.nn.MLP` and a
transformer block of `eqx.nn.Linear`, `eqx.nn.LayerNorm`, `eqx.nn.MultiheadAttention` and
`eqx.nn.MLP` (per-example modules, `jax.vmap` over the batch), trained under
`eqx.filter_jit(scalify.scalify(step))` (docs/frameworks.md).

- float32 with ScaledArray params equals plain JAX after several steps of Adam, AdamW,
  SGD with momentum and Lion: the loss to 1e-5 at every step, the params to 1e-5 of the
  largest param on every element whose first gradient is above float32 noise (as in
  tests/e2e/test_model_zoo.py: the attention key bias has a zero gradient, computed as
  noise, which Adam-like updates turn into steps of size lr).
- FP16 compute (NNX `dtype=float16`; Equinox: the model cast to float16 inside the loss,
  float32 masters) trains a teacher-student task like float32 (held-out loss within 1%),
  and its gradients of a loss multiplied by 2^-20 keep every leaf float32 has (no loss
  scaling).
- FP16 masters (`scalify.optim.scaled_params` + `apply_updates` with stochastic rounding)
  train within 2% of float32. `scalify.nn.fp8_everywhere()` intercepts Flax linen modules
  only: an NNX model gets FP8 matmuls through `nnx.Linear(dot_general=
  scalify.nn.fp8_dot_general)` (tested here); an Equinox `Linear` computes `weight @ x`
  with no hook for the contraction, so Equinox has no FP8 swap.
"""
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import scalify
import scalify.optim as so

SEQ, D_IN, WIDTH, HEADS = 8, 8, 32, 4
OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=1e-2),
    "sgd-momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "lion": lambda: optax.lion(1e-4),
}
STEPS = 4


# ---------------------------------------------------------------------------------------
# The models, as users write them
# ---------------------------------------------------------------------------------------
class NnxTransformer(nnx.Module):
    def __init__(self, d_in, width, heads, *, dtype=None, dot_general=jax.lax.dot_general, rngs):
        linear = lambda i, o: nnx.Linear(i, o, dtype=dtype, dot_general=dot_general, rngs=rngs)  # noqa: E731
        self.embed = linear(d_in, width)
        self.ln1 = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, width, dtype=dtype, decode=False,
                                           qkv_dot_general=dot_general, out_dot_general=dot_general,
                                           rngs=rngs)
        self.ln2 = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
        self.up, self.down = linear(width, 2 * width), linear(2 * width, width)
        self.ln_f = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
        self.head = linear(width, 1)

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = self.embed(x)
        x = x + self.attn(self.ln1(x), mask=mask)
        x = x + self.down(nnx.gelu(self.up(self.ln2(x))))
        return self.head(self.ln_f(x)).mean(axis=1).astype(jnp.float32)


class EqxTransformer(eqx.Module):
    embed: eqx.nn.Linear
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    ln_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, d_in, width, heads, key):
        k = jax.random.split(key, 4)
        self.embed = eqx.nn.Linear(d_in, width, key=k[0])
        self.ln1, self.ln2, self.ln_f = (eqx.nn.LayerNorm(width) for _ in range(3))
        self.attn = eqx.nn.MultiheadAttention(heads, width, use_query_bias=True, use_key_bias=True,
                                              use_value_bias=True, use_output_bias=True, key=k[1])
        self.mlp = eqx.nn.MLP(width, width, 2 * width, depth=1, activation=jax.nn.gelu, key=k[2])
        self.head = eqx.nn.Linear(width, 1, key=k[3])

    def __call__(self, x):  # one sequence (SEQ, d_in) -> (1,)
        x = jax.vmap(self.embed)(x)
        mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=mask)
        x = x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))
        return jax.vmap(self.head)(jax.vmap(self.ln_f)(x)).mean(axis=0)


def _eqx_mlp(key):
    return eqx.nn.MLP(D_IN, 1, 32, depth=8, activation=jax.nn.gelu, key=key)


EQX_MODELS = {"eqx-mlp": (_eqx_mlp, (D_IN,)),
              "eqx-transformer": (lambda key: EqxTransformer(D_IN, WIDTH, HEADS, key), (SEQ, D_IN))}


def _nnx_model(seed, **kw):
    return NnxTransformer(D_IN, WIDTH, HEADS, rngs=nnx.Rngs(seed), **kw)


def _batch(shape, n=16, seed=1):
    x = jax.random.normal(jax.random.PRNGKey(seed), (n,) + shape)
    y = jax.random.normal(jax.random.PRNGKey(seed + 1), (n, 1))
    return x, y


# ---------------------------------------------------------------------------------------
# Comparison helpers (as in tests/e2e/test_model_zoo.py)
# ---------------------------------------------------------------------------------------
def _leaves(tree):
    return [np.asarray(t, np.float64) for t in jax.tree.leaves(scalify.asarray(tree))]


def _error(plain, scaled, grads):
    """max |plain - scaled| over the elements whose gradient is above float32 noise
    (> 2^-20 of the largest gradient), relative to the largest parameter magnitude."""
    plain, scaled, grads = _leaves(plain), _leaves(scaled), _leaves(grads)
    assert len(plain) == len(scaled) == len(grads)
    largest = max(np.abs(a).max() for a in plain)
    gmax = max(np.abs(g).max() for g in grads)
    return max(np.where(np.abs(g) > gmax * 2.0**-20, np.abs(a - b), 0).max()
               for a, b, g in zip(plain, scaled, grads)) / largest


def _mse(pred, y):
    return jnp.mean((pred - y) ** 2)


# ---------------------------------------------------------------------------------------
# float32: equal to plain JAX, every optimizer
# ---------------------------------------------------------------------------------------
def _nnx_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: _mse(m(x), y))(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_nnx_float32_training_equals_plain(opt_name):
    x, y = _batch((SEQ, D_IN))
    ref, model = _nnx_model(0), _nnx_model(0)
    first_grads = nnx.grad(lambda m: _mse(m(x), y))(_nnx_model(0))
    nnx.update(model, scalify.as_scaled_array(nnx.state(model, nnx.Param)))
    ref_opt = nnx.Optimizer(ref, OPTIMIZERS[opt_name](), wrt=nnx.Param)
    opt = nnx.Optimizer(model, OPTIMIZERS[opt_name](), wrt=nnx.Param)
    ref_step, step = nnx.jit(_nnx_step), nnx.jit(scalify.scalify(_nnx_step))
    for _ in range(STEPS):
        ref_loss, loss = ref_step(ref, ref_opt, x, y), step(model, opt, x, y)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert isinstance(model.attn.query.kernel.get_value(), scalify.ScaledArray)
    assert _error(nnx.state(ref, nnx.Param), nnx.state(model, nnx.Param), first_grads) <= 1e-5


def _eqx_loss(model, x, y):
    return _mse(jax.vmap(model)(x), y)


def _eqx_step(opt):
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(_eqx_loss)(model, x, y)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


@pytest.mark.parametrize("model_name,opt_name", [("eqx-transformer", o) for o in sorted(OPTIMIZERS)]
                         + [("eqx-mlp", "adam")])
def test_equinox_float32_training_equals_plain(model_name, opt_name):
    make, shape = EQX_MODELS[model_name]
    x, y = _batch(shape)
    ref = make(jax.random.PRNGKey(0))
    first_grads = eqx.filter_grad(_eqx_loss)(ref, x, y)
    model = scalify.as_scaled_array(ref)
    opt = OPTIMIZERS[opt_name]()
    ref_state, state = opt.init(eqx.filter(ref, eqx.is_array)), opt.init(eqx.filter(model, eqx.is_array))
    ref_step, step = eqx.filter_jit(_eqx_step(opt)), eqx.filter_jit(scalify.scalify(_eqx_step(opt)))
    for _ in range(STEPS):
        ref, ref_state, ref_loss = ref_step(ref, ref_state, x, y)
        model, state, loss = step(model, state, x, y)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert any(isinstance(t, scalify.ScaledArray) for t in jax.tree.leaves(model, is_leaf=scalify.is_scaled_leaf))
    arrays = lambda m: eqx.filter(m, eqx.is_array)  # noqa: E731
    assert _error(arrays(ref), arrays(model), arrays(first_grads)) <= 1e-5
