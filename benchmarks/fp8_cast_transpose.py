"""An FP8 cast with its transposed copy: XLA's fused kernel against `scalify.ops.cast_transpose`.

    PYTHONPATH=$PWD python benchmarks/fp8_cast_transpose.py [--out OUT]

An FP8 matmul needs its weight in both layouts (cuBLASLt's FP8 GEMM takes operands
contracting-dim minor: (N, K) for the forward GEMM, (K, N) for the input gradient's). For
weight-shaped 16-bit arrays, in one process, the time per array of:

- `cast`: the saturating cast to E4M3 alone (one layout; the floor of any variant);
- `xla`: the cast and the transposed copy as XLA fuses them (the copy behind an
  optimization_barrier, as scalify's `fp8_operand_layout="barrier"` emits it);
- `cast_transpose`: `scalify.ops.cast_transpose` (a Pallas kernel on a CUDA GPU);

with the bandwidth each reaches over the bytes it must move (read 16-bit, write both FP8
copies; `cast`: one copy). Six arrays per jitted call, the best of 3 windows of 30 calls.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

from scalify.ops.cast_transpose import cast_transpose
from scalify.quant.formats import saturating_cast

E4 = jnp.float8_e4m3fn
SHAPES = ((4096, 16384), (16384, 4096), (4096, 4096), (2048, 8192), (1024, 4096))
PER_CALL = 6


def variants():
    return {
        "cast": (lambda x: (saturating_cast(x, E4),), 1),
        "xla": (lambda x: (lambda q: (q, lax.optimization_barrier(q.T)))(saturating_cast(x, E4)), 2),
        "cast_transpose": (lambda x: cast_transpose(x, E4), 2),
    }


def time_us(fn, xs, calls: int = 30, windows: int = 3) -> float:
    f = jax.jit(lambda xs: [fn(x) for x in xs])
    jax.block_until_ready(f(xs))
    best = float("inf")
    for _ in range(windows):
        t = time.perf_counter()
        for _ in range(calls):
            out = f(xs)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / calls / len(xs) * 1e6)
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--shapes", default=",".join(f"{m}x{n}" for m, n in SHAPES), help="MxN,... (2-D arrays)")
    p.add_argument("--calls", type=int, default=30, help="calls per timed window")
    p.add_argument("--out", default=None, help="folder for fp8_cast_transpose.{json,md}")
    a = p.parse_args(argv)
    dtype = jnp.dtype(a.dtype)
    dev = jax.devices()[0]
    rows = []
    for shape in [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]:
        xs = [jax.random.normal(jax.random.key(i), shape, dtype) for i in range(PER_CALL)]
        n = shape[0] * shape[1]
        row = {"shape": list(shape)}
        for name, (fn, copies) in variants().items():
            us = time_us(fn, xs, calls=a.calls)
            row[name] = {"us": us, "GB/s": n * (dtype.itemsize + copies) / us / 1e3}
        rows.append(row)
        print(json.dumps(row), flush=True)
    lines = [f"### FP8 cast with its transposed copy, {dtype.name} -> E4M3, {dev.device_kind}, jax {jax.__version__}",
             "", "| shape | cast us (GB/s) | xla us (GB/s) | cast_transpose us (GB/s) | xla / cast_transpose |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        cells = [f"{r[k]['us']:.1f} ({r[k]['GB/s']:.0f})" for k in ("cast", "xla", "cast_transpose")]
        lines.append(f"| {r['shape'][0]} x {r['shape'][1]} | " + " | ".join(cells)
                     + f" | {r['xla']['us'] / r['cast_transpose']['us']:.2f}x |")
    table = "\n".join(lines) + "\n"
    print(table)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "fp8_cast_transpose.json").write_text(json.dumps({"device": dev.device_kind, "rows": rows}, indent=1))
        Path(a.out, "fp8_cast_transpose.md").write_text(table)
    return rows


if __name__ == "__main__":
    main()
