"""A recipe's whole training step: `init(params) -> state`, `step(state, batch) -> (state,
metrics)`, for any loss function and optax optimizer.

The step is the Scalify paper's Algorithm 1, one function transformed by `scalify.scalify`:

    loss, grads = value_and_grad(loss_fn)(view(params), batch)   # in the recipe's formats
    updates, opt_state = optimizer.update(grads, opt_state, params)  # plain float32 values
    params = apply_updates(params, updates)                      # encoded in one pass

- The parameters stay `ScaledArray`s across steps (`master_dtype` data, one power-of-two
  scale per tensor). The scale of each new value is the power of two that puts the
  largest weight *before* the update at data in (1, 2]: it is known before the update,
  so the update and its encode are one elementwise pass
  (`scalify.optim.apply_updates(scale_from="previous")`).
- With 16-bit masters the loss is differentiated at their float32 view: a weight
  gradient sums correlated contributions of every token of the batch, which can exceed
  float16 where each contribution does not.
- With `unscaled_activations` (FP8 matmuls between bfloat16 activations, `FP8_BF16`) the
  loss sees every parameter but the FP8 kernels as its plain value (`stop_scaling`):
  nothing between the FP8 GEMMs carries a scale.
- The optimizer runs on unscaled float32 values (`scalify.optim.unscaled`): power-of-two
  scales are exact in float32, so the values are those of the plain optimizer, with no
  scale arithmetic; a `state_dtype` of float16 stores its moments scaled
  (`scalify.optim.scaled_state`) and decodes them for the update.
- An FP8 recipe stores the 2-D kernels of the layers it swaps as (out, in), the layout of
  the FP8 GEMMs, and the loss sees them transposed back (`scalify.recipes.kernel_layout`):
  the optimizer state is in that layout too (`TransposedKernel` leaves of
  `TrainState.params`); `TrainStep.params` gives the model's.
- The state keeps its leaf types, dtypes and scale shapes from step to step (`conform`),
  so the jitted step compiles once.

The model's formats come from `scalify.recipes.precision` (Flax linen), active while the
loss function is traced.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from scalify.core.compiler_options import compiler_options
from scalify.core.scaled_array import ScaledArray, is_scaled_leaf
from scalify.core.statistics import NO_RECORD, delayed_statistics
from scalify.interpreter import scalify
from scalify.ops.scaling import merge_scale
from scalify.optim.master import apply_updates, scaled_params
from scalify.optim.wrappers import scaled_state, unscaled, values
from scalify.recipes.kernel_layout import TransposedKernel, to_model, to_storage
from scalify.recipes.precision import precision, unscaled_activations
from scalify.ops.scaling import stop_scaling

__all__ = ["TrainState", "TrainStep", "train_step", "wrap_optimizer", "conform"]


class TrainState(NamedTuple):
    """What a step reads and writes: the master weights, the optimizer state, the number
    of updates done (int32), the model's state that the forward pass updates and
    training does not differentiate (BatchNorm statistics; None without `has_state`), and
    the step's delayed scale statistics (float32[n], `scalify.core.statistics`; None in a
    state fresh from `init`: `TrainStep.step` sizes them on its first call)."""

    params: Any
    opt_state: Any
    step: Any
    model_state: Any = None
    statistics: Any = None


def conform(new: Any, old: Any) -> Any:
    """`new` with the leaf types, dtypes and scale shapes of `old` (same tree structure).

    A plain leaf where `old` has a ScaledArray becomes `ScaledArray(x, 1)`; a ScaledArray
    where `old` is plain is materialised; data are cast to `old`'s dtype; a finer scale
    than `old`'s (one per layer of a stacked parameter) is merged to its shape by the
    largest (`scalify.ops.scaling.merge_scale`: the same values).
    """

    def fix(n, o):
        if isinstance(o, ScaledArray):
            o_scale = jnp.asarray(o.scale)
            if not isinstance(n, ScaledArray):
                n = ScaledArray(jnp.asarray(n), jnp.ones((), o_scale.dtype))
            scale = jnp.asarray(n.scale)
            if scale.shape != o_scale.shape and scale.size != 1:
                n = merge_scale(n, o_scale.shape)
                scale = jnp.asarray(n.scale)
            if scale.shape != o_scale.shape:
                if scale.size != 1:
                    raise ValueError(f"A scale of shape {scale.shape} where the state had {o_scale.shape}.")
                scale = jnp.broadcast_to(scale.reshape(()), o_scale.shape)
            return ScaledArray.tree_unflatten(None, (n.data.astype(o.data.dtype), scale.astype(o_scale.dtype)))
        if isinstance(n, ScaledArray):
            return n.to_array(jnp.result_type(o))
        if hasattr(o, "dtype") and hasattr(n, "dtype") and n.dtype != o.dtype:
            return jnp.asarray(n).astype(o.dtype)
        return n

    return jax.tree_util.tree_map(fix, new, old, is_leaf=is_scaled_leaf)


def _committed(tree):
    """Uncommitted arrays of `tree` committed to their device: a state restored from a
    checkpoint arrives committed, and `jax.jit` compiles committed and uncommitted
    arguments separately. Committed and traced leaves are kept."""

    def commit(x):
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and not x.committed:
            return jax.device_put(x, x.sharding)
        return x

    return jax.tree_util.tree_map(commit, tree)


def _loss_first(out_and_state, has_aux):
    """`(loss, (out, model_state))` from `(out, model_state)`: the loss for
    `value_and_grad(has_aux=True)`, everything else carried along."""
    out, model_state = out_and_state
    return (out[0] if has_aux else out), (out, model_state)


def _float32(x):
    return x.to_array(jnp.float32) if isinstance(x, ScaledArray) else jnp.asarray(x, jnp.float32)


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """A recipe's training step for one loss function and optimizer.

    Attributes:
      recipe: the `Recipe`.
      init: `init(params, *, batch=None) -> TrainState`, from float32 (or any float)
        parameters; `batch`: an example batch, to size and measure the delayed statistics
        at once (calls of the step whose state is then put back: `_measure`).
      step: `step(state, batch) -> (state, metrics)`, jitted (the state's arrays donated,
        its scalars not: `_Step`);
        metrics: `{"loss": float32}`, plus `"aux"` with `has_aux`. A state without
        delayed statistics (from `init` without a batch) gets them first.
      update: the same step, scalified and not jitted (to compose with `jax.jit` options
        or shardings).
      fn: the step before `scalify.scalify` (`update = scalify.scalify(fn)`): to wrap in
        `jax.shard_map` first and scalify the whole, so that scalify's shard_map rule
        carries the scales across the body (docs/distributed.md); or to run the same
        arithmetic on plain arrays. It returns the new state as computed: the step
        `conform`s it to the input state's leaf types and takes the loss as float32.
    """

    recipe: Any  # the scalify.recipes.Recipe
    init: Callable
    step: Callable
    update: Callable
    fn: Callable

    def params(self, state: TrainState, dtype=jnp.float32) -> Any:
        """The parameters of `state` as plain arrays of `dtype`, in the model's layout (an
        FP8 recipe stores its kernels transposed: `scalify.recipes.kernel_layout`), for
        evaluation and export."""
        return to_model(values(state.params, dtype))


def wrap_optimizer(recipe, optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    """`optimizer` as `recipe`'s step runs it: on unscaled float32 values
    (`scalify.optim.unscaled`), its float leaves of `recipe.state_min_size` elements or more
    stored as scaled `recipe.state_dtype` (`scalify.optim.scaled_state`) when that is not
    float32. Its state is `TrainState.opt_state`: for a step split into a gradient and an
    update function (gradients reduced or accumulated between the two), initialise it with
    `init(scalify.optim.values(params))` and update with the float32 gradients."""
    if recipe.state_dtype != jnp.float32:
        optimizer = scaled_state(optimizer, recipe.state_dtype, min_size=recipe.state_min_size,
                                 unscaled_values=True)
    return unscaled(optimizer)


def train_step(recipe, loss_fn: Callable, optimizer: optax.GradientTransformation, *,
               has_aux: bool = False, has_state: bool = False, jit: bool = True,
               donate: bool = True, grad_hook: Callable | None = None, fsdp=None) -> TrainStep:
    """The `TrainStep` of `recipe` (a `scalify.recipes.Recipe`) for
    `loss_fn(params, batch) -> loss` (a scalar; with `has_aux`, `(loss, aux)`) and an
    optax `optimizer`.

    With `has_state`, the model has state that its forward pass updates (Flax's
    `batch_stats`): `loss_fn(params, model_state, batch) -> (loss, new_model_state)`
    (with `has_aux`, `((loss, aux), new_model_state)`), `init(params, model_state)`, and
    the step carries it in `TrainState.model_state`.

    `init(params, model_state=None, *, batch=None)`: with an example `batch` (the shapes
    the step will see), the state's delayed statistics (`Recipe.delayed_statistics`) are
    sized and measured at once (calls of the step whose state is then put back, `_measure`), so
    that a template for restoring a checkpoint has them; otherwise the first call of
    `step` does it (`_Step`).

    `loss_fn` is the user's, unchanged: a linen model applied inside it computes in the
    recipe's formats (`scalify.recipes.precision`). `jit=False` returns `step` unjitted
    (op by op); `donate=False` keeps the input state's buffers valid. The jitted step
    takes the state's scalar leaves (the scales) undonated: XLA writes the new scales to
    fresh buffers rather than copying the old ones, which the step still reads.

    `grad_hook((grads, loss)) -> (grads, loss)`, if given, runs between the backward pass
    and the optimizer, on the gradients as the backward pass gives them (in the storage
    layout; float32 for 16-bit masters, differentiated at their float32 view) and the loss: e.g.
    the data-parallel mean of both inside a `jax.shard_map` of `TrainStep.fn`
    (`scalify.distributed.scaled_pmean`); the metrics report the loss it returns.

    `fsdp` (a `scalify.recipes.FSDP`): the state sharded over the devices of its mesh and
    the batch split over them (`scalify.recipes.fsdp`); `init` places the state so.
    """
    tx = wrap_optimizer(recipe, optimizer)
    place_statistics = (lambda x: _committed(jnp.asarray(x))) if fsdp is None else fsdp.replicate
    sixteen_bit_master = recipe.master_dtype != jnp.float32

    def init(params, model_state=None, *, batch=None) -> TrainState:
        if has_state == (model_state is None):
            raise ValueError("init(params, model_state): give the model's state (e.g. its batch_stats) "
                             "exactly when train_step was built with has_state=True.")
        if fsdp is None:  # one program rather than an op-by-op dispatch per leaf
            state = _committed(jax.jit(initial_state)(params, model_state))
        else:  # each device computes its shards only
            shardings = fsdp.state_shardings(jax.eval_shape(initial_state, params, model_state))
            state = jax.jit(initial_state, out_shardings=shardings)(*fsdp.host_or_global((params, model_state)))
        return state if batch is None else train.step.measure(state, batch)

    def initial_state(params, model_state) -> TrainState:
        params = scaled_params(to_storage(recipe, params), recipe.master_dtype)
        # From float32 values: the moments are float32 (or stored by `scaled_state`)
        # whatever the masters' format.
        # The model state copied: the step donates the state, and the caller keeps theirs.
        model_state = jax.tree_util.tree_map(jnp.copy, model_state)
        return TrainState(params, tx.init(values(params)), jnp.zeros((), jnp.int32), model_state)

    def loss_and_state(params, model_state, batch):
        """(out, new model state): `loss_fn`'s output and state in one auxiliary pair."""
        if has_state:
            return loss_fn(params, model_state, batch)
        return loss_fn(params, batch), model_state

    plain = unscaled_activations(recipe)

    def update(state: TrainState, batch):
        params = state.params
        view = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params) if sixteen_bit_master else params

        def objective(p):  # p in the storage layout: the gradients come in it
            if fsdp is not None:
                p = fsdp.gather(recipe, p)
            if plain:
                p = _unscaled_but_fp8_kernels(p)
            return _loss_first(loss_and_state(to_model(p), state.model_state, batch), has_aux)

        with precision(recipe):
            (_, (out, model_state)), grads = jax.value_and_grad(objective, has_aux=True)(view)
        loss, aux = out if has_aux else (out, None)
        if grad_hook is not None:
            grads, loss = grad_hook((grads, loss))
        grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
        updates, opt_state = tx.update(grads, state.opt_state, params)
        if sixteen_bit_master:
            params = apply_updates(params, updates, scale_from="previous")
        else:
            params = apply_updates(params, updates, float32_scale_from="previous")
        metrics = {"loss": loss} if aux is None else {"loss": loss, "aux": aux}
        return TrainState(params, opt_state, state.step + 1, model_state), metrics

    scalified = scalify(update)

    def scaled_update(state: TrainState, batch):
        if state.statistics is None:
            return scalified(state, batch)
        with delayed_statistics(state.statistics) as stats:
            new_state, metrics = scalified(state._replace(statistics=None), batch)
        return new_state._replace(statistics=stats.recorded()), metrics

    def count_sites(state: TrainState, batch) -> int:
        counts = []

        def counted(state, batch):
            with delayed_statistics(None) as stats:
                out = scalified(state, batch)
            counts.append(stats.count)
            return out

        jax.eval_shape(counted, state._replace(statistics=None), batch)
        return counts[0]

    sizer = _StatisticsSizer(count_sites, place_statistics) if recipe.delayed_statistics else None

    def step(state: TrainState, batch):
        if fsdp is not None:
            batch = fsdp.constrain_batch(batch)
        new_state, metrics = scaled_update(state, batch)
        metrics = dict(metrics, loss=_float32(metrics["loss"]))
        new_state = conform(new_state, state)
        if fsdp is not None:
            new_state = fsdp.place(new_state)
        return new_state, metrics

    if not jit:
        train = TrainStep(recipe, init, _Step(step, sizer), scaled_update, update)
        return train

    def split_step(arrays, scalars, batch, layout):
        return step(_join_scalars(arrays, scalars, layout), batch)

    jitted = jax.jit(split_step, static_argnums=(3,), donate_argnums=(0,) if donate else (),
                     compiler_options=compiler_options())
    train = TrainStep(recipe, init, _Step(jitted, sizer, split=True), scaled_update, update)
    return train


def _unscaled_but_fp8_kernels(params):
    """The parameters as plain values (`stop_scaling`), but for the kernels the FP8 matmuls
    quantise from their master scales (`TransposedKernel` leaves)."""
    return jax.tree_util.tree_map(lambda x: x if isinstance(x, TransposedKernel) else stop_scaling(x), params,
                                  is_leaf=lambda x: isinstance(x, TransposedKernel) or is_scaled_leaf(x))


def _is_scalar(x) -> bool:
    shape = getattr(x, "shape", None)
    return (len(shape) if shape is not None else jnp.ndim(x)) == 0


def _split_scalars(state):
    """(array leaves, scalar leaves, layout) of `state`; `layout` (hashable) rebuilds it."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    scalar = tuple(_is_scalar(x) for x in leaves)
    arrays = [x for x, s in zip(leaves, scalar) if not s]
    scalars = [x for x, s in zip(leaves, scalar) if s]
    return arrays, scalars, (treedef, scalar)


def _join_scalars(arrays, scalars, layout):
    treedef, scalar = layout
    arrays, scalars = iter(arrays), iter(scalars)
    return jax.tree_util.tree_unflatten(treedef, [next(scalars) if s else next(arrays) for s in scalar])


class _StatisticsSizer:
    """Gives a state from `init` (statistics None) its delayed statistics, one NaN record
    (`statistics.NO_RECORD`: keep the propagated scale) per measured site of the step,
    counted by one abstract trace per batch signature."""

    def __init__(self, count_sites, place):
        self._count_sites, self._place = count_sites, place
        self._counts = {}

    def __call__(self, state: TrainState, batch) -> TrainState:
        if state.statistics is not None:
            return state
        leaves, treedef = jax.tree_util.tree_flatten((state, batch))
        key = (treedef, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves))
        if key not in self._counts:
            self._counts[key] = self._count_sites(state, batch)
        if not self._counts[key]:  # nothing measured: nothing to carry (and no empty array to save)
            return state
        return state._replace(statistics=self._place(np.full((self._counts[key],), NO_RECORD, np.float32)))


class _Step:
    """The step function (`jax.jit`'s, or the plain one), called as `(state, batch)`.

    A state without delayed statistics (`init` without a batch) first gets them
    (`Recipe.delayed_statistics`): sized (one abstract trace per batch signature), then
    measured by calls of the step until their records agree, the state before them kept
    on the host and put back after each (`_measure`); `init(params, batch=...)` does the
    same at once. `trace` and `lower` size them only, and the compiled step measures on its
    first call. The step itself has no measuring mode: nothing in the training program
    tests whether records exist.

    A jitted step (`split`) takes the state's scalar leaves (the per-tensor scales, the
    step count) as an argument of their own, not donated: the step reads a tensor's old
    scale after it has computed the new one (the backward pass decodes the weights, the
    update replaces their scales), so a donated scale buffer would first be copied, one
    small device copy per tensor per step; the new scalars go to fresh buffers instead."""

    def __init__(self, fn, sizer, split: bool = False):
        self._fn, self._sizer, self._split = fn, sizer, split

    def sized(self, state, batch):
        """`state` with its delayed statistics sized for `batch`'s shapes and no record yet
        (NaN), as a template or an argument to trace with; `measure` measures them (a step
        on it places its data at the propagated scales, values beyond a format
        saturating). Any other state as it is."""
        return state if self._sizer is None else self._sizer(state, batch)

    def __call__(self, state, batch):
        return _call_measured(self._fn, self._sizer, self._split, state, batch)

    def measure(self, state, batch):
        """A state without delayed statistics (from `init` without a batch) or without any
        record (`sized`'s) with them measured on `batch`, nothing else changed; any other
        state as it is."""
        blank = state.statistics is not None and bool(np.all(np.isnan(_host(state.statistics))))
        return _measure(self._fn, self._sizer, self._split, state, batch, blank=blank)

    def trace(self, state, batch):
        return _Stage(self._fn.trace(*_arguments(self._split, self.sized(state, batch), batch)), self)

    def lower(self, state, batch):
        return _Stage(self._fn.lower(*_arguments(self._split, self.sized(state, batch), batch)), self)

    def __getattr__(self, name):  # the rest of the jitted function's interface
        return getattr(self._fn, name)


def _arguments(split: bool, state, batch) -> tuple:
    if not split:
        return (state, batch)
    arrays, scalars, layout = _split_scalars(state)
    return (arrays, scalars, batch, layout)


# Measuring calls of the step on a fresh state, at most (`_measure`): each call corrects
# the sites whose inputs the previous one placed right, so data that drift through many
# sites without the guards take as many calls as the chain has such steps.
MEASURE_CALLS = 16


def _settled(before, after) -> bool:
    """Whether two record vectors agree: the same sites recorded, each within a factor 2."""
    a, b = np.asarray(before, np.float64), np.asarray(after, np.float64)
    if not np.array_equal(np.isfinite(a), np.isfinite(b)):
        return False
    live = np.isfinite(a) & (a > 0) & (b > 0)
    return bool(np.all(np.abs(np.log2(a[live]) - np.log2(b[live])) <= 1))


def _measure(fn, sizer, split, state, batch, blank: bool = False):
    """A state without delayed statistics (or, `blank`, without any record): sized, then
    measured by calls of `fn`, each placing its data from the records of the one before:
    the first from none (the propagated scales, where data that drift without the guards
    lose precision or saturate, so its records can be off by powers of two), the next from
    those, until two calls agree within a factor 2 per site (at most `MEASURE_CALLS`; a
    RuntimeWarning if they do not). The state before the calls is kept on the host
    (`_HostCopy`) and put back after each, with the new records: no update of a measuring
    call remains, and the device holds one state at a time. Traced (inside a caller's
    `jax.jit` or `jax.eval_shape`), sized only. Any other state is returned as it is."""
    if sizer is None or (state.statistics is not None and not blank):
        return state
    state = sizer(state, batch)
    if state.statistics is None:  # nothing measured in this step
        return state
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((state, batch))):
        return state
    kept = _HostCopy(state._replace(statistics=None))  # the calls donate the state
    before = _host(state.statistics)
    for _ in range(MEASURE_CALLS):
        out = fn(*_arguments(split, state, batch))
        stats = out[0].statistics
        del out  # the updated state: its buffers go before the kept one comes back
        state = kept.restore()._replace(statistics=stats)
        after = _host(stats)
        if _settled(before, after):
            return state
        before = after
    warnings.warn(f"The delayed statistics did not settle in {MEASURE_CALLS} measuring calls of the step: "
                  "its data drift too far from the scales the rules propagate for the next step to place "
                  "them from the last step's records. Train with the recipe's delayed_statistics=False "
                  "(each step decides from its own data), and check scalify.inspect.scale_health.",
                  RuntimeWarning, stacklevel=4)
    return state


class _Shards(NamedTuple):
    shape: tuple
    sharding: Any
    data: dict  # the host copy of each distinct shard, by its index


class _HostCopy:
    """A host copy of a pytree's arrays, shard by shard (one copy per distinct shard, so a
    replicated array is copied once), that `restore` puts back on the same devices with
    the same shardings. Other leaves are kept as they are."""

    def __init__(self, tree):
        leaves, self._treedef = jax.tree_util.tree_flatten(tree)
        self._leaves = [self._copy(x) if isinstance(x, jax.Array) else x for x in leaves]

    @staticmethod
    def _key(index) -> tuple:
        return tuple((s.start, s.stop, s.step) for s in index)

    def _copy(self, x):
        shards = {}
        for shard in x.addressable_shards:
            shards.setdefault(self._key(shard.index), np.asarray(shard.data))
        return _Shards(x.shape, x.sharding, shards)

    def _put(self, leaf):
        shape, sharding, shards = leaf
        per_device = sharding.addressable_devices_indices_map(shape)
        arrays = [jax.device_put(shards[self._key(index)], device) for device, index in per_device.items()]
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)

    def restore(self):
        leaves = [self._put(x) if isinstance(x, _Shards) else x for x in self._leaves]
        return jax.tree_util.tree_unflatten(self._treedef, leaves)


def _host(x) -> np.ndarray:
    """A host copy of a replicated array (this process's first shard: the whole of it)."""
    return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)


def _call_measured(fn, sizer, split, state, batch):
    return fn(*_arguments(split, _measure(fn, sizer, split, state, batch), batch))


class _Stage:
    """A traced or lowered step (`jax.stages`), whose compiled step takes `(state, batch)`."""

    def __init__(self, stage, step: _Step):
        self._stage, self._step = stage, step

    def lower(self, *args, **kwargs):
        return _Stage(self._stage.lower(*args, **kwargs), self._step)

    def compile(self, *args, **kwargs):
        return _CompiledStep(self._stage.compile(*args, **kwargs), self._step)

    def __getattr__(self, name):
        return getattr(self._stage, name)


class _CompiledStep:
    """A compiled step called as `(state, batch)`; a state without statistics is sized and
    measured first (`_Step`)."""

    def __init__(self, compiled, step: _Step):
        self._compiled, self._step = compiled, step

    def __call__(self, state, batch):
        if self._step._split:
            fn = lambda arrays, scalars, batch, layout: self._compiled(arrays, scalars, batch)  # noqa: E731
        else:
            fn = self._compiled
        return _call_measured(fn, self._step._sizer, self._step._split, state, batch)

    def __getattr__(self, name):
        return getattr(self._compiled, name)
