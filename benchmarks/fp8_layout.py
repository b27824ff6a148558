"""Where the FP8 GEMM loses its speed: operand layout, the transpose XLA inserts, and fixes.

    PYTHONPATH=$PWD python benchmarks/fp8_layout.py --out OUT

cuBLASLt's FP8 GEMM on Hopper takes only the "TN" layout: both operands with their
contracting dimension minor (A as (M, K), B as (N, K) row-major). For `a @ b` with `b` as
(K, N) XLA's GEMM rewriter inserts a transpose of `b` as a separate kernel. This script
times, at each size and in one process:

- `bf16`: `jnp.dot` in bfloat16 (the baseline);
- `f8_nn`: raw FP8 dot, b as (K, N) (XLA transposes b);
- `f8_nt`: raw FP8 dot, b already stored as (N, K);
- `f8_transpose`: the transpose of an FP8 (K, N) matrix alone (copy to (N, K));
- `q_nn`, `q_nt`: the forward of a layer: b in float32, quantised to E4M3 inside the
  jitted function, as (K, N) then NN dot, or transposed while quantising then NT dot;
- `f8_nt_scalify`: `scalify(dot)` on ScaledArray FP8 operands with b stored as (N, K);
- `bf16_layer`: the two backward matmuls of a bf16 linear layer (x @ w.astype(bf16));
- for each `scalify.ScalifyConfig(fp8_operand_layout=...)` mode (`none`: XLA's own transpose;
  `transpose`: explicit transpose to contracting-minor; `barrier`: the same behind an
  optimization_barrier): `f8_nn_scalify_*` (`scalify(dot)` with b as (K, N)),
  `q_nn_scalify_*` (b quantised inside the scalified function) and `layer_scalify_*`
  (forward + backward of `fp8_dot_general` under scalify: 3 FP8 GEMMs; its flops count
  the 3 matmuls, compare it with 1.5x `bf16_layer`'s time, which counts 2).

Writes `fp8_layout.md` and `fp8_layout.json` to --out, and prints the kernels (fusions
and custom calls) of each compiled case so the inserted transposes are visible.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import scalify
from scalify.inspect import count_fp8_gemms
from scalify.ops import fp8

BF16, F32 = jnp.bfloat16, jnp.float32
NN = (((1,), (0,)), ((), ()))
NT = (((1,), (1,)), ((), ()))


def with_layout(fn, mode):
    """`fn` traced with `ScalifyConfig(fp8_operand_layout=mode)` (read at trace time)."""
    def traced(*args):
        with scalify.ScalifyConfig(fp8_operand_layout=mode):
            return fn(*args)
    return traced


def cases(n: int):
    rng = np.random.default_rng(0)
    a32 = jnp.asarray(rng.standard_normal((n, n)), F32)
    b32 = jnp.asarray(rng.standard_normal((n, n)), F32)
    g16 = jnp.asarray(rng.standard_normal((n, n)), BF16)
    a8, b8, b8t = (fp8.cast(v, fp8.E4M3) for v in (a32, b32, b32.T))
    sa, sb = scalify.scaled_array(a8, 2.0**-3), scalify.scaled_array(b8, 2.0**-2)
    sbt = scalify.scaled_array(b8t, 2.0**-2)
    sx, sw, sg = (scalify.as_scaled_array(v) for v in (a32.astype(BF16), b32 / np.sqrt(n), g16))
    dot = lambda dn: lambda a, b: lax.dot_general(a, b, dn, preferred_element_type=BF16)  # noqa: E731
    flops = 2.0 * n**3

    def q(x):
        return fp8.cast(x, fp8.E4M3)

    def layer(x, w, g):  # forward + the two backward matmuls of a linear layer, FP8 static
        f = lambda x, w: fp8.fp8_dot_general(x, w, NN, preferred_element_type=BF16)  # noqa: E731
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(g))

    out = {
        "bf16": (lambda a, b: jnp.dot(a, b), (a32.astype(BF16), b32.astype(BF16)), flops),
        "f8_nn": (dot(NN), (a8, b8), flops),
        "f8_nt": (dot(NT), (a8, b8t), flops),
        "f8_transpose": (lambda b: b.T, (b8,), flops),
        "q_nn": (lambda a, b: dot(NN)(a, q(b)), (a8, b32), flops),
        "q_nt": (lambda a, b: dot(NT)(a, q(b.T)), (a8, b32), flops),
        "f8_nt_scalify": (scalify.scalify(dot(NT)), (sa, sbt), flops),
        "bf16_layer": (lambda x, w, g: jax.vjp(lambda x, w: x @ w.astype(BF16), x, w)[1](g),
                       (a32.astype(BF16), b32, g16), 2 * flops),
    }
    for mode in ("none", "transpose", "barrier"):
        out[f"f8_nn_scalify_{mode}"] = (with_layout(scalify.scalify(dot(NN)), mode), (sa, sb), flops)
        out[f"q_nn_scalify_{mode}"] = (
            with_layout(scalify.scalify(lambda a, b: dot(NN)(a, q(b))), mode), (sa, scalify.as_scaled_array(b32)), flops)
        out[f"layer_scalify_{mode}"] = (with_layout(scalify.scalify(layer), mode), (sx, sw, sg), 3 * flops)
    return out


def kernels(hlo: str) -> list[str]:
    """The kernels of the entry computation: fusions and custom calls, by name/target."""
    entry = hlo[hlo.find("ENTRY"):]
    out = []
    for line in entry.splitlines():
        m = re.search(r"=\s*\S+\s+(fusion|custom-call|copy|transpose)\(", line)
        if m:
            t = re.search(r'custom_call_target="([^"]+)"', line)
            k = re.search(r"kind=(\w+)", line)
            out.append(m.group(1) + (f"[{t.group(1)}]" if t else "") + (f"[{k.group(1)}]" if k else ""))
    return out


def measure(fn, args, iters, batches):
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = compiled(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return compiled.as_text(), statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", type=int, nargs="*", default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--batches", type=int, default=None)
    a = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    sizes = a.sizes or ([4096, 8192] if gpu else [128])
    iters, batches = a.iters or (20 if gpu else 2), a.batches or (5 if gpu else 2)
    os.makedirs(a.out, exist_ok=True)
    device = jax.devices()[0].device_kind
    head = f"# FP8 layout: {device}, jax {jax.__version__}, median of {batches} x {iters} calls"
    lines = [head, "", "| case | n | ms | TFLOP/s (2n^3/t) | x bf16 | f8 GEMMs | kernels |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    rows = []
    for n in sizes:
        base = None
        for name, (fn, args, flops) in cases(n).items():
            hlo, t = measure(fn, args, iters, batches)
            base = base or t
            ks = kernels(hlo)
            row = dict(case=name, n=n, ms=t * 1e3, tflops=flops / t / 1e12, ratio=base / t,
                       f8_gemms=count_fp8_gemms(hlo), kernels=ks)
            rows.append(row)
            line = (f"| {name} | {n} | {t * 1e3:.3f} | {row['tflops']:.0f} | {row['ratio']:.2f} | "
                    f"{row['f8_gemms']} | {' '.join(ks)} |")
            lines.append(line)
            print(line, flush=True)
    with open(os.path.join(a.out, "fp8_layout.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(a.out, "fp8_layout.json"), "w") as f:
        json.dump(dict(device=device, jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
