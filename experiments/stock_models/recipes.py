"""The paper's low-precision recipes on stock Flax models nobody tuned for scalify.

A teacher-student regression: a randomly initialised float32 copy of the model (another
seed) labels fresh Gaussian inputs (output normalised to unit variance, plus noise of
std 0.1, so the best loss is 0.01), and the student trains online on new batches with
optax Adam, so the loss measures learning rather than memorisation. The metric is the
held-out loss (1024 samples) averaged over the last 5 of every 10 steps' evaluations.

Recipes (all scalified with `jax.jit(scalify.scalify(step))`, Flax `dtype=float16`):

- `fp16` (#1): float32 params as ScaledArrays (`scalify.as_scaled_array`).
- `fp16-master` (#2): FP16 master weights (`scalify.optim.scaled_params`), updated by
  `scalify.optim.apply_updates` with stochastic rounding; the model is differentiated
  at the float32 view `scalify.optim.values(params)`, and the Adam moments are float32
  (`tx.init(scalify.optim.values(params))`).
- `fp8` (#3): #2 with every Dense in FP8 (`scalify.nn.fp8_everywhere()`).
- `fp8-fp16-state` (#4): #3 with the Adam state in FP16 (`scalify.optim.scaled_state`).

and the same model plainly (no scalify) in float32 (the reference), float16, and with the
FP8 swap in float32 (`plain-fp8`: what FP8 itself costs at this size).

    python -m experiments.stock_models.recipes --model transformer --seeds 0 1 --out DIR
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import scalify
import scalify.optim as so
from scalify.nn import fp8_everywhere


class TinyTransformer(nn.Module):
    """A pre-LayerNorm block with Flax's SelfAttention and a causal mask."""

    dtype: object = jnp.float16

    @nn.compact
    def __call__(self, x):
        dt = self.dtype
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = nn.Dense(32, dtype=dt)(x)
        h = nn.LayerNorm(dtype=dt)(x)
        x = x + nn.SelfAttention(num_heads=4, deterministic=True, dtype=dt)(h, mask=mask)
        h = nn.LayerNorm(dtype=dt)(x)
        x = x + nn.Dense(32, dtype=dt)(nn.gelu(nn.Dense(64, dtype=dt)(h)))
        out = nn.Dense(1, dtype=dt)(nn.LayerNorm(dtype=dt)(x)).mean(axis=1)
        return out.astype(jnp.float32)


class DeepMLP(nn.Module):
    dtype: object = jnp.float16
    depth: int = 8

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.gelu(nn.Dense(64, dtype=self.dtype)(x))
        return nn.Dense(1, dtype=self.dtype)(x).astype(jnp.float32)


class SmallCNN(nn.Module):
    """Conv + BatchNorm + a residual block (BatchNorm's batch statistics in training, its
    running averages for the held-out loss)."""

    dtype: object = jnp.float16

    @nn.compact
    def __call__(self, x, train=False):
        dt = self.dtype
        norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=dt)  # noqa: E731
        x = nn.relu(norm()(nn.Conv(16, (3, 3), dtype=dt)(x)))
        h = nn.relu(norm()(nn.Conv(16, (3, 3), dtype=dt)(x)))
        x = x + nn.Conv(16, (3, 3), dtype=dt)(h)
        return nn.Dense(1, dtype=dt)(x.mean(axis=(1, 2))).astype(jnp.float32)


MODELS = {"transformer": (TinyTransformer, (8, 16)), "mlp": (DeepMLP, (64,)), "cnn": (SmallCNN, (8, 8, 3))}
RECIPES = ("f32", "plain-f16", "plain-fp8", "fp16", "fp16-master", "fp8", "fp8-fp16-state")


def make_task(model: str, seed: int, steps: int, batch: int):
    """(model class, training batches xs/ys, held-out x/y, initial float32 params)."""
    cls, shape = MODELS[model]
    teacher = cls(jnp.float32)
    # jitted: the model's init and forward pass compile once each (op by op, every
    # primitive of Flax's init and apply is a program of its own)
    init, apply = jax.jit(teacher.init), jax.jit(teacher.apply)
    tparams = init(jax.random.PRNGKey(1000 + seed), jnp.zeros((2,) + shape))
    probe = apply(tparams, jax.random.normal(jax.random.PRNGKey(3), (1024,) + shape))
    mean, std = probe.mean(), probe.std()

    @functools.partial(jax.jit, static_argnums=1)
    def sample(key, n):
        x = jax.random.normal(key, (n,) + shape)
        noise = 0.1 * jax.random.normal(jax.random.fold_in(key, 7), (n, 1))
        return x, (teacher.apply(tparams, x) - mean) / std + noise

    xs, ys = sample(jax.random.PRNGKey(1 + 100 * seed), steps * batch)
    xs, ys = xs.reshape((steps, batch) + shape), ys.reshape(steps, batch, 1)
    held_out = sample(jax.random.PRNGKey(2 + 100 * seed), 1024)
    params = init(jax.random.PRNGKey(seed), xs[0])
    return cls, (xs, ys), held_out, params


def forward(model, p, stats, x, train):
    """(output, BatchNorm statistics): `model` on `x`, with its batch statistics updated in
    training (stats None: a model without BatchNorm)."""
    if stats is None:
        return model.apply(p, x), None
    if not train:
        return model.apply({**p, "batch_stats": stats}, x), stats
    out, new = model.apply({**p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
    return out, new["batch_stats"]


def make_step(loss_fn, tx, master: bool, rounding: str = "stochastic"):
    """The training step `(params, opt_state, stats, x, y, key) -> (params, opt_state,
    stats, loss)`: FP16 masters are differentiated at their float32 view and updated with
    `rounding` (`key` seeds stochastic rounding); other params with optax."""
    def step(p, s, stats, x, y, key):
        (loss, stats), g = jax.value_and_grad(loss_fn, has_aux=True)(
            so.values(p) if master else p, stats, x, y, True)
        u, s = tx.update(g, s, p)
        if master:
            return so.apply_updates(p, u, rounding=rounding, key=key), s, stats, loss
        return optax.apply_updates(p, u), s, stats, loss

    return step


def train(recipe: str, cls, data, held_out, params, lr: float = 1e-3, full_curve: bool = True,
          rounding_key: int = 5, compiler_options: dict | None = None) -> dict:
    """Train with `recipe`; returns the final held-out loss and the loss curve ((step, loss)
    every 10 steps; with `full_curve=False` only at step 10 and over the last 50 steps).
    `rounding_key` seeds the stochastic rounding of the FP16 masters; `compiler_options`
    are XLA's options for the jitted step and evaluation (`jax.jit(compiler_options=...)`)."""
    xs, ys = data
    steps = xs.shape[0]
    plain = recipe in ("f32", "plain-f16", "plain-fp8")
    model = cls(jnp.float32 if recipe in ("f32", "plain-fp8") else jnp.float16)
    fp8 = recipe in ("plain-fp8", "fp8", "fp8-fp16-state")
    master = recipe in ("fp16-master", "fp8", "fp8-fp16-state")
    tx = so.scaled_state(optax.adam(lr)) if recipe == "fp8-fp16-state" else optax.adam(lr)

    stats = params.get("batch_stats")  # BatchNorm's running averages, if any
    params = {"params": params["params"]}

    def loss_fn(p, stats, x, y, train=False):
        with fp8_everywhere() if fp8 else contextlib.nullcontext():
            out, stats = forward(model, p, stats, x, train)
        return jnp.mean((out - y) ** 2), stats

    step = make_step(loss_fn, tx, master)

    def evaluate(p, stats, x, y):
        return loss_fn(p, stats, x, y)[0]

    jit = functools.partial(jax.jit, compiler_options=compiler_options)
    if plain:
        step, evaluate = jit(step), jit(evaluate)
    else:
        step, evaluate = jit(scalify.scalify(step)), jit(scalify.scalify(evaluate))

    # The initial parameters and optimizer state, jitted: the values of the eager calls in
    # one program, where op by op every leaf shape would compile programs of its own.
    @jax.jit
    def initial(params):
        if not plain:
            params = so.scaled_params(params, jnp.float16) if master else scalify.as_scaled_array(params)
        # FP16 masters keep float32 Adam moments (optax makes the moments in the params'
        # dtype: `tx.init(params)` would give #2 and #3 unscaled FP16 moments; FP16 moments
        # are #4's)
        state = tx.init(so.values(params) if master and recipe != "fp8-fp16-state" else params)
        if not plain:  # float moments as ScaledArrays (zeros: scale 1, the same values), the
            state = scalify.as_scaled_array(state)  # type the scalified step returns: one compile
        return params, state

    params, state = initial(params)
    key = jax.random.PRNGKey(rounding_key)
    evals = []
    for i in range(steps):
        params, state, stats, _ = step(params, state, stats, xs[i], ys[i], jax.random.fold_in(key, i))
        if i % 10 == 9 and (i < 10 or i >= steps - 50 or full_curve):
            evals.append((i + 1, float(scalify.asarray(evaluate(params, stats, *held_out)))))
    return {"final": float(np.mean([v for _, v in evals[-5:]])), "curve": evals}


def run(model: str, seeds, steps: int, batch: int, recipes=RECIPES, full_curve: bool = True,
        rounding_key: int = 5, compiler_options: dict | None = None) -> dict:
    out = {}
    for seed in seeds:
        cls, data, held_out, params = make_task(model, seed, steps, batch)
        out[seed] = {r: train(r, cls, data, held_out, params, full_curve=full_curve,
                              rounding_key=rounding_key, compiler_options=compiler_options)
                     for r in recipes}
    return out


def markdown(model: str, results: dict) -> str:
    seeds = list(results)
    head = "| recipe | " + " | ".join(f"seed {s} | vs f32" for s in seeds) + " |"
    lines = [head, "|---|" + "---|---|" * len(seeds)]
    for r in results[seeds[0]]:
        cells = []
        for s in seeds:
            v, ref = results[s][r]["final"], results[s]["f32"]["final"]
            cells.append(f"{v:.5f} | {100 * (v / ref - 1):+.2f}%")
        lines.append(f"| `{r}` | " + " | ".join(cells) + " |")
    return f"Model `{model}`: held-out loss (mean of the last 5 evaluations)\n\n" + "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="transformer")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated, f32 first")
    p.add_argument("--rounding-key", type=int, default=5, help="seed of the masters' stochastic rounding")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    t0 = time.time()
    results = run(a.model, a.seeds, a.steps, a.batch, tuple(a.recipes.split(",")), rounding_key=a.rounding_key)
    table = markdown(a.model, results)
    print(table)
    print(f"{time.time() - t0:.0f} s, jax {jax.__version__}, {jax.devices()[0].platform}")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{a.model}.md").write_text(table)
        (out / f"{a.model}.json").write_text(json.dumps({"args": vars(a), "results": results}, indent=1))


if __name__ == "__main__":
    main()
