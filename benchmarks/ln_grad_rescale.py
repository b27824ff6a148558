"""Cost of the LayerNorm backward and its input-gradient rescale, alone, on one device.

    PYTHONPATH=$PWD python benchmarks/ln_grad_rescale.py --out DIR            # GPU
    PYTHONPATH=$PWD python benchmarks/ln_grad_rescale.py --rows 256 --iters 5 # CPU smoke run

Forward + backward of `sum(layer_norm(x) * w)` with respect to x and the LayerNorm scale and
bias, `--rows` x `--features` (default: the 16 x 512 tokens of a NanoGPT `paper` batch, 768
features), jitted:

- `plain bf16`: `flax.linen.LayerNorm(dtype=bfloat16)` on bfloat16 x (what the bf16
  baseline runs);
- `scalify f16 rescale=R`: `scalify.nn.layer_norm` on a float16 ScaledArray x under
  `scalify.scalify(jax.grad(...))`, its input gradient dynamically rescaled to unit max-abs
  (`max`), unit RMS (`l2`, as the FP16/FP8 recipes do) or not at all (`none`); the
  LayerNorm's own rescale takes the norm from per-row statistics;
- `scalify f16 rescale=l2-generic`: no LayerNorm rescale, and the generic
  `scalify.ops.dynamic_rescale_l2_grad` on x instead (a norm over the stored float16
  gradient, as any dynamic rescale point does).

Reported per call: time (median over `--reps` of `--iters` back-to-back calls, then one
block: the calls are pipelined as in training), device busy time and kernels per call from a
profile (`experiments.nanogpt.kernel_profile.profile_kernels`), and the largest relative
difference of x's gradient from `plain float32`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import scalify


def _inputs(rows, features, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features)).astype(np.float32) * 3.0 + 0.5
    w = rng.standard_normal((rows, features)).astype(np.float32)
    gamma = 1.0 + 0.1 * rng.standard_normal(features).astype(np.float32)
    beta = 0.1 * rng.standard_normal(features).astype(np.float32)
    return x, w, gamma, beta


def plain_case(x, w, gamma, beta, dtype):
    ln = nn.LayerNorm(dtype=dtype, param_dtype=jnp.float32)
    params = {"params": {"scale": jnp.asarray(gamma), "bias": jnp.asarray(beta)}}

    def loss(xx, p):
        y = ln.apply(p, xx)
        return jnp.sum(y.astype(jnp.float32) * w)

    fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return fn, (jnp.asarray(x, dtype), params), lambda out: np.asarray(out[0], np.float32)


def scalify_case(x, w, gamma, beta, rescale):
    generic = rescale == "l2-generic"
    grad_rescale = None if rescale in ("none", "l2-generic") else rescale

    def loss(xx, g, b, ww):
        if generic:  # the generic op on the float16 gradient LayerNorm returns
            xx = scalify.ops.dynamic_rescale_l2_grad(xx)
        y = scalify.nn.layer_norm(xx, g, b, grad_rescale=grad_rescale, dtype=jnp.float16)
        return jnp.sum(y.astype(jnp.float32) * ww.astype(jnp.float32))

    fn = jax.jit(scalify.scalify(jax.grad(loss, argnums=(0, 1, 2))))
    xs = scalify.as_scaled_array(jnp.asarray(x, jnp.float16))
    ws = scalify.as_scaled_array(jnp.asarray(w, jnp.float16))
    args = (xs, scalify.as_scaled_array(jnp.asarray(gamma)), scalify.as_scaled_array(jnp.asarray(beta)), ws)
    return fn, args, lambda out: np.asarray(scalify.asarray(out[0]), np.float32)


def _time(compiled, args, iters, reps):
    jax.block_until_ready(compiled(*args))
    per_call = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = compiled(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(per_call)


def run(rows, features, iters, reps, profile_calls, hlo_dir=None):
    from experiments.nanogpt.kernel_profile import profile_kernels

    x, w, gamma, beta = _inputs(rows, features)
    ref = np.asarray(plain_case(x, w, gamma, beta, jnp.float32)[0](jnp.asarray(x), {"params": {
        "scale": jnp.asarray(gamma), "bias": jnp.asarray(beta)}})[0])
    cases = [("plain bf16", lambda: plain_case(x, w, gamma, beta, jnp.bfloat16))]
    for r in ("none", "max", "l2", "l2-generic"):
        cases.append((f"scalify f16 rescale={r}", lambda r=r: scalify_case(x, w, gamma, beta, r)))
    rows_out = []
    for name, make in cases:
        fn, args, value = make()
        t0 = time.perf_counter()
        compiled = fn.lower(*args).compile()
        compile_s = time.perf_counter() - t0
        hlo = compiled.as_text()
        us = _time(compiled, args, iters, reps)
        got = value(compiled(*args))
        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        row = {"case": name, "us_per_call": us, "compile_s": compile_s, "max_rel_err_dx": err}
        if profile_calls:
            prof = profile_kernels(lambda: jax.block_until_ready(compiled(*args)), profile_calls, hlo)
            row["kernels_per_call"] = prof.get("kernels_per_step")
            row["busy_us_per_call"] = prof.get("busy_us")
            row["top_ops"] = prof.get("top_ops", [])[:25]
        if hlo_dir:
            os.makedirs(hlo_dir, exist_ok=True)
            with open(os.path.join(hlo_dir, name.replace(" ", "_").replace("=", "_") + ".hlo.txt"), "w") as f:
                f.write(hlo)
        rows_out.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "top_ops"}), flush=True)
    return rows_out


def markdown(meta, rows) -> str:
    lines = [f"# LayerNorm forward + backward, {meta['rows']} x {meta['features']}, {meta['device']}", "",
             f"`{meta['command']}` ({meta['date']}, jax {meta['jax']})", "",
             "| case | us/call | device busy us/call | kernels/call | compile s | max rel. error of dx vs float32 |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        busy = r.get("busy_us_per_call")
        lines.append(f"| {r['case']} | {r['us_per_call']:.1f} | "
                     f"{'-' if busy is None else f'{busy:.1f}'} | {r.get('kernels_per_call', '-')} | "
                     f"{r['compile_s']:.2f} | {r['max_rel_err_dx']:.2e} |")
    for r in rows:
        if r.get("top_ops"):
            lines += ["", f"## {r['case']}: kernels by HLO op (us per call)", "", "| op | kind | us | kernels |",
                      "|---|---|---|---|"]
            lines += [f"| `{o['op']}` | {o['kind']} | {o['us']:.1f} | {o['calls']:g} |" for o in r["top_ops"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16 * 512)
    p.add_argument("--features", type=int, default=768)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--profile", type=int, default=5, help="profiled calls per case (0: none)")
    p.add_argument("--out", default=None)
    p.add_argument("--hlo-dir", default=None, help="write each case's optimized HLO here")
    a = p.parse_args(argv)
    rows = run(a.rows, a.features, a.iters, a.reps, a.profile, a.hlo_dir)
    meta = {"rows": a.rows, "features": a.features, "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
            "command": "python benchmarks/ln_grad_rescale.py " + " ".join(argv if argv is not None else
                                                                          __import__("sys").argv[1:])}
    md = markdown(meta, rows)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "ln_grad_rescale.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(os.path.join(a.out, "ln_grad_rescale.md"), "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
