"""Compile time of a scalified deep network with and without the scale barrier.

    python benchmarks/scale_barrier_compile.py [--layers 30] [--out benchmarks/results]

`ScalifyConfig.scale_barrier` ends each rule's scale computation with an op that XLA does
not duplicate into consumer fusions. This script measures what it buys: lower + compile
time of `jax.value_and_grad` of an L-layer residual tanh MLP (16 x 64 activations, 64 x 64
weights), plain and scalified with the barrier on and off, in one process. Prints a table
and writes it to OUT/scale_barrier_compile.md.
"""
from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import scalify


def loss(x, ws):
    for i in range(ws.shape[0]):
        x = jnp.tanh(x @ ws[i]) + x
    return (x * x).mean()


def measure(fn, *args):
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    kernels = sum(1 for line in compiled.as_text().split("ENTRY", 1)[-1].splitlines()
                  if " fusion(" in line or " custom-call(" in line)
    return t1 - t0, t2 - t1, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--barriers", default="1,4,8,16,0",
                        help="ScalifyConfig.scale_barrier values to measure (0: off)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    grad = jax.value_and_grad(loss, argnums=1)
    x = jnp.ones((16, 64))
    ws = jnp.full((args.layers, 64, 64), 0.01)
    sx, sws = scalify.as_scaled_array(x), scalify.as_scaled_array(ws)
    rows = [("plain", *measure(grad, x, ws))]
    for barrier in (int(b) for b in args.barriers.split(",")):
        with scalify.ScalifyConfig(scale_barrier=barrier):
            rows.append((f"scalify, scale_barrier={barrier}", *measure(scalify.scalify(grad), sx, sws)))
    lines = [
        f"# Scale barrier: compile time ({args.layers}-layer MLP, value_and_grad)",
        "",
        f"`python benchmarks/scale_barrier_compile.py --layers {args.layers}` on "
        f"{platform.processor() or platform.machine()} ({jax.default_backend()}), jax {jax.__version__}.",
        "",
        "| step | lower (s) | compile (s) | kernels (fusions + custom calls in ENTRY) |",
        "|---|---|---|---|",
        *[f"| {name} | {low:.2f} | {comp:.2f} | {k} |" for name, low, comp, k in rows],
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale_barrier_compile.md").write_text(text)


if __name__ == "__main__":
    main()
