"""Float16 outputs of scalified dots: "bound" against "measure" placement, on the device.

    PYTHONPATH=$PWD python benchmarks/narrow_dot_placement.py --out DIR

`ScalifyConfig.narrow_dot_placement` decides the output scale of a dot whose float16 output
could overflow (FP8 x FP8 -> float16, float16 x float16 -> float16): "bound" from the L2 norms
of the operands over the contracting dims (one reduction over each operand,
then a multiply-and-cast pass of the GEMM's accumulator), "measure" from the max |output|
(a max-reduction over the accumulator before that pass), "auto" the first where the output
has more elements than the operands. For the GEMM shapes of the `paper`
NanoGPT model (16 x 512 tokens, d_model 1024, MLP 4096) it times one scalified dot per
shape and placement, next to the plain bfloat16 dot of the same shape in the same process,
and counts the kernels of the compiled program (non-trivial instructions of the entry
computation) and its FP8 GEMMs. Writes `narrow_dot_placement.md` and `.json`, and the
compiled HLO of every case under `hlo/`, to `--out`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scalify  # noqa: E402
from fp8_gemm import measure  # noqa: E402
from scalify.inspect import count_fp8_gemms  # noqa: E402

E4M3, E5M2, F16, BF16 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float16, jnp.bfloat16
DN = (((1,), (0,)), ((), ()))
_TRIVIAL = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}

# (name, (M, K), (K, N), FP8 operand dtypes): the three GEMMs of the MLP's first layer
SHAPES = (
    ("fwd x@W", (8192, 1024), (1024, 4096), (E4M3, E4M3)),
    ("bwd dX=g@W^T", (8192, 4096), (4096, 1024), (E5M2, E4M3)),
    ("bwd dW=x^T@g", (1024, 8192), (8192, 4096), (E4M3, E5M2)),
)


def entry_kernels(hlo: str) -> int:
    """Non-trivial instructions of the ENTRY computation of an optimised HLO module."""
    body = hlo[hlo.index("\nENTRY"):]
    body = body[: body.index("\n}")]
    ops = re.findall(r"=\s*\S+\s+([a-z][a-z0-9-]*)\(", body)
    return sum(op not in _TRIVIAL for op in ops)


def cases(a_shape, b_shape, dtypes, key):
    ka, kb = jax.random.split(key)
    a = jax.random.normal(ka, a_shape, jnp.float32)
    b = jax.random.normal(kb, b_shape, jnp.float32)
    dot16 = lambda x, y: lax.dot_general(x, y, DN, preferred_element_type=F16)  # noqa: E731
    out = {"bf16 (plain)": (lambda x, y: lax.dot_general(x, y, DN), (a.astype(BF16), b.astype(BF16)))}
    for label, (da, db) in (("fp8", dtypes), ("fp16", (F16, F16))):
        args = (scalify.scaled_array(a.astype(da), 1.0), scalify.scaled_array(b.astype(db), 1.0))
        for placement in ("bound", "measure", "auto"):
            def fn(x, y, placement=placement):
                with scalify.ScalifyConfig(narrow_dot_placement=placement):
                    return scalify.scalify(dot16)(x, y)
            out[f"scalify {label} {placement}"] = (fn, args)
    return out


def run(iters: int, batches: int, out_dir: str):
    rows = []
    for i, (shape_name, a_shape, b_shape, dtypes) in enumerate(SHAPES):
        flops = 2.0 * a_shape[0] * a_shape[1] * b_shape[1]
        base = None
        for case, (fn, args) in cases(a_shape, b_shape, dtypes, jax.random.PRNGKey(i)).items():
            hlo, tflops = measure(fn, args, flops, iters, batches)
            name = re.sub(r"[^a-z0-9]+", "_", f"{shape_name} {case}".lower()).strip("_")
            with open(os.path.join(out_dir, "hlo", f"{name}.txt"), "w") as f:
                f.write(hlo)
            us = flops / (tflops * 1e12) * 1e6
            base = us if base is None else base
            row = dict(shape=shape_name, m_k_n=[a_shape[0], a_shape[1], b_shape[1]], case=case,
                       us=us, vs_bf16=base / us, kernels=entry_kernels(hlo),
                       fp8_gemms=count_fp8_gemms(hlo))
            rows.append(row)
            print(f"| {shape_name} | {case} | {us:.1f} | {base / us:.2f}x | {row['kernels']} | "
                  f"{row['fp8_gemms']} |", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--batches", type=int, default=10)
    args = p.parse_args(argv)
    os.makedirs(os.path.join(args.out, "hlo"), exist_ok=True)
    dev = jax.devices()[0]
    head = (f"# Float16 dot outputs: bound vs measure placement\n\n{dev.device_kind} ({dev.platform}), "
            f"jax {jax.__version__}, {datetime.date.today()}; median of {args.batches} x {args.iters} "
            f"calls.\n\n`PYTHONPATH=$PWD python benchmarks/narrow_dot_placement.py --out DIR`\n\n"
            "| GEMM | case | us | vs bf16 | kernels | FP8 GEMMs |\n|---|---|---|---|---|---|")
    print(head, flush=True)
    rows = run(args.iters, args.batches, args.out)
    lines = [head] + [f"| {r['shape']} | {r['case']} | {r['us']:.1f} | {r['vs_bf16']:.2f}x | "
                      f"{r['kernels']} | {r['fp8_gemms']} |" for r in rows]
    with open(os.path.join(args.out, "narrow_dot_placement.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "narrow_dot_placement.json"), "w") as f:
        json.dump(dict(device=dev.device_kind, jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
