"""One differential harness for every model of the zoo: the same training step run plainly
and through `scalify`, in float32, with float16 compute and with the FP8 swap, and the
gradients of a tiny loss.

A driver per framework trains a model the way that framework's users do:

- linen: `params = scalify.as_scaled_array(params)`, `jax.jit(scalify.scalify(step))`,
  plain optax inside the step (the README's recipe); BatchNorm statistics travel as a
  mutable collection; float16 compute is the model's `dtype=jnp.float16`; the FP8 swap is
  `with scalify.nn.fp8_everywhere():` around `model.apply` inside the traced step.
- NNX: `nnx.Optimizer` updated in place under `nnx.jit(scalify.scalify(step))`; float16
  compute is `dtype=jnp.float16`; the FP8 swap is `nnx.Linear(dot_general=
  scalify.nn.fp8_dot_general)` (`fp8_everywhere` intercepts linen modules only).
- Equinox: `eqx.filter_jit(scalify.scalify(step))`; float16 compute casts the module's
  float arrays to float16 inside the loss (float32 masters); Equinox layers have no hook
  for their contraction, so no FP8 swap.

Every run starts from the same float32 parameters and trains for `STEPS` steps of
`optax.adamw(LR)` on its task's fixed batch, returning the loss of every step and the final
parameters; runs are cached per process (the checks of one model share its reference runs).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable

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
    params: list  # float64 leaves of the final parameters


def leaves(tree) -> list:
    """float64 numpy leaves of a pytree of arrays and ScaledArrays (in tree order)."""
    return [np.asarray(scalify.asarray(t), np.float64) for t in jax.tree.leaves(tree, is_leaf=scalify.is_scaled_leaf)]


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


# ---------------------------------------------------------------------------------------
# Flax linen
# ---------------------------------------------------------------------------------------
class LinenDriver:
    fp8_swap = True

    def __init__(self, cls, task):
        self.cls, self.task = cls, task
        self.batch = task.batch()
        variables = jax.jit(cls(dtype=jnp.float32).init)(jax.random.PRNGKey(0), self.batch[0])
        self.params = variables["params"]
        self.state = {k: v for k, v in variables.items() if k != "params"}  # e.g. batch_stats

    def _loss(self, dtype, fp8, mult=1.0):
        model = self.cls(dtype=_dtype(dtype))
        objective = self.task.objective

        def loss(params, state, x, y):
            with scalify.nn.fp8_everywhere() if fp8 else contextlib.nullcontext():
                if state:
                    out, state = model.apply({"params": params, **state}, x, mutable=list(state))
                else:
                    out = model.apply({"params": params}, x)
            return objective(out, y) * mult, state

        return loss

    def train(self, dtype, fp8, scalified, steps=STEPS) -> Run:
        loss_fn, opt = self._loss(dtype, fp8), optimizer()

        def step(params, opt_state, state, x, y):
            (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, x, y)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, state, loss

        p, s, st = self.params, opt.init(self.params), self.state
        if scalified:
            # the optimizer state and statistics as ScaledArrays too: the types the
            # scalified step returns, so that it compiles once
            p, s, st = (scalify.as_scaled_array(t) for t in (p, s, st))
            step = scalify.scalify(step)
        step = jax.jit(step)
        losses = []
        with precision_for(dtype):
            for _ in range(steps):
                p, s, st, loss = step(p, s, st, *self.batch)
                losses.append(float(scalify.asarray(loss)))
        return Run(np.array(losses), leaves(p))

    def grads(self, dtype, scalified, mult=1.0) -> list:
        loss_fn = self._loss(dtype, False, mult)
        grad = jax.grad(lambda p, st, x, y: loss_fn(p, st, x, y)[0])
        p, st = self.params, self.state
        if scalified:
            p, st = scalify.as_scaled_array(p), scalify.as_scaled_array(st)
            grad = scalify.scalify(grad)
        with precision_for(dtype):
            return leaves(jax.jit(grad)(p, st, *self.batch))


# ---------------------------------------------------------------------------------------
# Flax NNX
# ---------------------------------------------------------------------------------------
class NnxDriver:
    """`make(dtype, dot_general)` builds the model from seed 0 (float32 parameters
    whatever the compute dtype)."""

    fp8_swap = True

    def __init__(self, make, task):
        self.make, self.task = make, task
        self.batch = task.batch()

    def _model(self, dtype, fp8, scalified):
        from flax import nnx

        kw = {"dot_general": scalify.nn.fp8_dot_general} if fp8 else {}
        model = self.make(_dtype(dtype), **kw)
        if scalified:
            nnx.update(model, scalify.as_scaled_array(nnx.state(model, nnx.Param)))
        return model

    def train(self, dtype, fp8, scalified, steps=STEPS) -> Run:
        from flax import nnx

        objective = self.task.objective
        model = self._model(dtype, fp8, scalified)
        opt = nnx.Optimizer(model, optimizer(), wrt=nnx.Param)
        if scalified:  # the Adam moments as ScaledArrays, the type the step returns: one compile
            nnx.update(opt, scalify.as_scaled_array(nnx.state(opt, nnx.OptState)))

        def step(model, opt, x, y):
            loss, grads = nnx.value_and_grad(lambda m: objective(m(x), y))(model)
            opt.update(model, grads)
            return loss

        step = nnx.jit(scalify.scalify(step) if scalified else step)
        losses = []
        with precision_for(dtype):
            for _ in range(steps):
                losses.append(float(scalify.asarray(step(model, opt, *self.batch))))
        return Run(np.array(losses), leaves(nnx.state(model, nnx.Param)))

    def grads(self, dtype, scalified, mult=1.0) -> list:
        from flax import nnx

        objective = self.task.objective
        model = self._model(dtype, False, scalified)

        def grad(m, x, y):
            return nnx.grad(lambda m: objective(m(x), y) * mult)(m)

        grad = nnx.jit(scalify.scalify(grad) if scalified else grad)
        with precision_for(dtype):
            return leaves(grad(model, *self.batch))


# ---------------------------------------------------------------------------------------
# Equinox
# ---------------------------------------------------------------------------------------
def _half(model):
    """An Equinox model's float arrays cast to float16 (float32 masters, float16 compute)."""
    import equinox as eqx

    return jax.tree.map(lambda p: p.astype(jnp.float16) if eqx.is_inexact_array(p) else p, model)


class EqxDriver:
    """`make(key)` builds the float32 model; the model maps one example (`jax.vmap` over
    the batch, as Equinox users write it)."""

    fp8_swap = False

    def __init__(self, make, task):
        self.make, self.task = make, task
        self.batch = task.batch()

    def _loss(self, dtype, mult=1.0):
        objective = self.task.objective

        def loss(model, x, y):
            if dtype == F16:
                model = _half(model)
                x = x.astype(jnp.float16) if jnp.issubdtype(x.dtype, jnp.floating) else x
            return objective(jax.vmap(model)(x), y) * mult

        return loss

    def train(self, dtype, fp8, scalified, steps=STEPS) -> Run:
        import equinox as eqx

        assert not fp8, "Equinox layers have no FP8 swap"
        loss_fn, opt = self._loss(dtype), optimizer()

        def step(model, opt_state, x, y):
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
            updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), opt_state, loss

        model = self.make(jax.random.PRNGKey(0))
        state = opt.init(eqx.filter(model, eqx.is_array))
        if scalified:
            model, state = scalify.as_scaled_array(model), scalify.as_scaled_array(state)
            step = scalify.scalify(step)
        step = eqx.filter_jit(step)
        losses = []
        with precision_for(dtype):
            for _ in range(steps):
                model, state, loss = step(model, state, *self.batch)
                losses.append(float(scalify.asarray(loss)))
        return Run(np.array(losses), leaves(eqx.filter(model, eqx.is_array)))

    def grads(self, dtype, scalified, mult=1.0) -> list:
        import equinox as eqx

        grad = eqx.filter_grad(self._loss(dtype, mult))
        model = self.make(jax.random.PRNGKey(0))
        if scalified:
            model, grad = scalify.as_scaled_array(model), scalify.scalify(grad)
        with precision_for(dtype):
            return leaves(eqx.filter(eqx.filter_jit(grad)(model, *self.batch), eqx.is_array))
