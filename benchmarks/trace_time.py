"""Trace + lower time of the scalified NanoGPT step against the same step without scalify.

    python benchmarks/trace_time.py --out benchmarks/results   # CPU is fine: nothing runs

The goal: scalify trace + lower <= 1.5x plain `jit`. Tracing and lowering do not
execute the step, so this runs on abstract values (`jax.eval_shape`) on any backend. Per
config: the scalified step (`make_train_step`) and the same recipe's step with
`use_scalify=False` on plain arrays, each traced and lowered in a fresh trace cache, plus
the number of jaxpr equations (nested ones included). Writes `trace_time.md`.

A third column is the interpreter's floor: the same scalified step given the plain state
(no ScaledArray input), so `scalify` traces the step to a jaxpr and re-binds every
equation as is, with no scale rule to run (only the scaling ops' own equations). No
choice of scale rules can make the scalified step cheaper than that.
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import jax.numpy as jnp

from experiments.nanogpt import configs as C
from experiments.nanogpt import step as S


def count_eqns(jaxpr) -> int:
    n = 0
    for e in jaxpr.eqns:
        n += 1
        for v in e.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += count_eqns(inner)
    return n


def timed(make_fn, args, repeats: int = 1):
    """(trace s, lower s, equations) of `make_fn()` on `args`: the fastest of `repeats`
    runs by trace + lower, each on a fresh function after `jax.clear_caches()`."""
    best = None
    for _ in range(repeats):
        jax.clear_caches()
        fn = make_fn()
        t0 = time.perf_counter()
        traced = fn.trace(*args)
        t1 = time.perf_counter()
        traced.lower()
        t2 = time.perf_counter()
        if best is None or (t2 - t0) < best[0] + best[1]:
            best = (t1 - t0, t2 - t1, traced)
    return best[0], best[1], count_eqns(best[2].jaxpr.jaxpr)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="paper")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--configs", default="fp32,fp16,fp8")
    p.add_argument("--repeats", type=int, default=3, help="keep the fastest of this many runs")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    rows = []
    for name in a.configs.split(","):
        recipe = C.get_recipe(name)
        gpt = S.gpt_config(recipe, a.model, seq_len=a.seq_len)
        tx = S.make_optimizer(recipe, S.OptimConfig(lr=1e-4, warmup_steps=10, total_steps=1000))
        state = jax.eval_shape(lambda: S.init_state(recipe, gpt, tx, seed=0))  # noqa: B023
        x = jax.ShapeDtypeStruct((a.batch_size, gpt.seq_len), jnp.int32)
        pstate = jax.eval_shape(S.plain_state, state)
        scaled = timed(lambda: S.make_train_step(recipe, gpt, tx), (state, x, x), a.repeats)  # noqa: B023
        floor = timed(lambda: S.make_train_step(recipe, gpt, tx), (pstate, x, x), a.repeats)  # noqa: B023
        plain = timed(lambda: jax.jit(S.make_train_step(recipe, gpt, tx, use_scalify=False, jit=False)),  # noqa: B023
                      (pstate, x, x), a.repeats)
        rows.append((name, scaled, floor, plain))
        print(name, scaled, floor, plain, flush=True)
    lines = [
        "# Trace + lower time: scalified NanoGPT step vs the same step without scalify", "",
        f"`python benchmarks/trace_time.py --model {a.model} --seq-len {a.seq_len} "
        f"--batch-size {a.batch_size} --configs {a.configs} --repeats {a.repeats}` on "
        f"{platform.machine()} ({jax.default_backend()}), jax {jax.__version__}; times are the "
        f"fastest of {a.repeats} runs, each on a fresh function after `jax.clear_caches()`.", "",
        "| config | scalify trace (s) | lower (s) | equations | floor: scalify, unscaled "
        "inputs, trace+lower (s) | equations | plain trace (s) | lower (s) | equations | "
        "trace+lower ratio | floor ratio |", "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (st, sl, se), (ft, fl, fe), (pt, pl, pe) in rows:
        lines.append(f"| {name} | {st:.2f} | {sl:.2f} | {se} | {ft + fl:.2f} | {fe} | {pt:.2f} | "
                     f"{pl:.2f} | {pe} | {(st + sl) / (pt + pl):.2f}x | {(ft + fl) / (pt + pl):.2f}x |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "trace_time.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
