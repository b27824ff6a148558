"""Whole training steps under scalify match the plain steps (model invariance, float32).

A Flax linen GPT block (embedding lookup, causal self-attention with a -inf mask,
LayerNorm, GELU tanh and erf, residuals, tied head) + cross-entropy + value_and_grad +
optax.adamw, scalified as one function (the paper's Algorithm 1), plus nn.scan over layers,
jax.checkpoint, and a Flax NNX model.
"""
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scalify

VOCAB, SEQ, D, HEADS = 32, 8, 16, 2


class Block(nn.Module):
    approximate: bool = True

    @nn.compact
    def __call__(self, x, _=None):
        b, t, d = x.shape
        h = nn.LayerNorm()(x)
        qkv = nn.Dense(3 * d)(h).reshape(b, t, 3, HEADS, d // HEADS)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // HEADS)
        mask = jnp.tril(jnp.ones((t, t), bool))
        att = jax.nn.softmax(jnp.where(mask, att, -jnp.inf), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
        x = x + nn.Dense(d)(y)
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * d)(h)
        h = jax.nn.gelu(h, approximate=self.approximate)
        return x + nn.Dense(d)(h), None


class TinyGPT(nn.Module):
    scan: bool = False
    remat: bool = False

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, D)
        pos = self.param("pos", nn.initializers.normal(0.02), (SEQ, D))
        x = embed(tokens) + pos[None, : tokens.shape[1]]
        block = nn.remat(Block) if self.remat else Block
        if self.scan:
            x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)()(x, None)
        else:
            x, _ = block(approximate=True)(x)
            x, _ = block(approximate=False)(x)
        x = nn.LayerNorm()(x)
        return embed.attend(x)


def _loss(model, params, tokens, targets):
    logits = model.apply(params, tokens)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def _make_step(model, opt):
    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(functools.partial(_loss, model))(params, tokens, targets)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _data():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (2, SEQ + 1))
    return jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])


def _init(model, seed, tokens):
    """The model's initial parameters, jitted (op by op, every primitive of Flax's init
    would compile a program of its own)."""
    return jax.jit(model.init)(jax.random.PRNGKey(seed), tokens)


def _scaled_params(params):
    """Scaled params with a different power-of-two scale per leaf (!= 1)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    scales = [2.0 ** (3 * (i % 5) - 6) for i in range(len(leaves))]
    return jax.tree_util.tree_unflatten(
        treedef, [scalify.as_scaled_array(x, scale=s) for x, s in zip(leaves, scales)]
    )


@pytest.mark.parametrize(
    "variant",
    [
        "plain",
        "scan",
        "remat",
    ],
)
def test_scalified_training_step_matches_plain_step(variant):
    model = TinyGPT(scan=variant == "scan", remat=variant == "remat")
    tokens, targets = _data()
    params = _init(model, 0, tokens)
    # eps well above rounding noise: the attention key bias has an exactly-zero true
    # gradient, and Adam with a tiny eps turns its ~1e-9 rounding noise (which differs with
    # any change of summation order, scalify or not) into +-lr updates. The scan and remat
    # variants check the model's transforms: they take SGD with momentum, whose scalified
    # update compiles in half the time of AdamW's (checked once, in "plain").
    if variant == "plain":
        opt = optax.adamw(1e-2, eps=1e-4, weight_decay=0.1)
    else:
        opt = optax.sgd(1e-2, momentum=0.9)
    opt_state = opt.init(params)
    step = _make_step(model, opt)

    ref_params, ref_state, ref_loss = jax.jit(step)(params, opt_state, tokens, targets)
    sparams = _scaled_params(params)
    new_params, new_state, loss = jax.jit(scalify.scalify(step))(sparams, opt_state, tokens, targets)

    np.testing.assert_allclose(scalify.asarray(loss), ref_loss, rtol=1e-6)
    # Adam's first update is lr * g / (|g| + eps): float32 noise dg in a gradient (~3e-7,
    # the moments below match to 1e-7) moves it by up to lr * dg / eps = 3e-5 where g ~ 0
    # (e.g. the zero-gradient key bias). atol 5e-5 on updates of size lr = 1e-2.
    chex.assert_trees_all_close(scalify.asarray(new_params), ref_params, rtol=1e-5, atol=5e-5)
    chex.assert_trees_all_close(scalify.asarray(new_state), ref_state, rtol=1e-5, atol=1e-7)
    assert all(isinstance(x, scalify.ScaledArray)
               for x in jax.tree_util.tree_leaves(new_params, is_leaf=scalify.is_scaled_leaf))


def test_jax_checkpoint_inside_the_loss():
    model = TinyGPT()
    tokens, targets = _data()
    params = _init(model, 1, tokens)
    loss_fn = jax.checkpoint(functools.partial(_loss, model), policy=jax.checkpoint_policies.dots_saveable)
    grad_fn = jax.value_and_grad(loss_fn)
    ref = jax.jit(grad_fn)(params, tokens, targets)
    out = jax.jit(scalify.scalify(grad_fn))(_scaled_params(params), tokens, targets)
    chex.assert_trees_all_close(scalify.asarray(out), ref, rtol=1e-5, atol=1e-6)


def test_flax_nnx_model_step():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(8, 16, rngs=rngs)
            self.ln = nnx.LayerNorm(16, rngs=rngs)
            self.l2 = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.gelu(self.ln(self.l1(x))))

    model = MLP(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    x = jax.random.normal(jax.random.PRNGKey(2), (5, 8))
    y = jax.random.normal(jax.random.PRNGKey(3), (5, 4))

    def loss(state, x, y):
        return jnp.mean((nnx.merge(graphdef, state)(x) - y) ** 2)

    grad_fn = jax.value_and_grad(loss)
    ref_loss, ref_grads = jax.jit(grad_fn)(state, x, y)  # one program rather than op by op
    sstate = jax.tree_util.tree_map(lambda a: scalify.as_scaled_array(a, scale=2.0**-3), state)
    out_loss, out_grads = scalify.scalify(grad_fn)(sstate, x, y)
    np.testing.assert_allclose(scalify.asarray(out_loss), ref_loss, rtol=1e-6)
    chex.assert_trees_all_close(scalify.asarray(out_grads), ref_grads, rtol=1e-5, atol=1e-7)


def test_float16_training_step_stays_finite_and_close_to_float32():
    """Parameters stored as float16 data with a per-tensor power-of-two scale (from amax):
    the scalified float16 step stays finite and close to the float32 step."""
    model = TinyGPT()
    tokens, targets = _data()
    params = _init(model, 0, tokens)
    opt = optax.sgd(1e-2)
    step = _make_step(model, opt)
    ref_params, _, ref_loss = jax.jit(step)(params, opt.init(params), tokens, targets)

    def to_fp16(a):
        amax = jnp.max(jnp.abs(a))  # 0 for the zero-initialised biases: scale 1 there
        scale = jnp.where(amax > 0, scalify.pow2_round_down(jnp.where(amax > 0, amax, 1)), 1)
        return scalify.ScaledArray((a / scale).astype(jnp.float16), scale.astype(jnp.float32))

    sparams = jax.tree_util.tree_map(to_fp16, params)
    new_params, _, loss = jax.jit(scalify.scalify(step))(sparams, opt.init(sparams), tokens, targets)
    np.testing.assert_allclose(scalify.asarray(loss, jnp.float32), ref_loss, rtol=2e-2)
    for got, ref in zip(jax.tree_util.tree_leaves(scalify.asarray(new_params, jnp.float32)),
                        jax.tree_util.tree_leaves(ref_params)):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(got, ref, rtol=5e-2, atol=5e-3)
