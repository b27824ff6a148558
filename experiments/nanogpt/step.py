"""From a precision recipe (`configs.Recipe`) to a model, an optimizer and a train step.

Everything is built from `experiments/nanogpt/model.py` by injecting layers:
`scalify.nn.Dense` with the recipe's per-role dtypes, `scalify.nn.LayerNorm` (with the
input-gradient rescale of recipe #2+), `scalify.nn.gelu`, and an `Embed` whose tied head can
use the same low-precision matmul. The model carries its formats, so the training step
needs none.

The step of recipes #1-#4 is the library's (`scalify.recipes.train_step`, the paper's
Algorithm 1): `library_recipe` gives the `scalify.recipes.Recipe` of their masters and
optimizer state (no `compute_dtype`, no `fp8`: the model has them), and the step is
`scalify.scalify` of its `TrainStep.fn`: the loss differentiated at the float32 view of
16-bit masters, AdamW on unscaled float32 values (FP16 moments stored scaled), each new
master encoded at the scale of the weights before the update, the state conformed to its
types. The other configurations run `make_grad_fn` then `make_apply_fn` here:

- ``fp32`` (#0) runs AdamW on the scaled values themselves (the whole step scaled: the
  reference that scale propagation changes no value), which the library's step does not
  (it unscales the optimizer, whose float32 roundings then differ);
- the baselines (``bf16``, ``flax-fp8``, ``fp32-plain``) are plain JAX/Flax, without
  scalify; Flax's `Fp8DirectDotGeneralOp` keeps its delayed-scaling statistics in the
  ``_overwrite_with_gradient`` collection (`TrainState.extra`), replaced by their
  "gradient" each step as `flax.training.train_state.TrainState.apply_gradients` does;
- ``--set`` variants of the master update (`master_rounding`, `master_scale="new"`,
  `master_margin`, `param_rescale` other than "previous", `param_grads_f32=false`,
  `grad_rescale`, a scaled optimizer).

`TrainState` is a plain pytree (`params`, `opt_state`, `extra` = the Flax FP8 statistics or
an empty dict, `step`); scalify recipes hold `ScaledArray` leaves. `conform` keeps the leaf
types and dtypes of the state identical from step to step, so the jitted step never
recompiles.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import scalify
import scalify.recipes
from scalify.core.scaled_array import ScaledArray, is_scaled_leaf
from scalify.recipes import conform

from experiments.nanogpt.configs import Recipe, resolve_dtype
from experiments.nanogpt.model import GPT, PRESETS, GPTConfig, cross_entropy_loss, get_config

__all__ = [
    "TrainState",
    "OptimConfig",
    "FLAX_FP8_COLLECTION",
    "Embed",
    "gpt_config",
    "library_recipe",
    "adamw",
    "make_optimizer",
    "scalify_step",
    "learning_rate",
    "unit_scaled",
    "init_state",
    "make_update_fn",
    "make_loss_fn",
    "make_train_step",
    "train_step_of",
    "compiler_options",
    "StepPair",
    "abstract_step_pair",
    "make_eval_step",
    "make_diagnostics_fn",
    "conform",
    "plain_state",
    "scale_summary",
    "materialize",
]

FLAX_FP8_COLLECTION = nn.fp8_ops.OVERWRITE_WITH_GRADIENT


class TrainState(NamedTuple):
    """Everything a step reads and writes (a pytree)."""

    params: Any  # model parameters (ScaledArray leaves for scalify recipes)
    opt_state: Any  # optax state (scaled FP16 leaves for recipe #4)
    extra: Any  # Flax fp8_ops statistics (flax-fp8) or {}
    step: Any  # shape=(), int32: number of updates done


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up and cosine decay (nanoGPT's defaults, scaled down)."""

    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # final learning rate = lr * min_lr_ratio
    warmup_steps: int = 100
    total_steps: int = 1000
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # on matrices only (embeddings and kernels), not on biases/norms
    clip_norm: float | None = 1.0


# ----------------------------------------------------------------------------- model


class Embed(nn.Embed):
    """`flax.linen.Embed` whose tied head (`attend`) can run as a low-precision matmul.

    With `head_dtypes=(input, kernel, grad, output)` (jnp dtypes) the head is
    `scalify.ops.fp8.fp8_dot_general` with those formats and static scaling, like the
    recipe's `scalify.nn.Dense`; with `head_dtype` it is a plain matmul of the query and
    the embedding in that dtype; with neither it is `nn.Embed.attend`.
    """

    head_dtypes: tuple | None = None
    head_dtype: Any = None

    def attend(self, query):
        if self.head_dtype is not None:
            # Operands and logits in `head_dtype` (bfloat16: float32's exponent range, so
            # the logits need no float16 rescale).
            dt = self.head_dtype
            return jnp.dot(jnp.asarray(query).astype(dt), self.embedding.astype(dt).T)
        if self.head_dtypes is None:
            return super().attend(query)
        from scalify.ops.fp8 import fp8_dot_general

        lhs_dt, rhs_dt, grad_dt, out_dt = self.head_dtypes
        query = jnp.asarray(query)
        if self.dtype is not None:
            query = query.astype(self.dtype)
        out_dt = out_dt or query.dtype
        dn = (((query.ndim - 1,), (1,)), ((), ()))
        return fp8_dot_general(
            query, self.embedding, dn, lhs_dtype=lhs_dt or query.dtype, rhs_dtype=rhs_dt or query.dtype,
            grad_dtype=grad_dt or out_dt, preferred_element_type=out_dt, scaling="static",
        )


@functools.lru_cache(maxsize=None)
def _layers(recipe: Recipe) -> dict:
    """The injected layer classes of `recipe` (cached: GPTConfig compares them by identity)."""
    if not recipe.scalify:
        if recipe.flax_fp8:
            op = nn.Fp8DirectDotGeneralOp if recipe.flax_fp8 == "direct" else nn.Fp8DotGeneralOp
            op = functools.partial(op, amax_history_length=recipe.fp8_history)
            return dict(dense_cls=functools.partial(nn.Dense, dot_general_cls=op))
        if recipe.kernel_layout != "in_out":
            from scalify.nn import Dense

            return dict(dense_cls=functools.partial(Dense, kernel_layout=recipe.kernel_layout))
        return {}
    from scalify.nn import Dense, LayerNorm, gelu

    roles = dict(
        input_dtype=resolve_dtype(recipe.matmul_input),
        kernel_dtype=resolve_dtype(recipe.matmul_kernel),
        grad_dtype=resolve_dtype(recipe.matmul_grad),
        output_dtype=resolve_dtype(recipe.matmul_output),
    )
    out = dict(
        dense_cls=functools.partial(Dense, **roles, scaling="static", kernel_layout=recipe.kernel_layout),
        layernorm_cls=functools.partial(LayerNorm, grad_rescale=recipe.ln_grad_rescale),
        activation=gelu,
    )
    if recipe.head_matmul and recipe.low_precision_matmul:
        head = (roles["input_dtype"], roles["kernel_dtype"],
                resolve_dtype(recipe.head_grad) or roles["grad_dtype"],
                resolve_dtype(recipe.head_output) or roles["output_dtype"])
        out["embed_cls"] = functools.partial(Embed, head_dtypes=head)
    elif recipe.head_dtype is not None:
        out["embed_cls"] = functools.partial(Embed, head_dtype=resolve_dtype(recipe.head_dtype))
    return out


def gpt_config(recipe: Recipe, model: str = "tiny", **overrides) -> GPTConfig:
    """The `GPTConfig` of preset `model` with the recipe's dtype, injected layers and
    attention (`overrides` win)."""
    fields = dict(dtype=resolve_dtype(recipe.dtype), **_layers(recipe))
    if recipe.attention is not None:
        fields["attention"] = recipe.attention
    return get_config(model, **{**fields, **overrides})


_LIBRARY_FORMATS = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.float16, jnp.bfloat16))


def library_recipe(recipe: Recipe) -> scalify.recipes.Recipe | None:
    """The `scalify.recipes.Recipe` whose step is `recipe`'s, or None when the step runs
    here (module doc): a scalify recipe whose optimizer runs on unscaled float32 values,
    whose masters take each update's scale from the weights before it (16-bit:
    `master_scale="previous"`; float32: `param_rescale="previous"`) with the default
    margin and round-to-nearest, differentiated at their float32 view, with no gradient
    rescale. Its `compute_dtype` is None and `fp8` False: the model's layers carry the
    formats."""
    master, state = resolve_dtype(recipe.master), resolve_dtype(recipe.state) or jnp.dtype(jnp.float32)
    placed = recipe.master_scale == "previous" if recipe.scaled_master else recipe.param_rescale == "previous"
    if not (recipe.scalify and recipe.unscaled_optimizer and placed and recipe.master_rounding == "nearest"
            and recipe.master_margin is None and recipe.param_grads_f32 and recipe.grad_rescale is None
            and master in _LIBRARY_FORMATS and state in _LIBRARY_FORMATS):
        return None
    return scalify.recipes.Recipe(recipe.name, compute_dtype=None, fp8=False, master_dtype=master,
                                  state_dtype=state, state_min_size=recipe.state_min_size)


# ----------------------------------------------------------------------------- optimizer


def _decay_mask(params):
    return jax.tree_util.tree_map(lambda p: jnp.ndim(p) >= 2, params, is_leaf=is_scaled_leaf)


def _schedule(cfg: OptimConfig):
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, max(cfg.warmup_steps, 1), max(cfg.total_steps, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def learning_rate(cfg: OptimConfig, step: int) -> float:
    """The learning rate used by update number `step` (0-based)."""
    return float(_schedule(cfg)(step))


def adamw(cfg: OptimConfig) -> optax.GradientTransformation:
    """Global-norm clipping (``cfg.clip_norm``; none when None), then AdamW with linear
    warm-up and cosine decay, weight decay on the matrices (parameters of 2 or more
    dimensions) only."""
    opt = optax.adamw(_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay, mask=_decay_mask)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), opt) if cfg.clip_norm else opt


def make_optimizer(recipe: Recipe, cfg: OptimConfig) -> optax.GradientTransformation:
    """`adamw(cfg)`: as it is for the library's step (`library_recipe`; the step wraps it,
    `scalify.recipes.wrap_optimizer`) and for plain recipes; otherwise wrapped in
    `scalify.optim.scaled_state` for a low-precision state and, with
    `unscaled_optimizer`, in `scalify.optim.unscaled` (plain float32 optimizer)."""
    tx = adamw(cfg)
    if library_recipe(recipe) is not None:
        return tx
    if recipe.state is not None:
        from scalify.optim import scaled_state

        # With the unscaled optimizer the stored state is decoded to plain float32 values.
        tx = scaled_state(tx, resolve_dtype(recipe.state), min_size=recipe.state_min_size,
                          unscaled_values=recipe.unscaled_optimizer)
    if recipe.unscaled_optimizer:
        from scalify.optim import unscaled

        tx = unscaled(tx)
    return tx


# ----------------------------------------------------------------------------- state


def _scale_float_leaves(tree):
    """Float leaves -> ScaledArray (scale 1 for arrays: the paper's reference recipes); int
    leaves and ScaledArray kept."""
    return scalify.as_scaled_array(tree, scale=1.0)


def unit_scaled(tree, norm: str = "l2"):
    """Float leaves -> ScaledArray with the power of two of their RMS (``norm="l2"``) or of
    their max-abs (``norm="max"``) as scale: data of unit RMS, or largest value in [1, 2)
    (the float32 masters of the `fp32`/`fp16` recipes, see `configs.Recipe.param_rescale`);
    zero tensors get scale 1. Exact in float32."""
    if norm not in ("l2", "max"):
        raise ValueError(f"norm must be 'l2' or 'max', got {norm!r}.")

    def convert(x):
        if isinstance(x, ScaledArray) or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return x
        x = jnp.asarray(x)
        xf = x.astype(jnp.float32)
        size = jnp.max(jnp.abs(xf)) if norm == "max" else jnp.sqrt(jnp.mean(jnp.square(xf)))
        ok = jnp.isfinite(size) & (size > 0)
        scale = jnp.where(ok, scalify.pow2_round_down(jnp.where(ok, size, 1.0)), 1.0)
        return ScaledArray((x / scale.astype(x.dtype)).astype(x.dtype), scale.astype(jnp.float32))

    return jax.tree_util.tree_map(convert, tree, is_leaf=is_scaled_leaf)


def init_state(recipe: Recipe, gpt: GPTConfig, tx: optax.GradientTransformation, seed: int = 0,
               batch_size: int = 1) -> TrainState:
    """Initial `TrainState`: parameters from `seed` (identical across recipes: same param
    tree and float32 init), converted once for scalify recipes."""
    tokens = jnp.zeros((batch_size, gpt.seq_len), jnp.int32)
    variables = jax.jit(lambda key: GPT(gpt).init(key, tokens))(jax.random.PRNGKey(seed))
    variables = dict(variables)
    params = variables.pop("params")
    extra = variables.pop(FLAX_FP8_COLLECTION, {})
    if library_recipe(recipe) is not None:
        state = _library_step(recipe, gpt, tx).init(params)
        return TrainState(state.params, state.opt_state, extra, state.step)
    if recipe.scalify:
        params, opt_state = jax.jit(functools.partial(_scalified_start, recipe, tx))(params)
    else:
        opt_state = tx.init(params)
    return TrainState(params, opt_state, extra, jnp.zeros((), jnp.int32))


def _scalified_start(recipe: Recipe, tx, params):
    """(params, opt_state) of a scalify recipe that runs its own step, from float32 params."""
    if recipe.scaled_master:
        from scalify.optim import scaled_params

        params = scaled_params(params, resolve_dtype(recipe.master), margin=recipe.master_margin)
    else:
        # The starting point of the recipe's master-weight rescale (same norm).
        params = unit_scaled(params, norm="max" if recipe.param_rescale in ("max", "previous") else "l2")
    # From float32 values: optax's zeros_like would map over a ScaledArray's children
    # (scale 0), and the Adam moments of recipes #0-#3 are float32 whatever the master.
    opt_state = tx.init(scalify.asarray(params, jnp.float32))
    if recipe.state is None and not recipe.unscaled_optimizer:
        opt_state = _scale_float_leaves(opt_state)
    return params, opt_state


def materialize(x, dtype=jnp.float32):
    """A plain float32 value of a (possibly scaled) scalar or array."""
    return x.to_array(dtype) if isinstance(x, ScaledArray) else jnp.asarray(x, dtype)


def plain_state(state: TrainState) -> TrainState:
    """The state as plain arrays, for running the same step without scalify: parameters in
    their data dtype (FP16 master weights stay FP16) and float32 Adam moments; the scaled
    FP16 optimizer state (recipe #4) is kept, its wrapper works in plain JAX too."""
    params = jax.tree_util.tree_map(
        lambda x: x.to_array() if isinstance(x, ScaledArray) else x, state.params, is_leaf=is_scaled_leaf)
    opt_state = state.opt_state
    if not _has_stored_state(opt_state):
        opt_state = scalify.asarray(opt_state)
    return state._replace(params=params, opt_state=opt_state)


def _has_stored_state(opt_state) -> bool:
    from scalify.optim import QuantizedState

    return isinstance(opt_state, QuantizedState)


# ----------------------------------------------------------------------------- step


def make_loss_fn(gpt: GPTConfig) -> Callable:
    """`loss(params, extra, tokens, targets)`: mean next-token cross-entropy (float32)."""
    model = GPT(gpt)

    def loss_fn(params, extra, tokens, targets):
        variables = {"params": params}
        if extra:
            variables[FLAX_FP8_COLLECTION] = extra
        logits = model.apply(variables, tokens, padded_logits=True)
        return cross_entropy_loss(logits, targets, vocab_size=gpt.vocab_size)

    return loss_fn


def _hooked_loss_fn(gpt: GPTConfig, param_hook: Callable | None) -> Callable:
    """`make_loss_fn(gpt)` on `param_hook(params)` (its derivative taken) when given."""
    loss_fn = make_loss_fn(gpt)
    if param_hook is None:
        return loss_fn

    def hooked(params, extra, tokens, targets):
        return loss_fn(param_hook(params), extra, tokens, targets)

    return hooked


def _library_step(recipe: Recipe, gpt: GPTConfig, tx: optax.GradientTransformation,
                  grad_hook: Callable | None = None, param_hook: Callable | None = None):
    """The `scalify.recipes.TrainStep` of `library_recipe(recipe)` for the model's loss on
    a batch ``(tokens, targets)`` (hooks: `make_update_fn`), unjitted."""
    loss_fn = _hooked_loss_fn(gpt, param_hook)
    return scalify.recipes.train_step(library_recipe(recipe), lambda params, batch: loss_fn(params, {}, *batch),
                                      tx, jit=False, donate=False, grad_hook=grad_hook)


def make_grad_fn(recipe: Recipe, gpt: GPTConfig, grad_hook: Callable | None = None,
                 param_hook: Callable | None = None) -> Callable:
    """The gradient half of the training step:

    ``grads(params, extra, tokens, targets) -> (grads, extra_grads, loss)``.

    `grad_hook((grads, loss)) -> (grads, loss)`, if given, is applied to the parameter
    gradients and the loss right after they are computed (e.g. the data-parallel
    all-reduce of `experiments/nanogpt/parallel.py`, one collective for both).
    `param_hook(params) -> params`, if given, is applied to the parameters inside the
    differentiated loss (e.g. the FP8 all-gather of FSDP weights); its derivative is taken.
    """
    loss_fn = _hooked_loss_fn(gpt, param_hook)

    def grads_of(params, extra, tokens, targets):
        if recipe.scalify and recipe.scaled_master and recipe.param_grads_f32:
            # Differentiate with respect to a float32 view of the 16-bit master weights, so that
            # the parameter gradients have float32 data: a weight gradient sums over all the
            # tokens of the batch, whose contributions are correlated, so its data exceeds the
            # unit-scaling estimate (sqrt of the count) and would overflow float16. The cast
            # keeps the scale; the model's matmuls still cast the kernels to their formats.
            params = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params)
        loss, (grads, extra_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            params, extra, tokens, targets)
        if grad_hook is not None:
            grads, loss = grad_hook((grads, loss))
        return grads, extra_grads, loss

    return grads_of


def make_apply_fn(recipe: Recipe, tx: optax.GradientTransformation, seed: int = 0) -> Callable:
    """The optimizer half of the training step:

    ``apply(state, grads, extra_grads) -> new_state`` (the gradients of `make_grad_fn`).
    For a recipe of the library's step (`library_recipe`), its update: `tx` wrapped as that
    step wraps it."""
    library = library_recipe(recipe)
    if library is not None:
        tx = scalify.recipes.wrap_optimizer(library, tx)
    if recipe.scalify:
        from scalify.ops import dynamic_rescale_l2, dynamic_rescale_max
        from scalify.optim import apply_updates as scaled_apply_updates

        rescales = {None: None, "l2": dynamic_rescale_l2, "max": dynamic_rescale_max}
        rescale = rescales[recipe.grad_rescale]
        # "previous": placed by the update itself (`apply_updates(float32_scale_from=...)`)
        previous_scale = recipe.param_rescale == "previous"
        param_rescale = None if previous_scale else rescales[recipe.param_rescale]
    stochastic = recipe.master_rounding == "stochastic"

    def apply(state: TrainState, grads, extra_grads):
        if recipe.scalify:
            if rescale is not None:
                grads = jax.tree_util.tree_map(rescale, grads)
            # The optimizer computes in float32 (its state is stored as the recipe says):
            # Adam's g*g on FP16 gradient data would under- or overflow (the scale of a
            # ScaledArray is kept by the cast; only the data is widened).
            grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        if recipe.scalify:
            key = jax.random.fold_in(jax.random.PRNGKey(seed + 1), state.step) if stochastic else None
            params = scaled_apply_updates(state.params, updates, rounding=recipe.master_rounding,
                                          key=key, margin=recipe.master_margin,
                                          scale_from=recipe.master_scale,
                                          float32_scale_from="previous" if previous_scale else None)
            if param_rescale is not None:
                params = jax.tree_util.tree_map(param_rescale, params)
        else:
            params = optax.apply_updates(state.params, updates)
        # Flax fp8_ops: the "gradient" of the statistics is their new value.
        extra = extra_grads if state.extra else state.extra
        return TrainState(params, opt_state, extra, state.step + 1)

    return apply


def make_update_fn(recipe: Recipe, gpt: GPTConfig, tx: optax.GradientTransformation,
                   seed: int = 0, grad_hook: Callable | None = None,
                   param_hook: Callable | None = None) -> Callable:
    """The whole training step as one function (to be scalified for scalify recipes):

    ``update(state, tokens, targets) -> (new_state, loss)``: the library's
    `TrainStep.fn` for `library_recipe(recipe)`, else `make_grad_fn` (its hooks described
    there) then `make_apply_fn`.
    """
    if library_recipe(recipe) is not None:
        fn = _library_step(recipe, gpt, tx, grad_hook, param_hook).fn

        def library_update(state: TrainState, tokens, targets):
            new, metrics = fn(scalify.recipes.TrainState(state.params, state.opt_state, state.step),
                              (tokens, targets))
            return TrainState(new.params, new.opt_state, state.extra, new.step), metrics["loss"]

        return library_update
    grads_of = make_grad_fn(recipe, gpt, grad_hook, param_hook)
    apply = make_apply_fn(recipe, tx, seed)

    def update(state: TrainState, tokens, targets):
        grads, extra_grads, loss = grads_of(state.params, state.extra, tokens, targets)
        return apply(state, grads, extra_grads), loss

    return update


def scalify_step(recipe: Recipe, fn: Callable) -> Callable:
    """`scalify.scalify(fn)`, traced under the recipe's `ScalifyConfig` (`Recipe.scalify_config`)."""
    inner = scalify.scalify(fn)
    config = recipe.make_scalify_config()
    if config is None:
        return inner

    @functools.wraps(fn)
    def configured(*args, **kwargs):
        with config:
            return inner(*args, **kwargs)

    return configured


def train_step_of(recipe: Recipe, update: Callable, use_scalify: bool | None = None) -> Callable:
    """``step(state, tokens, targets) -> (state, loss)`` of an update function (the
    signature of `make_update_fn`'s): `update` scalified (`scalify_step`; by default for
    scalify recipes), the new state conformed to the input's leaf types and the loss a
    plain float32 value."""
    use_scalify = recipe.scalify if use_scalify is None else use_scalify
    inner = scalify_step(recipe, update) if use_scalify else update

    def step(state, tokens, targets):
        new_state, loss = inner(state, tokens, targets)
        return conform(new_state, state), materialize(loss)

    return step


def make_train_step(recipe: Recipe, gpt: GPTConfig, tx: optax.GradientTransformation, *,
                    seed: int = 0, use_scalify: bool | None = None, jit: bool = True,
                    donate: bool = False, param_hook: Callable | None = None) -> Callable:
    """`step(state, tokens, targets) -> (state, loss)` (loss: float32 scalar array).

    Args:
      use_scalify: transform with `scalify.scalify` (default: `recipe.scalify`); False runs
        the same update function in plain JAX (on `plain_state(state)`).
      jit: `jax.jit` the step (False: op-by-op, e.g. for fast CPU smoke tests, where XLA
        compiles the scalified step slowly).
      donate: donate the state buffers to the jitted step.
      param_hook: see `make_update_fn`.
    """
    update = make_update_fn(recipe, gpt, tx, seed, param_hook=param_hook)
    use_scalify = recipe.scalify if use_scalify is None else use_scalify
    step = train_step_of(recipe, update, use_scalify)
    if jit:
        return jax.jit(step, donate_argnums=(0,) if donate else (),
                       compiler_options=compiler_options(recipe, use_scalify))
    return step


def compiler_options(recipe: Recipe, use_scalify: bool | None = None) -> dict:
    """XLA options of the jitted step: `scalify.compiler_options()` for a scalified step,
    XLA's defaults for a plain one."""
    use_scalify = recipe.scalify if use_scalify is None else use_scalify
    return scalify.compiler_options() if use_scalify else {}


class StepPair(NamedTuple):
    """A recipe's scalified train step and the same step without scalify, as factories of
    fresh jitted functions, with abstract arguments (`jax.ShapeDtypeStruct` leaves): the
    two programs whose trace, compile time and compiled size can be compared."""

    scaled: Callable[[], Callable]
    args: tuple
    plain: Callable[[], Callable]
    plain_args: tuple


def abstract_step_pair(recipe: Recipe, model: str = "tiny", seq_len: int | None = None,
                       batch_size: int = 8, **overrides) -> StepPair:
    """The `StepPair` of `recipe` on preset `model` (`seq_len`: the preset's when None;
    `overrides`: GPTConfig fields)."""
    gpt = gpt_config(recipe, model, **({} if seq_len is None else {"seq_len": seq_len}),
                     **overrides)
    tx = make_optimizer(recipe, OptimConfig(lr=1e-4, warmup_steps=10, total_steps=1000))
    state = jax.eval_shape(lambda: init_state(recipe, gpt, tx, seed=0))
    x = jax.ShapeDtypeStruct((batch_size, gpt.seq_len), jnp.int32)
    return StepPair(
        scaled=lambda: make_train_step(recipe, gpt, tx),
        args=(state, x, x),
        plain=lambda: jax.jit(make_train_step(recipe, gpt, tx, use_scalify=False, jit=False)),
        plain_args=(jax.eval_shape(plain_state, state), x, x),
    )


def make_eval_step(recipe: Recipe, gpt: GPTConfig, *, jit: bool = True) -> Callable:
    """`eval(params, extra, tokens, targets) -> loss` in the recipe's precision."""
    loss_fn = make_loss_fn(gpt)
    inner = scalify_step(recipe, loss_fn) if recipe.scalify else loss_fn

    def evaluate(params, extra, tokens, targets):
        return materialize(inner(params, extra, tokens, targets))

    return jax.jit(evaluate) if jit else evaluate


def make_diagnostics_fn(recipe: Recipe, gpt: GPTConfig, *, jit: bool = True) -> Callable:
    """`diag(params, extra, tokens, targets) -> (loss, activations, grads)`: the module
    outputs (Flax ``capture_intermediates``) and the gradients, as scalify returns them
    (ScaledArray leaves: their scales are what the histograms show)."""
    model = GPT(gpt)

    def diag(params, extra, tokens, targets):
        def loss_fn(p):
            variables = {"params": p}
            if extra:
                variables[FLAX_FP8_COLLECTION] = extra
            logits, inter = model.apply(variables, tokens, padded_logits=True,
                                        capture_intermediates=True, mutable=["intermediates"])
            return cross_entropy_loss(logits, targets, vocab_size=gpt.vocab_size), inter["intermediates"]

        if recipe.scalify and recipe.scaled_master and recipe.param_grads_f32:  # as in update
            params = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params)
        (loss, acts), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, acts, grads

    inner = scalify_step(recipe, diag) if recipe.scalify else diag
    return jax.jit(inner) if jit else inner


# ----------------------------------------------------------------------------- scales


def _path_name(path) -> str:
    parts = []
    for k in path:
        name = getattr(k, "key", None)
        if name is None:
            name = getattr(k, "name", None)
        if name is None:
            name = getattr(k, "idx", k)
        parts.append(str(name))
    return "/".join(parts)


def scale_summary(tree: Any) -> dict[str, float]:
    """``{path: log2(scale)}`` of every ScaledArray with a scalar scale in `tree` (the max
    log2 for non-scalar scales); plain leaves are skipped."""
    out = {}
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_scaled_leaf)[0]
    for path, leaf in flat:
        if isinstance(leaf, ScaledArray):
            s = np.asarray(jax.device_get(leaf.scale), np.float64)
            with np.errstate(divide="ignore"):
                out[_path_name(path)] = float(np.max(np.log2(s)))
    return out


class ScalePacking:
    """A train state with its float32 scalars (the per-tensor scales) packed in one vector.

    A scalified state holds one float32 scale per tensor (300 of the 603 state leaves of
    the `paper` model with Adam, fp8 and fp16 recipes). Each is its own device buffer: an argument and a result of
    the step, and, donated, a buffer XLA copies before overwriting (one tiny memcpy each
    per step). Packed, the step takes and returns one vector for all of them.

    `pack(state) -> packed`, `unpack(packed) -> state`, `step(fn)`: `fn(state, *a) ->
    (state, out)` made `(packed, *a) -> (packed, out)`. The tree structure is that of the
    state given to the constructor.
    """

    def __init__(self, state):
        leaves, self.treedef = jax.tree_util.tree_flatten(state)
        self.mask = tuple(np.shape(x) == () and np.dtype(x.dtype) == np.float32 for x in leaves)

    def pack(self, state):
        leaves = self.treedef.flatten_up_to(state)
        rest = [x for x, m in zip(leaves, self.mask) if not m]
        scalars = [x for x, m in zip(leaves, self.mask) if m]
        return rest, (jnp.stack(scalars) if scalars else jnp.zeros((0,), jnp.float32))

    def unpack(self, packed):
        rest, vec = packed
        rest_it, k, leaves = iter(rest), 0, []
        for m in self.mask:
            if m:
                leaves.append(vec[k])
                k += 1
            else:
                leaves.append(next(rest_it))
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def step(self, fn: Callable) -> Callable:
        def packed_step(packed, *args):
            state, out = fn(self.unpack(packed), *args)
            return self.pack(state), out

        return packed_step
