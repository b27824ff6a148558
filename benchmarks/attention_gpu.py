"""Fused attention under scalify: correctness against plain JAX, and the cost of the scales.

    PYTHONPATH=$PWD python benchmarks/attention_gpu.py --out results/attention       # GPU: cuDNN
    PYTHONPATH=$PWD python benchmarks/attention_gpu.py --implementation xla        # CPU smoke run

`jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=IMPL)` is run plain
(q, k, v arrays) and under `scalify.scalify` (q, k, v ScaledArrays with power-of-two scales:
the rule of `scalify/rules/attention.py` calls the same kernels on the data, the q and k
scales folded into q and k as halves of one power of two, the output at v's scale).

1. Check, per dtype and per set of scales (sq, sk, sv): the output and the gradients
   wrt q, k, v of `sum(attention * w)` (through `scalify(jax.grad(...))`) against plain JAX on
   `q*sq`, `k*sk`, `v*sv` (largest difference over the largest value; the power-of-two
   factors leave the kernels' logits unchanged, so this is the kernels' own rounding, or 0).
2. Time, per shape and dtype: forward, and forward + backward (`jax.value_and_grad`), plain
   and scalified, median of `--iters` jitted calls after compilation and `--warmup` calls;
   the number of cuDNN attention custom calls in each compiled program (2 for fwd+bwd with
   cuDNN: scalify adds no attention kernel of its own).

Shapes: the NanoGPT `paper` model's attention (batch 16, seq 512, 16 heads, head dim 64)
and a long sequence (batch 4, seq 2048) on a GPU; batch 2, seq 128, 4 heads on CPU. Writes
`attention.json` and `attention.md` to `--out` when given. The GPU run takes under two
minutes (about 20 small compilations).

`--implementation xla` on CPU uses bfloat16 and float32 only: XLA:CPU has no float16 dot
algorithm `F16_F16_F32`, which `jax.nn.dot_product_attention` asks for float16 (plain JAX
fails the same way under jit).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import scalify

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
SCALE_SETS = [(1.0, 1.0, 1.0), (2.0**-6, 2.0**5, 2.0**8), (2.0**4, 2.0**-3, 2.0**-10)]
GPU_SHAPES = [(16, 512, 16, 64), (4, 2048, 16, 64)]  # (batch, seq, heads, head dim)
CPU_SHAPES = [(2, 128, 4, 64)]


def attention_fn(implementation: str):
    def attention(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

    return attention


def _inputs(shape, dtype, scales, seed=0):
    """Unit-variance data: plain arrays `x * s` (dtype) and ScaledArrays (x, s); a loss weight."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    w = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    plain = [jnp.asarray(x * s, dtype) for x, s in zip(xs, scales)]
    scaled = [scalify.scaled_array(jnp.asarray(x, dtype), s) for x, s in zip(xs, scales)]
    return plain, scaled, w


def _value(x) -> np.ndarray:
    if isinstance(x, scalify.ScaledArray):
        return np.asarray(x.data, np.float32) * np.asarray(x.scale, np.float32)
    return np.asarray(x, np.float32)


def _rel(a, b) -> float:
    a, b = _value(a), _value(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def check(implementation: str, dtype_name: str, shape) -> list[dict]:
    """Scalified vs plain output and gradients for each set of scales (one compilation each
    of the plain and scalified programs: the scales are traced)."""
    attn = attention_fn(implementation)

    def make(w):
        def loss(q, k, v):
            return jnp.sum(attn(q, k, v).astype(jnp.float32) * w)

        grad = jax.grad(loss, argnums=(0, 1, 2))
        plain = jax.jit(lambda *a: (attn(*a), grad(*a)))
        scaled = jax.jit(lambda *a: (scalify.scalify(attn)(*a), scalify.scalify(grad)(*a)))
        return plain, scaled

    rows, fns = [], None
    for scales in SCALE_SETS:
        plain_in, scaled_in, w = _inputs(shape, DTYPES[dtype_name], scales)
        fns = fns or make(w)
        (out_p, g_p), (out_s, g_s) = fns[0](*plain_in), fns[1](*scaled_in)
        errs = [_rel(out_s, out_p)] + [_rel(s, p) for s, p in zip(g_s, g_p)]
        finite = all(np.all(np.isfinite(_value(x))) for x in (out_s, *g_s))
        rows.append({"dtype": dtype_name, "scales": [float(np.log2(s)) for s in scales],
                     "out_scale": float(np.asarray(out_s.scale)), "err_out": errs[0],
                     "err_dq": errs[1], "err_dk": errs[2], "err_dv": errs[3], "finite": finite})
    return rows


def _attention_kernels(compiled_text: str) -> int:
    """cuDNN fused attention custom calls in an optimised HLO module."""
    return sum(1 for line in compiled_text.splitlines() if "custom-call" in line and "fmha" in line)


def _median_ms(fn, args, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_case(implementation: str, dtype_name: str, shape, iters: int, warmup: int) -> dict:
    """Forward and forward+backward, plain and scalified: ms and attention kernels."""
    attn = attention_fn(implementation)
    plain_in, scaled_in, _ = _inputs(shape, DTYPES[dtype_name], SCALE_SETS[1])

    def loss(q, k, v):
        return jnp.sum(attn(q, k, v).astype(jnp.float32))

    vg = jax.value_and_grad(loss, argnums=(0, 1, 2))
    cases = {
        "fwd plain": (attn, plain_in),
        "fwd scalify": (scalify.scalify(attn), scaled_in),
        "fwd+bwd plain": (vg, plain_in),
        "fwd+bwd scalify": (scalify.scalify(vg), scaled_in),
    }
    out = {"dtype": dtype_name, "shape": list(shape)}
    for name, (fn, args) in cases.items():
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        out[f"{name} compile_s"] = time.perf_counter() - t0
        out[f"{name} kernels"] = _attention_kernels(compiled.as_text())
        out[f"{name} ms"] = _median_ms(compiled, args, iters, warmup)
    b, t, n, h = shape
    flops_fwd = 4 * b * n * t * t * h / 2  # two matmuls, half of the T x T under the mask
    out["fwd plain TFLOP/s"] = flops_fwd / out["fwd plain ms"] / 1e9
    return out


def markdown(meta: dict, checks: list[dict], timings: list[dict]) -> str:
    lines = [f"# Attention under scalify: `implementation={meta['implementation']}`", "",
             f"{meta['device']}, jax {meta['jax']}.", "",
             "## Scalified vs plain (max |difference| / max |plain|)", "",
             "| dtype | log2 (sq, sk, sv) | output scale | out | dq | dk | dv | finite |",
             "|---|---|---|---|---|---|---|---|"]
    for r in checks:
        sc = ", ".join(f"{s:+.0f}" for s in r["scales"])
        lines.append(f"| {r['dtype']} | ({sc}) | {r['out_scale']:g} | {r['err_out']:.1e} | "
                     f"{r['err_dq']:.1e} | {r['err_dk']:.1e} | {r['err_dv']:.1e} | {r['finite']} |")
    lines += ["", f"## Time (median of {meta['iters']} calls, ms; attention kernels in the "
              "compiled program)", "",
              "| dtype | B x T x N x H | fwd plain | fwd scalify | ratio | fwd+bwd plain | "
              "fwd+bwd scalify | ratio | kernels plain / scalify | plain fwd TFLOP/s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in timings:
        shape = " x ".join(str(d) for d in r["shape"])
        lines.append(
            f"| {r['dtype']} | {shape} | {r['fwd plain ms']:.3f} | {r['fwd scalify ms']:.3f} | "
            f"{r['fwd scalify ms'] / r['fwd plain ms']:.2f}x | {r['fwd+bwd plain ms']:.3f} | "
            f"{r['fwd+bwd scalify ms']:.3f} | {r['fwd+bwd scalify ms'] / r['fwd+bwd plain ms']:.2f}x | "
            f"{r['fwd+bwd plain kernels']} / {r['fwd+bwd scalify kernels']} | "
            f"{r['fwd plain TFLOP/s']:.1f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--implementation", choices=["cudnn", "xla"], default="cudnn" if on_gpu else "xla")
    p.add_argument("--dtypes", default="bfloat16,float16" if on_gpu else "bfloat16,float32",
                   help="comma-separated: bfloat16, float16, float32")
    p.add_argument("--iters", type=int, default=20 if on_gpu else 3)
    p.add_argument("--warmup", type=int, default=3 if on_gpu else 1)
    p.add_argument("--out", default=None, help="folder for attention.json and attention.md")
    a = p.parse_args(argv)
    a.shapes = GPU_SHAPES if on_gpu else CPU_SHAPES
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if a.implementation == "cudnn" and jax.default_backend() != "gpu":
        raise SystemExit("implementation=cudnn needs a GPU; use --implementation xla on CPU.")
    meta = {"implementation": a.implementation, "device": str(jax.devices()[0].device_kind),
            "jax": jax.__version__, "iters": a.iters, "warmup": a.warmup}
    t0 = time.perf_counter()
    checks = [r for d in dtypes for r in check(a.implementation, d, a.shapes[0])]
    timings = [time_case(a.implementation, d, s, a.iters, a.warmup) for s in a.shapes for d in dtypes]
    meta["wall_s"] = time.perf_counter() - t0
    md = markdown(meta, checks, timings) + f"\nWall time {meta['wall_s']:.0f} s.\n"
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "attention.json"), "w") as f:
            json.dump({"meta": meta, "checks": checks, "timings": timings}, f, indent=1)
        with open(os.path.join(a.out, "attention.md"), "w") as f:
            f.write(md)
    return {"meta": meta, "checks": checks, "timings": timings}


if __name__ == "__main__":
    main()
