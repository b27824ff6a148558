"""Stock Flax models under the README's recipe, against plain JAX (CPU is enough).

Prints a Markdown report:
- a 16-layer Flax MLP (default init) trained 5 steps with optax.adam(1e-3) in float32:
  largest parameter difference to plain JAX (relative to the model's largest parameter) and
  the final loss, with `as_scaled_array`'s default (RMS) scales and with `scale=1.0`;
- the model zoo's float16-compute models (a transformer block, a 16-layer MLP, a
  bidirectional LSTM over sequences of data-dependent lengths): final loss after 30 Adam
  steps for float32, plain float16 and scalify float16; and, with the loss multiplied by
  2^-20, the cosine of the gradient with float32's and the number of all-zero gradient
  leaves.

Usage: python benchmarks/stock_models.py [--models bilstm,transformer] [--no-mlp] [--out FILE]
"""
import argparse
import datetime
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "e2e"))
import scalify  # noqa: E402
import test_model_zoo as zoo  # noqa: E402  (the zoo's models)

jax.config.update("jax_default_matmul_precision", "highest")
LEAF = lambda t: isinstance(t, scalify.ScaledArray)  # noqa: E731


def mlp_adam(scale, config=None):
    with scalify.ScalifyConfig(**(config or {})):
        return _mlp_adam(scale)


def _mlp_adam(scale):
    model, shape = zoo.MODELS["mlp16-relu"]
    x, y, params, extra = zoo._problem(model, shape)
    opt = optax.adam(1e-3)
    step = zoo._make_step(model, opt, extra)
    p, s, st = params, opt.init(params), extra
    sp, ss, sst = scalify.as_scaled_array(params, scale=scale), opt.init(params), extra
    for _ in range(5):
        p, s, st, loss = jax.jit(step)(p, s, st, x, y)
        sp, ss, sst, sloss = jax.jit(scalify.scalify(step))(sp, ss, sst, x, y)
    largest = max(float(jnp.max(jnp.abs(a))) for a in jax.tree.leaves(p))
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
               zip(jax.tree.leaves(p), jax.tree.leaves(scalify.asarray(sp))))
    return diff / largest, float(loss), float(scalify.asarray(sloss))


def fp16_model(name):
    cls, x, y, params = zoo._fp16_problem(name)
    opt = optax.adam(3e-3)

    def make(model, mult=1.0):
        def step(p, s, x, y):
            loss, g = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2) * mult)(p)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s, loss, g
        return step

    losses = {}
    for name, fn, p in [("float32", jax.jit(make(cls(jnp.float32))), params),
                        ("plain float16", jax.jit(make(cls())), params),
                        ("scalify float16", jax.jit(scalify.scalify(make(cls()))), scalify.as_scaled_array(params))]:
        s = opt.init(params)
        for _ in range(30):
            p, s, loss, _ = fn(p, s, x, y)
        losses[name] = float(scalify.asarray(loss))
    g32 = zoo._flat(jax.jit(make(cls(jnp.float32)))(params, opt.init(params), x, y)[3])
    grads = {}
    mult = 2.0**-20
    for name, fn, p in [("plain float16", jax.jit(make(cls(), mult)), params),
                        ("scalify float16", jax.jit(scalify.scalify(make(cls(), mult))), scalify.as_scaled_array(params))]:
        g = fn(p, opt.init(params), x, y)[3]
        zeros = sum(not np.any(np.asarray(scalify.asarray(t))) for t in jax.tree.leaves(g, is_leaf=LEAF))
        grads[name] = (zoo._cos(zoo._flat(g), g32), zeros, len(jax.tree.leaves(g, is_leaf=LEAF)))
    return losses, grads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--models", default=",".join(sorted(zoo.FP16_MODELS)))
    ap.add_argument("--no-mlp", dest="mlp", action="store_false")
    a = ap.parse_args()
    lines = [f"# Stock models (jax {jax.__version__}, {jax.default_backend()}, {datetime.date.today()})", "",
             f"`python benchmarks/stock_models.py --models {a.models}{'' if a.mlp else ' --no-mlp'}`", ""]
    if a.mlp:
        lines += ["16-layer Flax MLP, optax.adam(1e-3), float32, 5 steps:", "",
                  "| entry scale | max param diff / largest param | plain loss | scalify loss |", "|---|---|---|---|"]
        for label, scale, config in [("RMS (default)", None, None), ("1.0", 1.0, None),
                                     ("1.0, `dot_drift_window=32`", 1.0, {"dot_drift_window": 32})]:
            err, lp, ls = mlp_adam(scale, config)
            lines.append(f"| {label} | {err:.3g} | {lp:.6g} | {ls:.6g} |")
        lines.append("")
    for name in a.models.split(","):
        losses, grads = fp16_model(name)
        lines += [f"`{name}`, float16 compute, optax.adam(3e-3), 30 steps:", "",
                  "| run | final loss |", "|---|---|"] + [f"| {k} | {v:.6g} |" for k, v in losses.items()]
        lines += ["", "Same model, loss x 2^-20, first gradient:", "",
                  "| run | cos with float32 gradient | all-zero leaves |", "|---|---|---|"]
        lines += [f"| {k} | {'undefined (all zero)' if z == n else f'{c:.6f}'} | {z} of {n} |"
                  for k, (c, z, n) in grads.items()]
        lines.append("")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
