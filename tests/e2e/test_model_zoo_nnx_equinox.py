"""Stock Flax NNX and Equinox models, written as their users write them, through `scalify`.

The NNX model is a pre-LayerNorm transformer block of `nnx.Linear`, `nnx.LayerNorm` and
`nnx.MultiHeadAttention` (causal mask), trained with `nnx.Optimizer` under
`nnx.jit(scalify.scalify(step))` (in place); the Equinox models are `eqx.nn.MLP` and a
transformer block of `eqx.nn.Linear`, `eqx.nn.LayerNorm`, `eqx.nn.MultiheadAttention` and
`eqx.nn.MLP` (per-example modules, `jax.vmap` over the batch), trained under
`eqx.filter_jit(scalify.scalify(step))` (docs/frameworks.md).

- float32 with ScaledArray params equals plain JAX after several steps of Adam, SGD with
  momentum and Lion (AdamW: tests/zoo's float32 check, which trains its NNX and Equinox
  models with it in the same steps): the loss to 1e-5 at every step, the params to 1e-5 of the
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
import functools

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
# AdamW is not here: tests/zoo's `float32` check trains its NNX models (nnx-llama,
# nnx-mlp-mixer) and Equinox models (eqx-gpt2, eqx-vit) with `optax.adamw` through the same
# steps as the tests below (`nnx.jit(scalify.scalify(step))` updating an `nnx.Optimizer`;
# `eqx.filter_jit(scalify.scalify(step))` with optax and `eqx.apply_updates`), against the
# same bounds (the loss to 1e-5, the params to 1e-5 of the largest on the elements whose
# first gradient is above 2^-20 of the largest).
OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
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


class NnxMLP(nnx.Module):
    def __init__(self, d_in, width, depth, *, dtype=None, dot_general=jax.lax.dot_general, rngs):
        self.layers = nnx.List([nnx.Linear(d_in if i == 0 else width, width, dtype=dtype,
                                           dot_general=dot_general, rngs=rngs) for i in range(depth)])
        self.norm = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(width, 1, dtype=dtype, dot_general=dot_general, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.gelu(layer(x))
        return self.head(self.norm(x)).astype(jnp.float32)


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
    return eqx.nn.MLP(D_IN, 1, 32, depth=4, activation=jax.nn.gelu, key=key)


EQX_MODELS = {"eqx-mlp": (_eqx_mlp, (D_IN,)),
              "eqx-transformer": (lambda key: EqxTransformer(D_IN, WIDTH, HEADS, key), (SEQ, D_IN))}


NNX_MODELS = {"nnx-mlp": (lambda seed, **kw: NnxMLP(D_IN, WIDTH, 4, rngs=nnx.Rngs(seed), **kw), (D_IN,)),
              "nnx-transformer": (lambda seed, **kw: NnxTransformer(D_IN, WIDTH, HEADS, rngs=nnx.Rngs(seed), **kw),
                                  (SEQ, D_IN))}


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


# Every optimizer on the MLPs; Adam and Lion (a sign update: noise-sensitive) on the
# transformers (the optimizer's arithmetic does not depend on the architecture).
# Optimizers on the MLP; attention models in NNX and Equinox are tests/zoo's.
F32_CASES = [("mlp", o) for o in sorted(OPTIMIZERS)]


@pytest.mark.parametrize("arch,opt_name", F32_CASES)
def test_nnx_float32_training_equals_plain(arch, opt_name):
    make, shape = NNX_MODELS["nnx-" + arch]
    x, y = _batch(shape)
    ref, model = make(0), make(0)
    first_grads = nnx.grad(lambda m: _mse(m(x), y))(make(0))
    nnx.update(model, scalify.as_scaled_array(nnx.state(model, nnx.Param)))
    ref_opt = nnx.Optimizer(ref, OPTIMIZERS[opt_name](), wrt=nnx.Param)
    opt = nnx.Optimizer(model, OPTIMIZERS[opt_name](), wrt=nnx.Param)
    ref_step, step = nnx.jit(_nnx_step), nnx.jit(scalify.scalify(_nnx_step))
    for _ in range(STEPS):
        ref_loss, loss = ref_step(ref, ref_opt, x, y), step(model, opt, x, y)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert isinstance(model.head.kernel.get_value(), scalify.ScaledArray)
    assert _error(nnx.state(ref, nnx.Param), nnx.state(model, nnx.Param), first_grads) <= 1e-5


def _eqx_loss(model, x, y):
    return _mse(jax.vmap(model)(x), y)


def _eqx_step(opt):
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(_eqx_loss)(model, x, y)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


@pytest.mark.parametrize("arch,opt_name", F32_CASES)
def test_equinox_float32_training_equals_plain(arch, opt_name):
    make, shape = EQX_MODELS["eqx-" + arch]
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


# ---------------------------------------------------------------------------------------
# FP16 compute and FP16 masters: a teacher-student task, held-out loss against float32
# ---------------------------------------------------------------------------------------
TRAIN_STEPS, BATCH, LR = 40, 32, 3e-3


def _task(teacher, shape, seed=0):
    """Batches (TRAIN_STEPS, BATCH, ...) and a held-out set labelled by a float32 `teacher`
    (output normalised to unit variance, plus noise of std 0.1)."""
    def sample(key, n):
        x = jax.random.normal(key, (n,) + shape)
        t = teacher(x)
        return x, (t - t.mean()) / t.std() + 0.1 * jax.random.normal(jax.random.fold_in(key, 7), t.shape)

    xs, ys = sample(jax.random.PRNGKey(10 + seed), TRAIN_STEPS * BATCH)
    xs, ys = xs.reshape((TRAIN_STEPS, BATCH) + shape), ys.reshape(TRAIN_STEPS, BATCH, 1)
    return (xs, ys), sample(jax.random.PRNGKey(20 + seed), 256)


def _half(model):
    """An Equinox model's float arrays cast to float16 (float32 masters, float16 compute)."""
    return jax.tree.map(lambda p: p.astype(jnp.float16) if eqx.is_inexact_array(p) else p, model)


def _eqx_loss16(model, x, y):
    return _mse(jax.vmap(_half(model))(x.astype(jnp.float16)).astype(jnp.float32), y)


def _relative(loss, ref):
    return abs(float(loss) / float(ref) - 1)


@nnx.jit
def _nnx_eval(model, x, y):
    return _mse(model(x), y)


def _held_out_loss(make, params, held_out):
    """The held-out loss of the float32 model at the trained values `params` (an nnx.State
    of Params, scaled or not): what was learnt, whatever the training's compute dtype."""
    model = make(0)
    nnx.update(model, scalify.asarray(params))
    return float(_nnx_eval(model, *held_out))


def _train_nnx(make, data, held_out, dtype=None):
    """Plain float32 NNX (dtype None) or scalified with ScaledArray float32 params and the
    model's compute in `dtype`. Returns the held-out loss before and after training."""
    model = make(0) if dtype is None else make(0, dtype=dtype)
    first = _held_out_loss(make, nnx.state(model, nnx.Param), held_out)
    if dtype is not None:
        nnx.update(model, scalify.as_scaled_array(nnx.state(model, nnx.Param)))
    opt = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    step = nnx.jit(_nnx_step if dtype is None else scalify.scalify(_nnx_step))
    for x, y in zip(*data):
        step(model, opt, x, y)
    return first, _held_out_loss(make, nnx.state(model, nnx.Param), held_out)


def _train_nnx_masters(make, data, held_out, **kw):
    """FP16 masters, FP16 compute: NNX's functional API (`nnx.split` / `nnx.merge`)."""
    tx = optax.adam(LR)
    graphdef, params, rest = nnx.split(make(0, dtype=jnp.float16, **kw), nnx.Param, ...)
    params = so.scaled_params(params, jnp.float16)

    def loss_fn(p, x, y):
        return _mse(nnx.merge(graphdef, p, rest)(x), y)

    def step(p, s, x, y, key):
        loss, g = jax.value_and_grad(loss_fn)(so.values(p), x, y)
        u, s = tx.update(g, s, p)
        return so.apply_updates(p, u, rounding="stochastic", key=key), s, loss

    step = jax.jit(scalify.scalify(step))
    # float32 Adam moments (optax makes them in the params' dtype, float16 here), as
    # ScaledArrays: the type the scalified step returns, so that it compiles once
    state, key = scalify.as_scaled_array(tx.init(so.values(params))), jax.random.PRNGKey(5)
    for i, (x, y) in enumerate(zip(*data)):
        params, state, _ = step(params, state, x, y, jax.random.fold_in(key, i))
    assert jax.tree.leaves(params, is_leaf=scalify.is_scaled_leaf)[0].dtype == jnp.float16
    return _held_out_loss(make, params, held_out)


CPU_F16_ATTENTION = pytest.mark.skipif(
    jax.default_backend() == "cpu",
    reason="backend: nnx attention asks for float16 x float16 -> float32 logits, a dot XLA:CPU "
           "does not implement (F16_F16_F32), with or without scalify; runs on GPU")


@functools.cache
def _nnx_reference(name):
    """(task, float32 held-out loss after training) of NNX model `name`."""
    make, shape = NNX_MODELS[name]
    data, held_out = _task(make(100), shape)
    first, ref = _train_nnx(make, data, held_out)
    assert ref < 0.7 * first  # the task is learnt
    return data, held_out, ref


@pytest.mark.parametrize("name", ["nnx-mlp", pytest.param("nnx-transformer", marks=CPU_F16_ATTENTION)])
def test_nnx_fp16_compute_trains_like_float32(name):
    """`dtype=float16`, float32 params as ScaledArrays, nnx.Optimizer: within 1%."""
    data, held_out, ref = _nnx_reference(name)
    _, fp16 = _train_nnx(NNX_MODELS[name][0], data, held_out, jnp.float16)
    assert _relative(fp16, ref) <= 0.01, (fp16, ref)


@pytest.mark.parametrize("recipe", ["fp16-master", "fp8"])
def test_nnx_fp16_masters_train_like_float32(recipe):
    """FP16 masters (#2) and FP16 masters with every matmul in FP8
    (`nnx.Linear(dot_general=scalify.nn.fp8_dot_general)`, #3): held-out loss no more than
    2% above float32's. One-sided: a lower loss is not an accuracy loss, and FP8 rounding
    moves this small task's result by a few percent either way (the FP8 recipe lands at
    -0.9% of float32 with float32 FP8 accumulation and at -2.8% with the default bfloat16,
    `ScalifyConfig.narrow_dot_accumulator`)."""
    data, held_out, ref = _nnx_reference("nnx-mlp")
    kw = {"dot_general": scalify.nn.fp8_dot_general} if recipe == "fp8" else {}
    loss = _train_nnx_masters(NNX_MODELS["nnx-mlp"][0], data, held_out, **kw)
    assert loss <= 1.02 * ref, (loss, ref)


@eqx.filter_jit
def _eqx_eval(model, x, y):
    return _eqx_loss(model, x, y)


def _train_eqx(make, data, held_out, recipe):
    """"f32" (plain), "fp16" (scalified, float32 masters as ScaledArrays, the model cast to
    float16 in the loss) or "fp16-master" (FP16 masters, float32 Adam moments, stochastic
    rounding). Returns the float32 model's held-out loss at the trained values."""
    tx = optax.adam(LR)
    model = make(jax.random.PRNGKey(0))
    if recipe == "f32":
        loss = _eqx_loss
    else:
        loss = _eqx_loss16
        model = scalify.as_scaled_array(model) if recipe == "fp16" else so.scaled_params(model, jnp.float16)

    def step(model, s, x, y, key):
        _, grads = eqx.filter_value_and_grad(loss)(so.values(model), x, y)
        u, s = tx.update(grads, s, eqx.filter(model, eqx.is_array))
        if recipe == "fp16-master":
            return so.apply_updates(model, u, rounding="stochastic", key=key), s
        return eqx.apply_updates(model, u), s

    step = eqx.filter_jit(step if recipe == "f32" else scalify.scalify(step))
    state = tx.init(so.values(eqx.filter(model, eqx.is_array)))  # float32 moments
    if recipe != "f32":  # as ScaledArrays, the type the scalified step returns: one compile
        state = scalify.as_scaled_array(state)
    key = jax.random.PRNGKey(5)
    for i, (x, y) in enumerate(zip(*data)):
        model, state = step(model, state, x, y, jax.random.fold_in(key, i))
    return float(_eqx_eval(scalify.asarray(model), *held_out))


@functools.cache
def _eqx_reference(name):
    """(task, float32 held-out loss after training) of Equinox model `name`."""
    make, shape = EQX_MODELS[name]
    data, held_out = _task(jax.vmap(make(jax.random.PRNGKey(100))), shape)
    first = float(_eqx_eval(make(jax.random.PRNGKey(0)), *held_out))
    ref = _train_eqx(make, data, held_out, "f32")
    assert ref < 0.7 * first  # the task is learnt
    return data, held_out, ref


@pytest.mark.parametrize("name,recipe", [("eqx-mlp", "fp16"), ("eqx-mlp", "fp16-master")])
def test_equinox_fp16_trains_like_float32(name, recipe):
    """FP16 compute (float32 masters) within 1% of float32, FP16 masters (#2) within 2%.
    (No FP8 swap: an Equinox `Linear` has no hook for its contraction.)"""
    data, held_out, ref = _eqx_reference(name)
    loss = _train_eqx(EQX_MODELS[name][0], data, held_out, recipe)
    assert _relative(loss, ref) <= (0.01 if recipe == "fp16" else 0.02), (loss, ref)


# ---------------------------------------------------------------------------------------
# FP16 gradients with no loss scaling
# ---------------------------------------------------------------------------------------
def _check_fp16_gradients(g32, plain16, scaled16):
    """No leaf of the scalified FP16 gradients is all zeros where float32's is not, and
    the whole gradient keeps float32's direction; `plain16` (plain float16) is reported."""
    g32, plain16, scaled16 = _leaves(g32), _leaves(plain16), _leaves(scaled16)
    assert len(g32) == len(scaled16) == len(plain16)
    lost = [i for i, (a, b) in enumerate(zip(g32, scaled16)) if np.any(a) and not np.any(b)]
    assert not lost, f"all-zero gradient leaves {lost}"
    flat = lambda t: np.concatenate([np.ravel(a) for a in t])  # noqa: E731
    cos = lambda a, b: float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))  # noqa: E731
    assert cos(flat(scaled16), flat(g32)) >= 0.999, f"plain float16: cos {cos(flat(plain16), flat(g32)):.3f}"


MULT = 2.0**-20  # the loss multiplier: plain float16 gradients underflow


def test_nnx_fp16_gradients_need_no_loss_scaling():
    make, shape = NNX_MODELS["nnx-mlp"]
    x, y = _batch(shape)
    grad = lambda m, x, y: nnx.grad(lambda m: _mse(m(x), y) * MULT)(m)  # noqa: E731
    g32 = jax.tree.map(lambda g: g / MULT, nnx.jit(grad)(make(0), x, y))
    model16 = make(0, dtype=jnp.float16)
    plain = jax.tree.map(lambda g: g / MULT, nnx.jit(grad)(model16, x, y))
    nnx.update(model16, scalify.as_scaled_array(nnx.state(model16, nnx.Param)))
    scaled = nnx.jit(scalify.scalify(grad))(model16, x, y)
    scaled = jax.tree.map(lambda g: np.asarray(scalify.asarray(g), np.float64) / MULT, scaled,
                          is_leaf=scalify.is_scaled_leaf)
    _check_fp16_gradients(g32, plain, scaled)


@pytest.mark.parametrize("name", sorted(EQX_MODELS))
def test_equinox_fp16_gradients_need_no_loss_scaling(name):
    make, shape = EQX_MODELS[name]
    x, y = _batch(shape)
    model = make(jax.random.PRNGKey(0))
    g32 = eqx.filter_jit(eqx.filter_grad(_eqx_loss))(model, x, y)
    grad16 = eqx.filter_grad(lambda m, x, y: _eqx_loss16(m, x, y) * MULT)
    plain = jax.tree.map(lambda g: g / MULT, eqx.filter_jit(grad16)(model, x, y))
    scaled = eqx.filter_jit(scalify.scalify(grad16))(scalify.as_scaled_array(model), x, y)
    scaled = jax.tree.map(lambda g: np.asarray(scalify.asarray(g), np.float64) / MULT, scaled,
                          is_leaf=scalify.is_scaled_leaf)
    _check_fp16_gradients(g32, plain, scaled)


# ---------------------------------------------------------------------------------------
# float32 masters placed from the weights before the update (`apply_updates(
# float32_scale_from="previous")`, recipes #0 and #1): the values of plain optax
# ---------------------------------------------------------------------------------------
def _functional(framework):
    """(params, loss(params, x, y)) of the framework's MLP, params as a plain pytree."""
    if framework == "nnx":
        graphdef, params = nnx.split(NNX_MODELS["nnx-mlp"][0](0))
        return params, lambda p, x, y: _mse(nnx.merge(graphdef, p)(x), y)
    model = _eqx_mlp(jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_array)
    return params, lambda p, x, y: _eqx_loss(eqx.combine(p, static), x, y)


@pytest.mark.parametrize("framework", ["nnx", "eqx"])
def test_float32_masters_placed_from_the_previous_weights(framework):
    """Adam on a stock NNX / Equinox MLP, the update applied with `scalify.optim.
    apply_updates(float32_scale_from="previous")` under scalify: the loss and parameters of
    plain optax, and every updated weight matrix's scale is the power of two of its largest
    value before the update; a vector's (the biases, zero before their first update) that
    of its updated value."""
    params, loss_fn = _functional(framework)
    x, y = _batch((D_IN,))
    opt = optax.adam(1e-3)

    def step(p, s, placed):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = opt.update(g, s, p)
        new = so.apply_updates(p, u, float32_scale_from="previous") if placed else optax.apply_updates(p, u)
        return new, s, loss

    ref_step = jax.jit(functools.partial(step, placed=False))
    scaled_step = jax.jit(scalify.scalify(functools.partial(step, placed=True)))
    first_grads = jax.grad(loss_fn)(params, x, y)
    p, s = params, opt.init(params)
    sp, ss = scalify.as_scaled_array(params), scalify.as_scaled_array(opt.init(params))
    is_leaf = lambda t: isinstance(t, scalify.ScaledArray)  # noqa: E731
    for _ in range(STEPS):
        before = [(float(jnp.max(jnp.abs(v))), v.ndim) for v in jax.tree.leaves(scalify.asarray(sp))]
        p, s, ref_loss = ref_step(p, s)
        sp, ss, loss = scaled_step(sp, ss)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        scales = [float(t.scale) for t in jax.tree.leaves(sp, is_leaf=is_leaf)]
        after = [float(jnp.max(jnp.abs(v))) for v in jax.tree.leaves(scalify.asarray(sp))]
        measured = [m_after if ndim <= 1 else m for (m, ndim), m_after in zip(before, after)]
        assert scales == [2.0 ** np.floor(np.log2(m)) if m > 0 else 1.0 for m in measured], (scales, measured)
    assert _error(p, sp, first_grads) <= 1e-5
