"""One differential harness for every model of the zoo: the same training step run plainly
and through `scalify`, in float32, with float16 compute and with the FP8 swap; the
tiny-loss check runs the float16 step with its loss weight set to 2^-20.

A driver per framework trains a model the way that framework's users do:

- linen: `params = scalify.as_scaled_array(params)`, `jax.jit(scalify.scalify(step))`,
  plain optax inside the step (scalify without a recipe, docs/existing_model.md); BatchNorm statistics travel as a
  mutable collection; float16 compute is the model's `dtype=jnp.float16`; the FP8 swap is
  `with scalify.nn.fp8_everywhere():` around `model.apply` inside the traced step.
- NNX: `nnx.Optimizer` updated in place under `nnx.jit(scalify.scalify(step))`; float16
  compute is `dtype=jnp.float16`; the FP8 swap is `nnx.Linear(dot_general=
  scalify.nn.fp8_dot_general)` (`fp8_everywhere` intercepts linen modules only).
- Equinox: `eqx.filter_jit(scalify.scalify(step))`; float16 compute casts the module's
  float arrays to float16 inside the loss (float32 masters); Equinox layers have no hook
  for their contraction, so no FP8 swap.

Every run starts from the same float32 parameters and trains for `STEPS` steps of
`optax.adamw(LR)` on its task's fixed batch, returning the loss of every step, the final
parameters and the first step's gradients. A driver compiles each of its steps once (per
compute dtype, FP8 swap, scalified or not); tests/zoo/test_zoo.py caches the runs per
process, so the checks of one model share its reference runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import jax
import jax.numpy as jnp
import numpy as np
import optax

import scalify

STEPS = 8
LR = 3e-3
TINY = 2.0**-20  # the loss multiplier of the tiny-loss check

F32, F16 = "float32", "float16"


def optimizer():
    return optax.adamw(LR)


@dataclasses.dataclass(frozen=True)
class Run:
    losses: np.ndarray  # float64, the loss of every step (before its update)
    params: dict  # {path: float64 array} of the final parameters
    first_grads: dict  # {path: float64 array}: the gradients of the first step


# The conversions run jitted: the same values as the eager calls, in one program rather
# than op by op (an eager op compiles a program per leaf shape, which would cost more time
# than the model's training step). Equinox modules hold functions (activations) as leaves:
# `eqx.filter_jit` keeps them static.
@functools.cache
def _jitted(fn, equinox=False):
    if equinox:
        import equinox as eqx

        return eqx.filter_jit(fn)
    return jax.jit(fn)


def to_scaled(tree, equinox=False):
    """`scalify.as_scaled_array(tree)`, jitted."""
    return _jitted(scalify.as_scaled_array, equinox)(tree)


def leaves(tree) -> dict:
    """{path: float64 numpy array} of a pytree of arrays and ScaledArrays, in tree order."""
    if any(isinstance(t, scalify.ScaledArray) for t in jax.tree.leaves(tree, is_leaf=scalify.is_scaled_leaf)):
        tree = _jitted(scalify.asarray)(tree)
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path, simple=True, separator="/"): np.asarray(t, np.float64) for path, t in flat}


@contextlib.contextmanager
def precision_for(dtype: str):
    """float16 runs with JAX's default matmul precision: tests/conftest.py asks for
    "highest" (float32 model invariance), which XLA:CPU rejects for float16 dots (the
    unsupported algorithm F16_F16_F32). float32 runs keep "highest"."""
    old = jax.config.jax_default_matmul_precision
    if dtype == F16:
        jax.config.update("jax_default_matmul_precision", None)
    try:
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", old)


def _dtype(name):
    return {F32: jnp.float32, F16: jnp.float16}[name]


class Driver:
    """A framework's training loop. `train(dtype, fp8, scalified, steps, mult)` runs
    `steps` steps of the cached jitted step of (dtype, fp8, scalified) from the initial
    parameters; the step multiplies the loss by `mult`, an argument (a runtime loss
    weight, as a schedule would pass it), and returns its gradients, so that the tiny-loss
    check runs the float16 training step itself with `mult` = 2^-20."""

    fp8_swap = True

    def __init__(self, model, task):
        self.model, self.task = model, task
        self.batch = task.batch()
        self.opt = optimizer()
        self._steps = {}

    def step(self, dtype, fp8, scalified):
        key = (dtype, fp8, scalified)
        if key not in self._steps:
            self._steps[key] = self._make_step(dtype, fp8, scalified)
        return self._steps[key]

    def train(self, dtype, fp8, scalified, steps=STEPS, mult=1.0) -> Run:
        step, state = self.step(dtype, fp8, scalified), self._initial(dtype, fp8, scalified)
        # a JAX array: a traced argument (`nnx.jit` and `eqx.filter_jit` keep NumPy scalars static)
        mult = jnp.asarray(mult, jnp.float32)
        losses, first_grads = [], None
        with precision_for(dtype):
            for _ in range(steps):
                state, loss, grads = self._call(step, state, mult)
                losses.append(float(scalify.asarray(loss)))
                if first_grads is None:
                    first_grads = leaves(grads)
        return Run(np.array(losses), self._params(state), first_grads)


# ---------------------------------------------------------------------------------------
# Flax linen
# ---------------------------------------------------------------------------------------
class LinenDriver(Driver):
    def __init__(self, cls, task):
        super().__init__(cls, task)
        variables = jax.jit(cls(dtype=jnp.float32).init)(jax.random.PRNGKey(0), self.batch[0])
        self.params = variables["params"]
        self.state = {k: v for k, v in variables.items() if k != "params"}  # e.g. batch_stats

    def _make_step(self, dtype, fp8, scalified):
        model, objective, opt = self.model(dtype=_dtype(dtype)), self.task.objective, self.opt

        def loss_fn(params, state, x, y, mult):
            with scalify.nn.fp8_everywhere() if fp8 else contextlib.nullcontext():
                if state:
                    out, state = model.apply({"params": params, **state}, x, mutable=list(state))
                else:
                    out = model.apply({"params": params}, x)
            return objective(out, y) * mult, state

        def step(params, opt_state, state, x, y, mult):
            (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, x, y, mult)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, state, loss, grads

        return jax.jit(scalify.scalify(step) if scalified else step)

    def _initial(self, dtype, fp8, scalified):
        state = (self.params, _jitted(self.opt.init)(self.params), self.state)
        # the optimizer state and statistics as ScaledArrays too: the types the scalified
        # step returns, so that it compiles once
        return to_scaled(state) if scalified else state

    def _call(self, step, state, mult):
        *state, loss, grads = step(*state, *self.batch, mult)
        return state, loss, grads

    def _params(self, state):
        return leaves(state[0])


# ---------------------------------------------------------------------------------------
# Flax NNX
# ---------------------------------------------------------------------------------------
class NnxDriver(Driver):
    """`model(dtype, dot_general=...)` builds the model from seed 0 (float32 parameters
    whatever the compute dtype)."""

    def _make_step(self, dtype, fp8, scalified):
        from flax import nnx

        objective = self.task.objective

        def step(model, opt, x, y, mult):
            loss, grads = nnx.value_and_grad(lambda m: objective(m(x), y) * mult)(model)
            opt.update(model, grads)
            return loss, grads

        return nnx.jit(scalify.scalify(step) if scalified else step)

    def _initial(self, dtype, fp8, scalified):
        from flax import nnx

        kw = {"dot_general": scalify.nn.fp8_dot_general} if fp8 else {}
        model = self.model(_dtype(dtype), **kw)
        if scalified:
            nnx.update(model, to_scaled(nnx.state(model, nnx.Param)))
        opt = nnx.Optimizer(model, self.opt, wrt=nnx.Param)
        if scalified:  # the Adam moments as ScaledArrays, the type the step returns: one compile
            nnx.update(opt, to_scaled(nnx.state(opt, nnx.OptState)))
        return model, opt

    def _call(self, step, state, mult):
        loss, grads = step(*state, *self.batch, mult)  # updates the model and optimizer in place
        return state, loss, grads

    def _params(self, state):
        from flax import nnx

        return leaves(nnx.state(state[0], nnx.Param))


# ---------------------------------------------------------------------------------------
# Equinox
# ---------------------------------------------------------------------------------------
def _half(model):
    """An Equinox model's float arrays cast to float16 (float32 masters, float16 compute)."""
    import equinox as eqx

    return jax.tree.map(lambda p: p.astype(jnp.float16) if eqx.is_inexact_array(p) else p, model)


class EqxDriver(Driver):
    """`model(key)` builds the float32 model; it maps one example (`jax.vmap` over the
    batch, as Equinox users write it). No FP8 swap: Equinox layers have no hook for their
    contraction."""

    fp8_swap = False

    def __init__(self, model, task):
        super().__init__(model, task)
        self.initial = model(jax.random.PRNGKey(0))

    def _make_step(self, dtype, fp8, scalified):
        import equinox as eqx

        assert not fp8, "Equinox layers have no FP8 swap"
        objective, opt = self.task.objective, self.opt

        def loss_fn(model, x, y, mult):
            if dtype == F16:
                model = _half(model)
                x = x.astype(jnp.float16) if jnp.issubdtype(x.dtype, jnp.floating) else x
            return objective(jax.vmap(model)(x), y) * mult

        def step(model, opt_state, x, y, mult):
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y, mult)
            updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), opt_state, loss, grads

        return eqx.filter_jit(scalify.scalify(step) if scalified else step)

    def _initial(self, dtype, fp8, scalified):
        import equinox as eqx

        model = self.initial  # immutable
        state = (model, _jitted(self.opt.init)(eqx.filter(model, eqx.is_array)))
        return to_scaled(state, equinox=True) if scalified else state

    def _call(self, step, state, mult):
        import equinox as eqx

        model, opt_state, loss, grads = step(*state, *self.batch, mult)
        return (model, opt_state), loss, eqx.filter(grads, eqx.is_array)

    def _params(self, state):
        import equinox as eqx

        return leaves(eqx.filter(state[0], eqx.is_array))
