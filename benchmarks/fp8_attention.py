"""cuDNN FP8 fused attention against bfloat16 cuDNN flash attention, forward + backward.

    PYTHONPATH=$PWD python -m benchmarks.fp8_attention [--out OUT]

JAX exposes cuDNN's FP8 attention only through its internal
`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(..., use_fp8=True)`
(E4M3 query, key and value, with descale/scale factors and amax outputs); cuDNN trains it
only at head dim 128 with sequence lengths multiples of 128. This script times, at the
Llama presets' attention shapes (causal, BTNH layout, batch and sequence of
`benchmarks/stock_gpt.py`):

- ``bf16``: `jax.nn.dot_product_attention(implementation="cudnn")` of bfloat16 q, k, v
  (grouped-query: k and v with the preset's kv heads), forward and the gradient of
  ``sum(out * dout)`` with respect to q, k and v;
- ``fp8``: the FP8 kernel on E4M3 q, k, v (k and v repeated to the query heads, which the
  FP8 kernel requires, the repeat included in the time), unit scale factors, the same
  forward and gradient; the casts to E4M3 are included.

Each: 3 warm-up calls, then the median of 3 windows of 20 calls. A shape the FP8 kernel
refuses is reported with cuDNN's message. Writes ``OUT/fp8_attention.json`` and prints a
table: ms per forward + backward, and bf16 / fp8.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

# (name, batch, seq, query heads, kv heads, head dim): the attention of the Llama presets.
SHAPES = (
    ("1b", 4, 2048, 32, 8, 64),
    ("8b-shape", 2, 2048, 32, 8, 128),
)


def _bf16_step(q, k, v, do):
    def f(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))

    return jax.grad(f, argnums=(0, 1, 2))(q, k, v)


def _fp8_step(q, k, v, do):
    from jax._src.cudnn import fused_attention_stablehlo as fa

    e4m3 = jnp.float8_e4m3fn
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    one = jnp.ones((1, 1, 1, 1), jnp.float32)
    params = {name: one for name in fa.fp8_params_keys}

    def f(q, k, v):
        out, _, _ = fa.dot_product_attention(
            q.astype(e4m3), k.astype(e4m3), v.astype(e4m3), fp8_params=params, use_fp8=True,
            scale=q.shape[-1] ** -0.5, mask_type=fa.MaskType.CAUSAL, qkv_layout="BTNH")
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))

    return jax.grad(f, argnums=(0, 1, 2))(q, k, v)


def _time(fn, args, warmup=3, calls=20, repeats=3) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    windows = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        windows.append(1e3 * (time.perf_counter() - t0) / calls)
    return statistics.median(windows)


def bench(shape) -> dict:
    name, b, t, nq, nkv, h = shape
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, nq, h), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, nkv, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, nkv, h), jnp.bfloat16)
    do = jax.random.normal(keys[3], (b, t, nq, h), jnp.bfloat16)
    rec = {"shape": name, "batch": b, "seq": t, "heads": nq, "kv_heads": nkv, "head_dim": h}
    for label, step in (("bf16", _bf16_step), ("fp8", _fp8_step)):
        try:
            rec[f"{label}_ms"] = _time(jax.jit(step), (q, k, v, do))
        except Exception as e:  # noqa: BLE001 - a refused shape is a result
            rec[f"{label}_ms"] = None
            rec[f"{label}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    if rec["bf16_ms"] and rec["fp8_ms"]:
        rec["bf16_over_fp8"] = rec["bf16_ms"] / rec["fp8_ms"]
    return rec


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    records = [bench(s) for s in SHAPES]
    lines = ["| shape | batch x seq, heads/kv, head dim | bf16 ms | fp8 ms | bf16 / fp8 |", "|---|---|---:|---:|---:|"]
    for r in records:
        fp8 = f"{r['fp8_ms']:.3f}" if r["fp8_ms"] else f"refused: {r.get('fp8_error', '')}"
        ratio = f"{r['bf16_over_fp8']:.2f}" if "bf16_over_fp8" in r else "-"
        bf16 = f"{r['bf16_ms']:.3f}" if r["bf16_ms"] else r.get("bf16_error", "")
        lines.append(f"| {r['shape']} | {r['batch']} x {r['seq']}, {r['heads']}/{r['kv_heads']}, {r['head_dim']} | "
                     f"{bf16} | {fp8} | {ratio} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        meta = {"device_kind": jax.devices()[0].device_kind, "jax": jax.__version__}
        Path(a.out, "fp8_attention.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
        Path(a.out, "fp8_attention.md").write_text(table)
    return records


if __name__ == "__main__":
    main()
