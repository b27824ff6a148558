"""`scalify.recipes` on models written as their authors write them (tests/zoo's Flax
linen Llama and GPT-2, NNX Llama, Equinox GPT-2): the user's loss function and optax
optimizer, unchanged, through `recipe.train_step`.

- FP32 (#0) equals plain float32 JAX step by step.
- The low-precision recipes train like float32 (mean loss within 1%, or no worse than
  plain float16 of the same model), the state keeps its types (one compile), and the
  formats land where the recipe says (float16 layers, FP8 matmuls, the head and the
  embedding in the model's own dtype).
- The state checkpoints with orbax and resumes to the same losses.
"""
from __future__ import annotations

import functools
import importlib
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scalify
from scalify import recipes

from tests.zoo import harness as H
from tests.zoo.models_linen import SPECS as ZOO
from tests.zoo.models_linen import GPT2, DiT, Llama, LoRALM, Mamba, dit_batch, dit_loss
from tests.zoo.tasks import next_token

STEPS = H.STEPS
BATCH = next_token.batch()


def linen_loss(model):
    def loss_fn(params, batch):
        x, y = batch
        return next_token.objective(model.apply({"params": params}, x), y)

    return loss_fn


@functools.cache
def initial_params(cls):
    return jax.jit(cls(dtype=jnp.float32).init)(jax.random.PRNGKey(0), BATCH[0])["params"]


def plain_step(loss_fn, opt, batch):
    """The plain jitted step `(params, opt_state) -> (params, opt_state, loss)` of
    `loss_fn(params, batch)` with optax `opt`."""

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


@functools.cache
def plain_losses(cls, dtype) -> np.ndarray:
    """Plain JAX: the model in `dtype`, float32 params, optax AdamW, jitted."""
    opt = H.optimizer()
    step = plain_step(linen_loss(cls(dtype=dtype)), opt, BATCH)
    params = initial_params(cls)
    state, losses = (params, opt.init(params)), []
    with H.precision_for(H.F16 if dtype == jnp.float16 else H.F32):
        for _ in range(STEPS):
            *state, loss = step(*state)
            losses.append(float(loss))
    return np.array(losses)


def recipe_losses(recipe, cls, model_dtype=jnp.bfloat16, steps=STEPS):
    """The recipe's step on the unchanged model (its compute dtype `model_dtype`, as a
    user ships it): (losses, train, state)."""
    train = recipe.train_step(linen_loss(cls(dtype=model_dtype)), H.optimizer())
    state, losses = train.init(initial_params(cls)), []
    with H.precision_for(H.F16):
        for _ in range(steps):
            state, metrics = train.step(state, BATCH)
            losses.append(float(metrics["loss"]))
    return np.array(losses), train, state


@functools.cache
def shared_recipe_run(name, cls, model_dtype=jnp.bfloat16):
    """`recipe_losses` of recipe `name` for `STEPS` steps, run once per process: the tests
    that need the first losses of the same step (same recipe, model and dtype) read them
    here rather than compiling that step again. Treat the result as read-only."""
    return recipe_losses(recipes.get(name), cls, model_dtype)


def zoo_losses(recipe, name: str):
    """(the recipe's losses, plain float32's, the recipe's train) of `STEPS` steps of the
    zoo's model `name` on its task: the recipe's step on the bfloat16 model against the
    plain jitted AdamW step of the float32 model, from the same float32 parameters."""
    cls, task = ZOO[name]
    batch, opt = task.batch(), H.optimizer()
    params = jax.jit(cls(dtype=jnp.float32).init)(jax.random.PRNGKey(0), batch[0])["params"]

    def loss_of(model):
        return lambda p, b: task.objective(model.apply({"params": p}, b[0]), b[1])

    step = plain_step(loss_of(cls(dtype=jnp.float32)), opt, batch)
    train = recipe.train_step(loss_of(cls(dtype=jnp.bfloat16)), opt)
    state, plain, ref, got = train.init(params), (params, opt.init(params)), [], []
    with H.precision_for(H.F16 if recipe.compute_dtype == jnp.float16 else H.F32):
        for _ in range(STEPS):
            *plain, loss = step(*plain)
            ref.append(float(loss))
            state, metrics = train.step(state, batch)
            got.append(float(metrics["loss"]))
    return np.array(got), np.array(ref), train


@pytest.mark.parametrize("cls", [GPT2, Llama], ids=["gpt2", "llama"])
def test_fp32_recipe_equals_plain_float32(cls):
    """float32 data at power-of-two scales: the same numbers as plain JAX up to the order
    of float32 roundings (the zoo's float32 check states the bound)."""
    losses, train, _ = shared_recipe_run("fp32", cls, jnp.float32)
    np.testing.assert_allclose(losses, plain_losses(cls, jnp.float32), rtol=1e-5)
    assert train.step._cache_size() == 1


@pytest.mark.parametrize("name,cls", [("fp16", Llama), ("fp8-fp16-state", Llama), ("fp8", GPT2), ("fp8-bf16", Llama)])
def test_low_precision_recipe_trains_like_float32(name, cls):
    """Every loss finite and the mean loss within 1% of float32's, or no more than 1.01x
    plain float16's (the bar where float16 itself costs more than 1%); one compile."""
    losses, train, state = shared_recipe_run(name, cls)
    assert np.all(np.isfinite(losses)), losses
    m32 = plain_losses(cls, jnp.float32).mean()
    if abs(losses.mean() / m32 - 1) > 0.01:
        assert losses.mean() <= 1.01 * plain_losses(cls, jnp.float16).mean(), (losses, m32)
    assert train.step._cache_size() == 1
    master = recipes.get(name).master_dtype
    assert all(p.data.dtype == master for p in jax.tree.leaves(state.params, is_leaf=scalify.is_scaled_leaf))


def _dot_dtypes(recipe, cls, model_dtype=jnp.bfloat16):
    """The operand dtypes of every matmul of the model's forward pass under `recipe`
    (`dot_general`, and `fp8_scaled_matmul`: scalify's FP8 GEMM)."""
    model = cls(dtype=model_dtype)
    with recipes.precision(recipe):
        jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, BATCH[0]))(initial_params(cls))
    out = []

    def walk(jp):
        for eqn in jp.eqns:
            if eqn.primitive.name in ("dot_general", "fp8_scaled_matmul"):
                out.append(tuple(str(v.aval.dtype) for v in eqn.invars[:2]))
            for value in eqn.params.values():  # jit, custom_vjp_call (the FP8 dot), ...
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(jaxpr.jaxpr)
    return out


def test_precision_puts_layers_in_float16_and_keeps_the_head():
    """FP16 on the bfloat16 Llama: every projection in float16, the untied `lm_head` in
    bfloat16; the tied GPT-2 head (`Embed.attend`) stays bfloat16 too."""
    llama = _dot_dtypes(recipes.FP16, Llama)
    assert llama[-1] == ("bfloat16", "bfloat16"), llama  # lm_head, the last dot
    assert {d for d in llama[:-1] if "bfloat16" in d} <= {("bfloat16", "bfloat16")}
    assert ("float16", "float16") in llama
    gpt2 = _dot_dtypes(recipes.FP16, GPT2)
    assert gpt2[-1] == ("bfloat16", "bfloat16"), gpt2


def test_precision_fp8_swaps_the_dense_layers_not_the_head():
    """FP8: every Dense of the Llama (q, k, v, o, w1, w2, w3) runs E4M3 x E4M3; lm_head and
    the attention products (q.k, p.v) do not."""
    dots = _dot_dtypes(recipes.FP8, Llama)
    fp8 = [d for d in dots if d == ("float8_e4m3fn", "float8_e4m3fn")]
    assert len(fp8) == 7, dots
    assert dots[-1] == ("bfloat16", "bfloat16")
    everything = recipes.FP8.replace(keep=())
    assert len([d for d in _dot_dtypes(everything, Llama) if "float8_e4m3fn" in d[0]]) == 8


def test_fp8_bf16_keeps_every_activation_in_bfloat16():
    """FP8_BF16: the seven Dense matmuls of the Llama in E4M3 and, with float32 masters (so
    that any float16 left would be an activation or its gradient), nothing in float16 in
    the whole scalified train step: no float16 activation to place by its maximum."""
    dots = _dot_dtypes(recipes.FP8_BF16, Llama)
    assert len([d for d in dots if d == ("float8_e4m3fn", "float8_e4m3fn")]) == 7, dots
    assert all("float16" not in d for d in dots), dots
    train = recipes.FP8_BF16.replace(master_dtype=jnp.float32).train_step(
        linen_loss(Llama(dtype=jnp.bfloat16)), H.optimizer())
    state = jax.eval_shape(train.init, initial_params(Llama))
    text = str(jax.make_jaxpr(train.update)(state, BATCH))
    assert "f16[" not in text.replace("bf16[", "")


@pytest.mark.parametrize("name", ["FP8", "FP8_FP16_STATE", "FP8_BF16"])
def test_fp8_dense_kernel_gradient_is_written_in_bfloat16(name, monkeypatch):
    """Every FP8 recipe runs each of the Llama's Dense matmuls (seven a block) from its float32 kernel
    with the kernel's gradient written in bfloat16 by its GEMM: unscaled, so float16 could
    not hold it under float16 compute; half the bytes of a float32 gradient. Forward
    products are in the compute dtype."""
    from scalify.nn import fp8_swap

    calls = []

    def recording(lhs, rhs, *args, **kwargs):
        calls.append((rhs.dtype, kwargs.get("rhs_grad_dtype"), kwargs.get("preferred_element_type")))
        return real(lhs, rhs, *args, **kwargs)

    real = fp8_swap._fp8_dot_general
    monkeypatch.setattr(fp8_swap, "_fp8_dot_general", recording)
    recipe = getattr(recipes, name)
    _dot_dtypes(recipe, Llama)
    assert calls and len(calls) % 7 == 0, calls  # seven per block
    for kernel_dtype, grad_dtype, out_dtype in calls:
        assert kernel_dtype == jnp.float32 and grad_dtype == jnp.bfloat16, calls
        assert jnp.dtype(out_dtype) == recipe.compute_dtype, calls

def test_keep_takes_a_path_filter():
    only_mlp = recipes.FP8.replace(keep=lambda path: "LlamaMLP" not in path and path != "")
    dots = _dot_dtypes(only_mlp, Llama)
    assert len([d for d in dots if d[0] == "float8_e4m3fn"]) == 3, dots


def test_state_checkpoints_with_orbax_and_resumes(tmp_path):
    """Save the FP8 state after 3 steps, restore it into a fresh initial state, and the
    next steps' losses are those of the uninterrupted run, with no second compile. The
    step is the FP8_FP16_STATE step that `shared_recipe_run` compiled (donating, as the
    recipe's default step; every save is finished before a step donates its buffers)."""
    ocp = pytest.importorskip("orbax.checkpoint")
    _, train, _ = shared_recipe_run("fp8-fp16-state", Llama)
    state = train.init(initial_params(Llama))
    with H.precision_for(H.F16):
        for _ in range(3):
            state, _ = train.step(state, BATCH)
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(tmp_path / "ckpt", state)
        ckpt.wait_until_finished()
        expected = []
        for _ in range(2):
            state, m = train.step(state, BATCH)
            expected.append(float(m["loss"]))
        # a new run's template: its initial state (the shapes, dtypes and shardings), the
        # delayed statistics sized from an example batch
        restored = ckpt.restore(tmp_path / "ckpt", train.init(initial_params(Llama), batch=BATCH))
        got = []
        for _ in range(2):
            restored, m = train.step(restored, BATCH)
            got.append(float(m["loss"]))
    assert got == expected
    assert train.step._cache_size() == 1


def test_jitted_step_donates_the_arrays_and_writes_new_scales_to_fresh_buffers():
    """The jitted step takes the state's scalar leaves (per-tensor scales, the update count)
    undonated: XLA writes the new scales without first copying the old ones, which the
    backward pass still reads (one device copy per tensor per step if they were donated).
    The arrays are donated; a compiled step is called as (state, batch) like the step.
    The step is the FP8 step that `shared_recipe_run` compiled, on a fresh state: its
    compiled program is the one every step of that run executed."""
    _, train, _ = shared_recipe_run("fp8", Llama)
    with H.precision_for(H.F16):  # the context the recipe's steps run in (their program)
        state = train.init(initial_params(Llama), batch=BATCH)
        compiled = train.step.trace(state, BATCH).lower().compile()
    entry = compiled.as_text().split("ENTRY", 1)[1]
    arguments = set(re.findall(r"%(\S+) = \S+ parameter\(", entry))
    copied = [x for x in re.findall(r"= \w+\[\]\S* copy\(%([^),\s]+)\)", entry) if x in arguments]
    assert copied == []
    leaves = jax.tree_util.tree_leaves(state)
    with H.precision_for(H.F16):
        state, m1 = compiled(state, BATCH)
        state, m2 = train.step(state, BATCH)
    assert all(x.is_deleted() for x in leaves if x.ndim)
    assert not any(x.is_deleted() for x in leaves if not x.ndim)
    assert np.isfinite([float(m1["loss"]), float(m2["loss"])]).all()
    assert train.step._cache_size() == 1  # the measuring calls, the AOT stages and the step: one program


def test_nnx_and_equinox_models_train_through_the_recipe():
    """Models of other frameworks: the recipe's step (masters, optimizer, state) around
    a loss on their parameter pytree; the layers compute in the dtypes they were built
    with. FP32 equals plain float32 for the NNX Llama; FP16 masters train the Equinox GPT-2."""
    import equinox as eqx
    from flax import nnx

    from tests.zoo.models_nnx_eqx import EqxGPT2, NnxLlama

    x, y = BATCH
    graphdef, params = nnx.split(NnxLlama(jnp.float32, rngs=nnx.Rngs(0)))

    def nnx_loss(p, batch):
        return next_token.objective(nnx.merge(graphdef, p)(batch[0]), batch[1])

    opt = H.optimizer()

    @jax.jit
    def plain(p, s):
        loss, g = jax.value_and_grad(nnx_loss)(p, BATCH)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    train = recipes.FP32.train_step(nnx_loss, opt)
    state, ps = train.init(params), (params, opt.init(params))
    for _ in range(4):
        state, m = train.step(state, BATCH)
        *ps, loss = plain(*ps)
        np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-5)

    model = EqxGPT2(jax.random.PRNGKey(0))
    arrays, static = eqx.partition(model, eqx.is_array)

    def eqx_loss(p, batch):
        return next_token.objective(jax.vmap(eqx.combine(p, static))(batch[0]), batch[1])

    train = recipes.FP16_MASTER.train_step(eqx_loss, opt)
    state, losses = train.init(arrays), []
    for _ in range(STEPS):
        state, m = train.step(state, BATCH)
        losses.append(float(m["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], losses
    assert isinstance(train.params(state), type(arrays))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(master_dtype=jnp.int8), ValueError, "master_dtype must be float32, float16 or bfloat16"),
    (dict(state_dtype="float8_e4m3fn"), ValueError, "state_dtype"),
    (dict(compute_dtype=jnp.int32), ValueError, "compute_dtype must be a float dtype"),
    (dict(keep="lm_head"), TypeError, "keep must be a callable path -> bool or a tuple"),
    (dict(state_min_size=0), ValueError, "state_min_size"),
    (dict(fp8_saved_activations="coat"), TypeError, "fp8_saved_activations must be True or False"),
    (dict(fp8=1), TypeError, "fp8 must be True or False"),
])
def test_bad_recipe_fields_say_what_to_do(kwargs, error, match):
    with pytest.raises(error, match=match):
        recipes.Recipe("bad", **kwargs)


def test_unknown_recipe_name_lists_the_recipes():
    with pytest.raises(ValueError, match="fp8-fp16-state"):
        recipes.get("fp4")


def test_recipe_names_match_the_module_attributes():
    """`get` takes the attribute's spelling too: "FP8_FP16_STATE" is recipes.FP8_FP16_STATE."""
    for attr in ("FP32", "FP16", "FP16_MASTER", "FP8", "FP8_FP16_STATE", "FP8_BF16"):
        assert recipes.get(attr) is getattr(recipes, attr)
        assert recipes.get(getattr(recipes, attr).name) is getattr(recipes, attr)


def test_residual_stream_stays_in_the_compute_dtype():
    """GPT-2 in bfloat16 under FP16: the embedding lookups are float16, so every block's
    output is float16 (a bfloat16 embedding plus float16 blocks would promote the whole
    residual stream to float32), while the tied head's logits stay bfloat16."""
    model, outs = GPT2(dtype=jnp.bfloat16), {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        outs["/".join(context.module.path) + ":" + context.method_name] = getattr(out, "dtype", None)
        return out

    with recipes.precision(recipes.FP16), nn.intercept_methods(record):
        jax.eval_shape(lambda p: model.apply({"params": p}, BATCH[0]), initial_params(GPT2))
    assert outs["wte:__call__"] == outs["h_0:__call__"] == jnp.float16, outs
    assert outs["wte:attend"] == jnp.bfloat16, outs


def test_layer_norm_under_the_recipe_is_flax_layer_norm_in_float32():
    """The recipe runs a stock `nn.LayerNorm` as `scalify.nn.layer_norm` with flax's own
    parameters: in float32 (FP32 recipe, outside scalify), the same values."""
    ln = nn.LayerNorm(epsilon=1e-5)
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8, 32)) * 3 + 1
    variables = ln.init(jax.random.PRNGKey(1), x)
    variables = jax.tree.map(lambda p: p + jax.random.normal(jax.random.PRNGKey(2), p.shape), variables)
    with recipes.precision(recipes.FP32):
        got = ln.apply(variables, x)
        assert jax.tree.map(jnp.shape, ln.init(jax.random.PRNGKey(1), x)) == jax.tree.map(jnp.shape, variables)
    np.testing.assert_allclose(got, ln.apply(variables, x), rtol=1e-5, atol=1e-5)
    with recipes.precision(recipes.FP32):  # scalify's normalisation (a custom_vjp), not flax's
        assert "custom_vjp_call" in str(jax.make_jaxpr(lambda v: ln.apply(v, x))(variables))
    assert "custom_vjp_call" not in str(jax.make_jaxpr(lambda v: ln.apply(v, x))(variables))


def test_batchnorm_state_travels_through_the_step():
    """A ResNet with BatchNorm in training mode (tests/zoo): its `batch_stats` are the
    step's model state (`has_state=True`). FP32 equals plain float32 step by step,
    statistics included; FP16 trains with finite losses."""
    from tests.zoo.models_linen import ResNet
    from tests.zoo.tasks import classification

    task = classification(image=8, classes=10)
    x, y = task.batch()
    variables = jax.jit(ResNet(dtype=jnp.float32).init)(jax.random.PRNGKey(0), x)
    params, stats = variables["params"], variables["batch_stats"]

    def make_loss(model):
        def loss_fn(p, s, batch):
            out, new = model.apply({"params": p, "batch_stats": s}, batch[0], mutable=["batch_stats"])
            return task.objective(out, batch[1]), new["batch_stats"]

        return loss_fn

    opt, loss32 = H.optimizer(), make_loss(ResNet(dtype=jnp.float32))

    @jax.jit
    def plain(p, o, s):
        (loss, s), g = jax.value_and_grad(loss32, has_aux=True)(p, s, (x, y))
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, s, loss

    train = recipes.FP32.train_step(loss32, opt, has_state=True)
    state, ref = train.init(params, stats), (params, opt.init(params), stats)
    for _ in range(4):
        state, m = train.step(state, (x, y))
        *ref, loss = plain(*ref)
        np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-5)
    np.testing.assert_allclose(jax.tree.leaves(state.model_state)[0], jax.tree.leaves(ref[2])[0], rtol=1e-5, atol=1e-6)
    assert train.step._cache_size() == 1
    with pytest.raises(ValueError, match="has_state=True"):
        train.init(params)

    train = recipes.FP16.train_step(make_loss(ResNet(dtype=jnp.bfloat16)), opt, has_state=True)
    state, losses = train.init(params, stats), []
    with H.precision_for(H.F16):
        for _ in range(STEPS):
            state, m = train.step(state, (x, y))
            losses.append(float(m["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_fp8_stores_swapped_kernels_out_in_and_gives_them_back():
    """FP8 keeps the Dense kernels it swaps as (out, in) in its state (the FP8 GEMM's
    layout), the kept head as the model has it; `train.params` returns the model's layout,
    and with float32 masters the round trip is exact."""
    params = initial_params(Llama)
    recipe = recipes.FP8.replace(master_dtype=jnp.float32)
    train = recipe.train_step(linen_loss(Llama(dtype=jnp.bfloat16)), H.optimizer())
    state = train.init(params)
    is_t = lambda x: isinstance(x, recipes.TransposedKernel)
    stored = dict(jax.tree_util.tree_flatten_with_path(scalify.optim.values(state.params), is_leaf=is_t)[0])
    flat = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    transposed = [jax.tree_util.keystr(k) for k, v in stored.items() if is_t(v)]
    assert len(transposed) == 7 and not any("lm_head" in k for k in transposed), transposed
    for k, v in stored.items():
        np.testing.assert_array_equal(v.out_in if is_t(v) else v, flat[k].T if is_t(v) else flat[k])
    jax.tree_util.tree_map(np.testing.assert_array_equal, train.params(state), params)


def test_kernel_storage_layout_changes_no_value(monkeypatch):
    """The FP8 step with (out, in) kernels gives the losses of the same step with the
    model's layout: a transpose moves data and rounds nothing. (XLA may order a GEMM's
    float32 accumulation differently for the other layout: a few float32 ulps, hence the
    tolerance, far below FP8's 2^-4 relative step.)"""
    ts = importlib.import_module("scalify.recipes.train_step")  # the module, not the function

    transposed = shared_recipe_run("fp8", Llama)[0][:3]
    monkeypatch.setattr(ts, "to_storage", lambda recipe, p: p)
    model_layout, _, _ = recipe_losses(recipes.FP8, Llama, steps=3)
    np.testing.assert_allclose(transposed, model_layout, rtol=1e-5)


def test_stored_kernels_given_to_the_model_fail_loudly_with_what_to_call():
    """`state.params` of an FP8 recipe holds `TransposedKernel`s: applying the model to it
    is an error that names `train.params(state)`, never a silently transposed square
    kernel."""
    train = recipes.FP8.train_step(linen_loss(Llama(dtype=jnp.bfloat16)), H.optimizer())
    state = train.init(initial_params(Llama))
    with pytest.raises(Exception, match=r"train\.params\(state\)"):
        Llama(dtype=jnp.float32).apply({"params": scalify.optim.values(state.params)}, BATCH[0])
    Llama(dtype=jnp.float32).apply({"params": train.params(state)}, BATCH[0])


def _grad_rescales(recipe, cls) -> int:
    """How many input-gradient rescales the recipe's model has (its loss traced, not run)."""
    model, params = cls(dtype=jnp.bfloat16), initial_params(cls)
    with recipes.precision(recipe):
        jaxpr = jax.make_jaxpr(linen_loss(model))(params, BATCH)
    return sum(e.primitive is scalify.ops.rescale.dynamic_rescale_grad_p for e in jaxpr.eqns)


def test_norm_grad_rescale_reaches_hand_written_norms():
    """The zoo's Llama writes its own `LlamaRMSNorm` (2 per layer and a final one): the FP16
    recipe rescales their input gradients as it does Flax's `nn.RMSNorm`; FP32 does not."""
    n_norms = 2 * len([k for k in initial_params(Llama) if k.startswith("LlamaAttention")]) + 1
    assert _grad_rescales(recipes.FP16, Llama) == n_norms
    assert _grad_rescales(recipes.FP32, Llama) == 0


def test_recipe_swaps_stock_activations_for_scalify_ones_and_restores_them():
    """Inside a low-precision recipe's `precision`, `nn.gelu`, `nn.silu` and `jax.nn.gelu`
    are scalify's activations (bounded gate and derivative in float32: the tanh GELU's
    cube is not traced); they give jax.nn's values and gradients, and the originals are
    back after the block. FP32 keeps the originals (it equals plain float32)."""
    originals = (nn.gelu, nn.silu, jax.nn.gelu, jax.nn.swish)
    x = jnp.linspace(-6.0, 6.0, 64, dtype=jnp.float32)

    def traced_pows(f):
        return sum(e.primitive.name == "integer_pow" for e in jax.make_jaxpr(jax.grad(lambda v: f(v).sum()))(x).eqns)

    with recipes.precision(recipes.FP16):
        assert (nn.gelu, nn.silu, jax.nn.gelu) == (scalify.ops.gelu, scalify.ops.silu, scalify.ops.gelu)
        assert traced_pows(nn.gelu) == 0
        got = [f(x) for f in (nn.gelu, nn.silu)] + [jax.grad(lambda v: nn.gelu(v).sum())(x)]
    with recipes.precision(recipes.FP32):
        assert (nn.gelu, jax.nn.gelu) == originals[::2]
    assert (nn.gelu, nn.silu, jax.nn.gelu, jax.nn.swish) == originals
    assert traced_pows(nn.gelu) > 0
    want = [jax.nn.gelu(x), jax.nn.silu(x), jax.grad(lambda v: jax.nn.gelu(v).sum())(x)]
    for g, w in zip(got[:2], want[:2]):
        np.testing.assert_array_equal(g, w)
    # The derivative is JAX's own (jvp of jax.nn.gelu), its products in another order than
    # jax.grad's: in the tail x < -4, 1 + tanh(u) cancels to a few float32 ulps of 1 and
    # the order shows there (absolute 1e-6 against derivatives up to 1.13).
    np.testing.assert_allclose(got[2], want[2], rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("name,model_dtype,rtol", [("fp32", jnp.float32, 1e-5), ("fp8", jnp.bfloat16, 1e-2)])
def test_update_composes_with_jit_shardings(name, model_dtype, rtol):
    """`train.update` under the user's own `jax.jit` with FSDP-style shardings (each array
    of the state split along its first dim over 4 devices where it divides; the FP8
    recipe's (out, in) kernels by their stored shape) trains as the recipe's own step.
    The sharded step sums its float32 reductions in another order: FP32 (a float32 model)
    agrees to float32 rounding; in FP8 a different last bit can move a value across an E4M3 rounding
    boundary (2^-4 relative), so FP8 agrees within the recipes' 1% accuracy contract."""
    devices = jax.devices()[:4]
    if len(devices) < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
    P = jax.sharding.PartitionSpec

    def sharding(x):
        split = jnp.ndim(x) >= 1 and jnp.shape(x)[0] % 4 == 0
        return jax.sharding.NamedSharding(mesh, P("fsdp") if split else P())

    recipe = recipes.get(name)
    expected = shared_recipe_run(name, Llama, model_dtype)[0][:3]
    train = recipe.train_step(linen_loss(Llama(dtype=model_dtype)), H.optimizer())
    state = train.init(initial_params(Llama))
    shardings = jax.tree.map(sharding, state)
    step = jax.jit(train.update, in_shardings=(shardings, None), out_shardings=(shardings, None),
                   compiler_options=scalify.compiler_options())
    state = jax.device_put(state, shardings)
    got = []
    with H.precision_for(H.F16):
        for _ in range(3):
            state, metrics = step(state, BATCH)
            got.append(float(scalify.optim.values(metrics["loss"])))
    assert any(s.spec == P("fsdp") for s in jax.tree.leaves(shardings))
    np.testing.assert_allclose(got, expected, rtol=rtol)


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.gelu(nn.Dense(32)(x)))


def _mse(params, batch):
    x, y = batch
    return jnp.mean((_Mlp().apply({"params": params}, x) - y) ** 2)


def test_data_parallel_step_from_fn_and_grad_hook_equals_the_whole_batch_step():
    """`TrainStep.fn` in a `shard_map` over 2 devices, scalified as a whole, with a
    `grad_hook` averaging the gradients and the loss (`scaled_pmean`): each device's half
    of the batch gives the step of the whole batch. The two halves' means are averaged
    where the whole batch is summed at once: with float32 data (FP32) and SGD, whose update
    is linear in the gradient, the same values up to float32 reassociation (rtol 1e-6).
    Without the hook each device updates from its own half: the states differ."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from scalify import distributed as D

    mesh = D.make_mesh(2, ("data",))
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 16))
    batch = (x, jnp.tanh(x[:, :4]))
    params = jax.jit(_Mlp().init)(jax.random.PRNGKey(0), x)["params"]
    pmean = functools.partial(D.scaled_pmean, axis_name="data")
    # TrainStep.fn carries no delayed statistics: neither does the whole-batch reference
    whole = recipes.FP32.replace(delayed_statistics=False).train_step(_mse, optax.sgd(0.1), donate=False)
    runs = {}
    for hook in (pmean, None):
        train = recipes.FP32.train_step(_mse, optax.sgd(0.1), grad_hook=hook, donate=False)
        local = jax.shard_map(train.fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()),
                              check_vma=False)
        step = jax.jit(scalify.scalify(local))
        state = jax.device_put(train.init(params), NamedSharding(mesh, P()))
        ref = whole.init(params)
        for _ in range(3):
            state, metrics = step(state, batch)
            ref, ref_metrics = whole.step(ref, batch)
            state = recipes.conform(state, ref)
        runs[hook] = (float(scalify.asarray(metrics["loss"], jnp.float32)), float(ref_metrics["loss"]),
                      whole.params(state), whole.params(ref))
    loss, ref_loss, got, ref = runs[pmean]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-7), got, ref)
    _, _, alone, ref = runs[None]
    assert any(not np.allclose(a, r, rtol=1e-3) for a, r in zip(jax.tree.leaves(alone), jax.tree.leaves(ref)))


def test_wrap_optimizer_is_the_steps_optimizer():
    """`wrap_optimizer(recipe, tx)` initialised from the float32 values of the masters has
    the structure, leaf types and dtypes of the step's `opt_state` (a split step's state)."""
    x = jnp.ones((2, 16))
    params = _Mlp().init(jax.random.PRNGKey(0), x)["params"]
    recipe = recipes.FP8_FP16_STATE.replace(state_min_size=64)
    train = recipe.train_step(_mse, optax.adamw(1e-3))
    state = train.init(params)
    opt_state = recipes.wrap_optimizer(recipe, optax.adamw(1e-3)).init(scalify.optim.values(state.params))
    kinds = lambda t: [(type(v).__name__, v.dtype) for v in jax.tree.leaves(t, is_leaf=scalify.is_scaled_leaf)]
    assert jax.tree.structure(opt_state) == jax.tree.structure(state.opt_state)
    assert kinds(opt_state) == kinds(state.opt_state)
    assert ("ScaledArray", jnp.float16) in kinds(opt_state)


def test_delayed_statistics_are_sized_once_and_train_like_measured_guards():
    """`Recipe.delayed_statistics`: `init(params, batch=...)` sizes one record per measured
    site and measures them on the batch (finite powers of two), changing nothing else;
    the steps compile once; the losses stay within 1% of the same recipe deciding from
    this step's measurements (the decisions are powers of two, placed from a statistic one
    step old)."""
    delayed, train, state = shared_recipe_run("fp8", Llama)
    assert np.isfinite(state.statistics).mean() > 0.9
    # a new run's state, measured by the calls of the step the shared run compiled
    with H.precision_for(H.F16):
        measured_state = train.init(initial_params(Llama), batch=BATCH)
    assert measured_state.statistics.shape[0] > 0 and np.isfinite(measured_state.statistics).mean() > 0.9
    unmeasured = train.init(initial_params(Llama))
    assert int(measured_state.step) == 0 and unmeasured.statistics is None
    chex.assert_trees_all_equal(train.params(measured_state), train.params(unmeasured))
    assert train.step._cache_size() == 1
    measured, _, state = recipe_losses(recipes.FP8.replace(delayed_statistics=False), Llama)
    assert state.statistics is None
    np.testing.assert_allclose(delayed.mean(), measured.mean(), rtol=0.01)


def test_no_update_is_placed_without_records():
    """A model whose propagated scales drift beyond float16 within one step (a Mamba block:
    its backward data grow 2^16 past the scale the loss gradient starts from): the FP8
    recipe's delayed statistics first measure, so no update is computed from data placed
    without a record, and it trains like the recipe deciding from each step's own data
    (with no record, such a step put infinities into the gradients and every later loss
    was NaN). Measuring a state without records changes nothing else in it."""
    delayed, train, state = recipe_losses(recipes.FP8, Mamba)
    measured, _, _ = recipe_losses(recipes.FP8.replace(delayed_statistics=False), Mamba)
    assert np.isfinite(delayed).all() and int(state.step) == STEPS, delayed
    np.testing.assert_allclose(delayed.mean(), measured.mean(), rtol=0.01)
    # a state whose statistics hold no record (a template): `measure` records, updates nothing
    blank = train.step.sized(train.init(initial_params(Mamba)), BATCH)
    before = jax.device_get((train.params(blank), blank.opt_state))
    with H.precision_for(H.F16):
        held = train.step.measure(blank, BATCH)
    assert int(held.step) == 0 and np.isfinite(held.statistics).any()
    chex.assert_trees_all_equal(jax.device_get((train.params(held), held.opt_state)), before)


def test_zero_initialised_gates_train_in_float16_like_float32():
    """A DiT (adaLN-Zero: its gates and final layer start at exactly 0; parameter-free
    LayerNorms) trains through the FP16 recipe like plain float32. The first step's
    gradients below the head are exact zeros whose scale shrinks to the bottom of the
    scale range; the LayerNorm's input gradient multiplied it by 1/sigma's scale and
    flushed it to 0, and every loss after the first was NaN."""
    model, steps = DiT(), STEPS
    loss_fn, opt = dit_loss(model), H.optimizer()
    params = jax.jit(model.init)(jax.random.PRNGKey(0), *dit_batch(0)[:3])["params"]

    @jax.jit
    def plain_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    train = recipes.FP16.train_step(loss_fn, opt)
    state, plain, fp16 = train.init(params, batch=dit_batch(0)), (params, opt.init(params)), []
    ref = []
    for i in range(steps):
        *plain, loss = plain_step(*plain, dit_batch(i))
        ref.append(float(loss))
        state, metrics = train.step(state, dit_batch(i))
        fp16.append(float(metrics["loss"]))
    assert np.isfinite(fp16).all(), fp16
    np.testing.assert_allclose(np.mean(fp16), np.mean(ref), rtol=0.01)


def test_layer_scale_trains_through_the_16_bit_master_recipe():
    """A ConvNeXt (depthwise conv, LayerNorm, GELU MLP, layer scale initialised at 1e-6)
    through FP16_MASTER trains like plain float32. One AdamW update grows the layer scale
    and the zero-initialised biases by orders of magnitude; their float16 masters were
    encoded at the scale of the value before the update (data ~2^12), the bias gradient
    summed 64 such terms past float16's max, and every loss from the third was NaN."""
    fp16, ref, _ = zoo_losses(recipes.FP16_MASTER, "convnext")
    assert np.isfinite(fp16).all(), fp16
    np.testing.assert_allclose(np.mean(fp16), np.mean(ref), rtol=0.01)


def test_measured_records_are_those_of_the_data(monkeypatch):
    """The records `init(params, batch=...)` measures are, site by site, within a factor 2
    of those a step records when every site decides from its own data (the drift guards
    acting): what the next step places its data from. The model: LoRA (zero-initialised
    B) with the user's own FP8 matmuls (`fp8_everywhere`, just-in-time scaling) under the
    FP16 recipe. One measuring call, from no records, placed the backward data at the
    propagated scales, where they drift without the guards: its records were up to 2^17
    too small, the next step saturated float16 and every later loss was NaN."""
    from scalify.core.statistics import delayed_statistics

    model = LoRALM()
    plain_loss = linen_loss(model)

    def loss_fn(params, batch):
        with scalify.nn.fp8_everywhere():
            return plain_loss(params, batch)

    train = recipes.FP16.train_step(loss_fn, H.optimizer())
    params = initial_params(LoRALM)
    measured_state = train.init(params, batch=BATCH)
    measured = np.asarray(measured_state.statistics, np.float64)
    # the measuring calls leave no update behind: the rest of the state is init's
    chex.assert_trees_all_equal(measured_state._replace(statistics=None), train.init(params))

    def own_data_records(state, batch):
        with delayed_statistics(None) as stats:
            scalify.scalify(train.fn)(state, batch)
        return stats.recorded()

    ref = np.asarray(jax.jit(own_data_records)(train.init(params), BATCH), np.float64)
    assert np.array_equal(np.isfinite(measured), np.isfinite(ref))
    live = np.isfinite(ref) & (ref > 0)
    assert live.sum() > 10
    np.testing.assert_array_less(np.abs(np.log2(measured[live]) - np.log2(ref[live])), 1.0 + 1e-9)
    # Records that have not settled when the measuring calls run out are said, not used silently.
    monkeypatch.setattr(importlib.import_module("scalify.recipes.train_step"), "MEASURE_CALLS", 1)
    with pytest.warns(RuntimeWarning, match="did not settle in 1 measuring calls"):
        train.init(params, batch=BATCH)
