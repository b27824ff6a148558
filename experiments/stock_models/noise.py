"""How much one run's held-out loss moves under perturbations of float32 training, against
the FP16-master recipe (#2) and variants of it, on a model of `recipes.py`.

Variants (each run with several keys; same task, seed and protocol as `recipes.py`):

- `f32`: the float32 reference (no scalify; does not depend on the key).
- `f32-order`: float32 with the training batches in another (key-dependent) order.
- `f32-init-ulp`: float32 from initial params stochastically rounded once to the FP16
  masters' grid (per-tensor power-of-two scale, 11-bit mantissa).
- `f32-sr-ulp`: float32 with the params stochastically rounded to that grid after every
  step (what FP16 masters do to float32 weights, without FP16 compute).
- `fp16-master`: recipe #2 (FP16 compute, scalified, FP16 masters, stochastic rounding,
  float32 Adam moments).
- `fp16-master-nearest`: #2 with round-to-nearest masters.
- `f32c-master`: #2 with float32 compute (FP16 masters only).
- `...-fp16-moments`: the Adam moments initialised from the FP16 masters (`tx.init(params)`:
  optax makes them float16, with the scales that scalify propagates, not rescaled).
- `fp16-master-f32:GROUP`: #2 with the params of GROUP kept as float32 masters
  (`norm`: normalisation scale/bias; `bias`: every bias; `small`: every leaf of rank <= 1;
  `conv`: conv kernels; `dense`: the last Dense).

    python -m experiments.stock_models.noise --model cnn --seed 1 --keys 5 6 7 8 9
"""
from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import scalify
import scalify.optim as so
from experiments.stock_models import recipes
from scalify.optim.codecs import ScaledCodec

GROUPS = {
    "all": lambda path, x: True,
    "norm": lambda path, x: "Norm" in path,
    "bias": lambda path, x: path.endswith("bias"),
    "small": lambda path, x: x.ndim <= 1,
    "conv": lambda path, x: "Conv" in path and path.endswith("kernel"),
    "dense": lambda path, x: "Dense" in path,
    "prebn-bias": lambda path, x: path.endswith("bias") and ("Conv_0" in path or "Conv_1" in path),
    "conv2-bias": lambda path, x: path.endswith("Conv_2/bias"),
    "dense-bias": lambda path, x: path.endswith("Dense_0/bias"),
}
VARIANTS = ("f32", "f32-order", "f32-init-ulp", "f32-sr-ulp", "fp16-master", "fp16-master-nearest",
            "f32c-master", "fp16-master-fp16-moments", "fp16-master-nearest-fp16-moments") + tuple(
    f"fp16-master-f32:{g}" for g in GROUPS)


def _grid(params, key):
    """Params stochastically rounded to the FP16 masters' grid (float32 values)."""
    codec = ScaledCodec(jnp.float16, 15)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    out = [codec.encode(p, None, "stochastic", key, i).to_array(jnp.float32) for i, p in enumerate(leaves)]
    return jax.tree_util.tree_unflatten(treedef, out)


def _pathstr(path):
    return "/".join(str(getattr(k, "key", k)) for k in path)


@functools.lru_cache(maxsize=None)
def _compiled(variant, cls, lr=1e-3):
    """(step, evaluate) of `variant`, jitted once for all keys."""
    master = "master" in variant
    model = cls(jnp.float16 if variant.startswith("fp16") else jnp.float32)
    tx = optax.adam(lr)
    rounding = "nearest" if variant.startswith("fp16-master-nearest") else "stochastic"

    def loss_fn(p, stats, x, y, train=False):
        out, stats = recipes.forward(model, p, stats, x, train)
        return jnp.mean((out - y) ** 2), stats

    base_step = recipes.make_step(loss_fn, tx, master, rounding)

    def step(p, s, stats, x, y, k):
        p, s, stats, loss = base_step(p, s, stats, x, y, k)
        return (_grid(p, k) if variant == "f32-sr-ulp" else p), s, stats, loss

    evaluate = lambda p, stats, x, y: loss_fn(p, stats, x, y)[0]  # noqa: E731
    if master:
        return jax.jit(scalify.scalify(step)), jax.jit(scalify.scalify(evaluate)), tx
    return jax.jit(step), jax.jit(evaluate), tx


def train(variant, cls, data, held_out, params, key):
    xs, ys = data
    steps = xs.shape[0]
    if variant == "f32-order":
        perm = np.asarray(jax.random.permutation(jax.random.PRNGKey(key), steps))
        xs, ys = xs[perm], ys[perm]
    step, evaluate, tx = _compiled(variant, cls)
    stats = params.get("batch_stats")
    params = {"params": params["params"]}
    if "master" in variant:
        keep = GROUPS[variant.split(":")[1]] if ":" in variant else (lambda path, x: False)
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: x if keep(_pathstr(path), x) else so.scaled_params(x), params)
    elif variant == "f32-init-ulp":
        params = _grid(params, jax.random.PRNGKey(key))
    state = tx.init(params if variant.endswith("fp16-moments") or "master" not in variant else so.values(params))
    rkey = jax.random.PRNGKey(key)
    evals = []
    for i in range(steps):
        params, state, stats, _ = step(params, state, stats, xs[i], ys[i], jax.random.fold_in(rkey, i))
        if i % 10 == 9 and i >= steps - 50:
            evals.append(float(scalify.asarray(evaluate(params, stats, *held_out))))
    return float(np.mean(evals[-5:]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(recipes.MODELS), default="cnn")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keys", type=int, nargs="+", default=[5, 6, 7])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    t0 = time.time()
    cls, data, held_out, params = recipes.make_task(a.model, a.seed, a.steps, 32)
    ref = train("f32", cls, data, held_out, params, 0)
    res = {}
    lines = [f"Model `{a.model}`, seed {a.seed}: held-out loss vs float32 ({ref:.5f}), keys {a.keys}", "",
             "| variant | " + " | ".join(f"key {k}" for k in a.keys) + " | mean | std |",
             "|---|" + "---|" * (len(a.keys) + 2)]
    for v in a.variants.split(","):
        if v == "f32":
            continue
        keys = a.keys[:1] if v.startswith("fp16-master-nearest") else a.keys
        res[v] = [train(v, cls, data, held_out, params, k) for k in keys]
        rel = [100 * (r / ref - 1) for r in res[v]]
        cells = [f"{r:+.2f}%" for r in rel] + [""] * (len(a.keys) - len(rel))
        lines.append(f"| `{v}` | " + " | ".join(cells) + f" | {np.mean(rel):+.2f}% | {np.std(rel):.2f}% |")
        print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    print(f"{time.time() - t0:.0f} s, jax {jax.__version__}, {jax.devices()[0].platform}")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{a.model}_noise.md").write_text(table)
        (out / f"{a.model}_noise.json").write_text(json.dumps({"args": vars(a), "f32": ref, "results": res}, indent=1))


if __name__ == "__main__":
    main()
