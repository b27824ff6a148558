"""Where XLA puts the transpose of an FP8 weight gradient, and what it costs in the optimizer.

    PYTHONPATH=$PWD python benchmarks/fp8_wgrad_layout.py --out results/h200/fp8_wgrad_layout

A weight gradient dW = x^T g (x: (tokens, in), g: (tokens, out), W: (in, out)) feeds an
Adam update of float32 state (param, m, v) stored row-major as (in, out). cuBLASLt's FP8
GEMM takes both operands contracting-dim minor and writes a row-major output, so a
formulation that yields (out, in) needs a transpose somewhere; XLA may sink it through the
elementwise update onto every state tensor (three float32 reads and writes transposed)
instead of the one gradient. Each case is one jitted step (dot + Adam, state donated),
timed in one process; the script prints the compiled step's kernels that transpose.

Cases (x cast to E4M3, g to E5M2, accumulation in float32):
- `bf16`: the same step with a bfloat16 dot (the baseline);
- `gx_T`: dot(g, x) contracting tokens, then `.T` (JAX's transpose rule for `x @ W`);
- `xg`: dot(x, g) contracting tokens (XLA lays the operands out itself);
- `xg_tn`: dot(x.T, g.T) contracting their minor dims (operands transposed explicitly);
- `xg_tn_barrier`: the same with the transposed operands behind `optimization_barrier`;
- `gx_T_narrow`: dot(g, x) with a bfloat16 output, `.T`, then float32 (a transpose of a
  2-byte gradient instead of the 4-byte state).
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
from jax import lax

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
TOKENS = (((0,), (0,)), ((), ()))
MINOR = (((1,), (1,)), ((), ()))


def _dw(case, x, g):
    if case == "bf16":
        return lax.dot_general(x, g, TOKENS, preferred_element_type=jnp.float32)
    x8, g8 = x.astype(E4M3), g.astype(E5M2)
    f32 = jnp.float32
    if case == "gx_T":
        return lax.dot_general(g8, x8, TOKENS, preferred_element_type=f32).T
    if case == "xg":
        return lax.dot_general(x8, g8, TOKENS, preferred_element_type=f32)
    if case == "xg_tn":
        return lax.dot_general(x8.T, g8.T, MINOR, preferred_element_type=f32)
    if case == "xg_tn_barrier":
        xt, gt = lax.optimization_barrier((x8.T, g8.T))
        return lax.dot_general(xt, gt, MINOR, preferred_element_type=f32)
    if case == "gx_T_narrow":
        return lax.dot_general(g8, x8, TOKENS, preferred_element_type=jnp.bfloat16).T.astype(f32)
    raise ValueError(case)


def step(case, state, x, g):
    p, m, v = state
    dw = _dw(case, x, g)
    m = 0.9 * m + 0.1 * dw
    v = 0.999 * v + 0.001 * dw * dw
    p = p - 1e-3 * m / (jnp.sqrt(v) + 1e-8)
    return p, m, v


CASES = ("bf16", "gx_T", "xg", "xg_tn", "xg_tn_barrier", "gx_T_narrow")


def transposes(hlo: str) -> list[str]:
    """Entry-computation instructions that move data between layouts."""
    entry = hlo[hlo.index("\nENTRY"):]
    out = []
    for line in entry.splitlines():
        m = re.match(r"\s+(?:ROOT )?%(\S+) = (\S+) ", line)
        if m and re.search(r"transpose|copy", m.group(1)):
            out.append(f"{m.group(1)} {m.group(2)}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--d-in", type=int, default=1024)
    ap.add_argument("--d-out", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (a.tokens, a.d_in), jnp.bfloat16)
    g = jax.random.normal(k[1], (a.tokens, a.d_out), jnp.bfloat16)
    rows = []
    for case in CASES:
        fn = jax.jit(lambda s, x, g, case=case: step(case, s, x, g), donate_argnums=0)
        state = tuple(jnp.zeros((a.d_in, a.d_out), jnp.float32) + i for i in range(3))
        compiled = fn.lower(state, x, g).compile()
        moves = transposes(compiled.as_text())
        for _ in range(3):
            state = compiled(state, x, g)
        jax.block_until_ready(state)
        times = []
        for _ in range(a.iters):
            t0 = time.perf_counter()
            state = compiled(state, x, g)
            jax.block_until_ready(state)
            times.append(time.perf_counter() - t0)
        us = 1e6 * statistics.median(times)
        rows.append({"case": case, "us": round(us, 1), "moves": moves})
        print(f"{case:15s} {us:9.1f} us  layout moves: {len(moves)}  {moves}", flush=True)
    base = rows[0]["us"]
    lines = [f"# FP8 weight gradient + Adam update: where the transpose goes",
             "", f"{jax.devices()[0].device_kind}, jax {jax.__version__}, tokens {a.tokens}, "
             f"W ({a.d_in}, {a.d_out}), median of {a.iters} synchronous steps.", "",
             "| case | step (us) | vs bf16 | transposes/copies in the compiled step |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['us']:.1f} | {base / r['us']:.2f}x | "
                     f"{len(r['moves'])}: {', '.join(r['moves']) or '-'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "fp8_wgrad_layout.md"), "w") as f:
            f.write(text)
        with open(os.path.join(a.out, "fp8_wgrad_layout.json"), "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
