"""FP8 GEMM patterns on the device: which ones XLA fuses into cuBLASLt FP8 GEMMs, and how fast.

    PYTHONPATH=$PWD python benchmarks/fp8_gemm.py --out OUT

For each size n (4096 and 8192 on a GPU; 128 and 256 on CPU, a smoke test) and each
pattern it prints the median TFLOP/s of `out[n, n] = a[n, n] @ b[n, n]`, the number of
`__cublas$lt$matmul$f8` custom calls in `jax.jit(f).lower(...).compile().as_text()` and
the ratio to `jnp.dot` in bfloat16; then the same for a whole linear layer (forward and the
two backward matmuls), whose scalified FP8 version must compile to exactly 3 FP8 GEMMs.
Everything runs in one process, so the ratios compare like with like. Writes
`fp8_gemm.json`, `fp8_gemm.md` (the tables) and the optimised HLO of every case under
`hlo/` to `--out`.

Patterns (operands `a`, `b` in E4M3 with runtime float32 scales `sa`, `sb`, bf16 output):
- `bf16`: `jnp.dot` of bfloat16 operands (the baseline).
- `raw`, `raw_nt`: `dot_general(a, b, preferred_element_type=bf16)`, scales ignored; `_nt`
  takes `b` as (n_out, k), the layout cuBLASLt FP8 wants, to show any transpose cost.
- `dequant_f32`, `dequant_f32_lhs`, `dequant_bf16`, `alpha_f32`, `alpha_out`, `alpha_tn`:
  the candidate data paths of `benchmarks/fp8_patterns.py` (`alpha_tn` is the library's,
  `scalify.ops.fp8.dot_scaled_tn`, used outside scalify).
- `q_dequant_f32`, `q_alpha_tn`: float32 operands quantised (just-in-time scales) in the
  same jitted function, then `scaled_matmul` with that pattern.
- `const_out`, `const_f32`: the raw dot times a compile-time power of two, in bf16 or
  accumulated in f32 then cast: what scalify's dot rule emits (scales in "scale land").
- `scalify`: `scalify(lax.dot_general)` on ScaledArray FP8 operands, end to end.
Layer (x: bf16 (n, n), w: f32 (n, n) master weights, output gradient bf16):
- `bf16_layer`: `x @ w.astype(bf16)` forward + backward.
- `fp8_static`, `fp8_jit`: `scalify.ops.fp8.fp8_dot_general` outside scalify
  (`dot_scaled_tn`); `fp8_jit_<pattern>`: just-in-time scaling with that pattern.
- `scalify_fp8_static`, `scalify_fp8_jit`: the same under `scalify`, ScaledArray inputs.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import scalify
from fp8_patterns import FP8_DOT_PATTERNS  # benchmarks/ is sys.path[0] when run as a script
from scalify.inspect import count_fp8_gemms
from scalify.ops import fp8

DN = (((1,), (0,)), ((), ()))
DN_NT = (((1,), (1,)), ((), ()))
BF16, F32 = jnp.bfloat16, jnp.float32


# -- cases ----------------------------------------------------------------------------------
def gemm_cases(n: int):
    """name -> (function, args). All return the (n, n) product (bf16 data)."""
    rng = np.random.default_rng(0)
    a32 = jnp.asarray(rng.standard_normal((n, n)), F32)
    b32 = jnp.asarray(rng.standard_normal((n, n)), F32)
    a8, b8 = fp8.cast(a32, fp8.E4M3), fp8.cast(b32, fp8.E4M3)
    b8t = fp8.cast(b32.T, fp8.E4M3)
    sa, sb = jnp.float32(2.0**-3), jnp.float32(2.0**-2)
    r = float(scalify.pow2_round(jnp.float32(np.sqrt(n))))
    cases = {
        "bf16": (lambda a, b: jnp.dot(a, b), (a32.astype(BF16), b32.astype(BF16))),
        "raw": (lambda a, b: lax.dot_general(a, b, DN, preferred_element_type=BF16), (a8, b8)),
        "raw_nt": (lambda a, b: lax.dot_general(a, b, DN_NT, preferred_element_type=BF16), (a8, b8t)),
    }
    for name in ("dequant_f32", "dequant_f32_lhs", "dequant_bf16", "alpha_f32", "alpha_out", "alpha_tn"):
        fn = FP8_DOT_PATTERNS[name]
        cases[name] = (lambda a, b, sa, sb, fn=fn: fn(a, b, sa, sb, DN, BF16), (a8, b8, sa, sb))
    # Operands quantised in the same jitted function (just-in-time scaling, FP8 inference).
    for name in ("dequant_f32", "alpha_tn"):
        def jit_quant(a, b, pattern=name):
            sa_, sb_ = fp8.fp8_scale(fp8.amax(a), fp8.E4M3), fp8.fp8_scale(fp8.amax(b), fp8.E4M3)
            a8_, b8_ = fp8.quantize(a, sa_, fp8.E4M3), fp8.quantize(b, sb_, fp8.E4M3)
            return fp8.scaled_matmul(a8_, b8_, sa_, sb_, DN, BF16, pattern=FP8_DOT_PATTERNS[pattern])

        cases[f"q_{name}"] = (jit_quant, (a32, b32))
    cases["const_out"] = (
        lambda a, b: lax.dot_general(a, b, DN, preferred_element_type=BF16) * jnp.asarray(1 / r, BF16),
        (a8, b8),
    )
    cases["const_f32"] = (
        lambda a, b: (lax.dot_general(a, b, DN, preferred_element_type=F32) * (1 / r)).astype(BF16),
        (a8, b8),
    )
    scaled = scalify.scalify(lambda a, b: lax.dot_general(a, b, DN, preferred_element_type=BF16))
    cases["scalify"] = (scaled, (scalify.scaled_array(a8, sa), scalify.scaled_array(b8, sb)))
    return cases


def layer_cases(n: int):
    """name -> (function, args): forward + backward of a linear layer (3 matmuls)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((n, n)), BF16)
    w = jnp.asarray(rng.standard_normal((n, n)) / np.sqrt(n), F32)
    g = jnp.asarray(rng.standard_normal((n, n)), BF16)

    def bf16_layer(x, w, g):
        y, vjp = jax.vjp(lambda x, w: jnp.dot(x, w.astype(BF16)), x, w)
        return (y, *vjp(g))

    def fp8_layer(policy, pattern=None):
        def step(x, w, g):
            f = lambda x, w: fp8.fp8_dot_general(  # noqa: E731
                x, w, DN, preferred_element_type=BF16, scaling=policy, pattern=pattern
            )
            y, vjp = jax.vjp(f, x, w)
            return (y, *vjp(g))

        return step

    sx, sw, sg = (scalify.as_scaled_array(v) for v in (x, w, g))
    return {
        "bf16_layer": (bf16_layer, (x, w, g)),
        "fp8_static": (fp8_layer("static"), (x, w, g)),
        "fp8_jit": (fp8_layer("jit"), (x, w, g)),
        "fp8_jit_dequant_f32": (fp8_layer("jit", FP8_DOT_PATTERNS["dequant_f32"]), (x, w, g)),
        "fp8_jit_alpha_tn": (fp8_layer("jit", FP8_DOT_PATTERNS["alpha_tn"]), (x, w, g)),
        "scalify_fp8_static": (scalify.scalify(fp8_layer("static")), (sx, sw, sg)),
        "scalify_fp8_jit": (scalify.scalify(fp8_layer("jit")), (sx, sw, sg)),
    }


# -- measurement -----------------------------------------------------------------------------
def _block(out):
    jax.tree_util.tree_map(lambda v: v.block_until_ready(), out)


def measure(fn, args, flops: float, iters: int, batches: int):
    """(compiled HLO text, median TFLOP/s): `batches` timings of `iters` queued calls each."""
    jitted = jax.jit(fn)
    compiled = jitted.lower(*args).compile()
    hlo = compiled.as_text()
    _block(compiled(*args))  # warm-up
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = compiled(*args)
        _block(out)
        times.append((time.perf_counter() - t0) / iters)
    return hlo, flops / statistics.median(times) / 1e12


def run(sizes, iters, batches, out_dir):
    os.makedirs(os.path.join(out_dir, "hlo"), exist_ok=True)
    rows = []
    for kind, make, nmat in (("gemm", gemm_cases, 1), ("layer", layer_cases, 3)):
        for n in sizes:
            cases = make(n)
            flops = nmat * 2.0 * n**3
            base = None
            for name, (fn, args) in cases.items():
                try:
                    hlo, tflops = measure(fn, args, flops, iters, batches)
                    err = None
                except Exception as e:  # report and go on: one bad pattern must not hide the rest
                    hlo, tflops, err = "", float("nan"), f"{type(e).__name__}: {e}"[:500]
                with open(os.path.join(out_dir, "hlo", f"{kind}_{name}_{n}.txt"), "w") as f:
                    f.write(hlo)
                if base is None:
                    base = tflops
                row = dict(
                    kind=kind, case=name, n=n, tflops=tflops,
                    f8_gemms=count_fp8_gemms(hlo), ratio_vs_bf16=tflops / base, error=err,
                )
                rows.append(row)
                print(_fmt_row(row), flush=True)
    return rows


def _fmt_row(r):
    extra = f"  ERROR {r['error']}" if r["error"] else ""
    return (f"| {r['kind']:5s} | {r['case']:18s} | {r['n']:5d} | {r['tflops']:9.4g} | "
            f"{r['f8_gemms']:3d} | {r['ratio_vs_bf16']:5.2f} |{extra}")


HEADER = ("| kind  | case               |     n |   TFLOP/s |  f8 | x bf16 |\n"
          "|-------|--------------------|-------|-----------|-----|-------|")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for fp8_gemm.json, .md and hlo/")
    p.add_argument("--sizes", type=int, nargs="*", default=None,
                   help="matrix sizes (default: 4096 8192 on GPU, 128 256 on CPU)")
    p.add_argument("--iters", type=int, default=None, help="queued calls per timing")
    p.add_argument("--batches", type=int, default=None, help="timings (the median is kept)")
    a = p.parse_args(argv)
    backend = jax.default_backend()
    gpu = backend == "gpu"
    sizes = a.sizes or ([4096, 8192] if gpu else [128, 256])
    iters = a.iters or (20 if gpu else 2)
    batches = a.batches or (10 if gpu else 3)
    device = str(jax.devices()[0].device_kind)
    print(f"# FP8 GEMM benchmark: {device}, backend {backend}, jax {jax.__version__}, "
          f"sizes {sizes}, {batches} x {iters} calls")
    print(HEADER)
    rows = run(sizes, iters, batches, a.out)
    # What must hold: 3 FP8 GEMMs in the scalified FP8 layer (on a GPU), and the goal
    # >= 1.8x bf16 at the largest size for the scalified GEMM.
    big = max(sizes)
    layer = [r for r in rows if r["kind"] == "layer" and r["case"] == "scalify_fp8_static"]
    gemm = [r for r in rows if r["kind"] == "gemm" and r["case"] == "scalify" and r["n"] == big]
    checks = {
        "scalify_fp8_layer_f8_gemms": [r["f8_gemms"] for r in layer],
        "scalify_fp8_layer_has_3_f8_gemms": all(r["f8_gemms"] == 3 for r in layer) if gpu else None,
        f"scalify_gemm_ratio_at_{big}": gemm[0]["ratio_vs_bf16"] if gemm else None,
        "goal_1.8x_met": (gemm[0]["ratio_vs_bf16"] >= 1.8) if (gpu and gemm) else None,
    }
    print(json.dumps(checks))
    meta = dict(device=device, backend=backend, jax=jax.__version__, python=platform.python_version(),
                sizes=sizes, iters=iters, batches=batches, argv=sys.argv,
                default_pattern="alpha_tn")
    with open(os.path.join(a.out, "fp8_gemm.json"), "w") as f:
        json.dump(dict(meta=meta, checks=checks, rows=rows), f, indent=1)
    with open(os.path.join(a.out, "fp8_gemm.md"), "w") as f:
        f.write(f"{device}, jax {jax.__version__}, median of {batches} x {iters} calls\n\n")
        f.write(HEADER + "\n" + "\n".join(_fmt_row(r) for r in rows) + "\n\n")
        f.write("```\n" + json.dumps(checks) + "\n```\n")
    return rows


if __name__ == "__main__":
    main()
