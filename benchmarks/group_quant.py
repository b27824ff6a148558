"""Per-group FP8 quantisation on the device, alone and inside the FP8-saved attention of the
NanoGPT step.

    PYTHONPATH=$PWD python benchmarks/group_quant.py --out results/group_quant

Cases (each jitted alone, median of `--batches` timings of `--iters` queued calls):
- `quantize`: `scalify.quant.mx_quantize(x, E4M3, G, -1, "ceil")` on the softmax probabilities of one
  attention layer of the `paper` model (batch 16 x 16 heads x 512 x 512, float32, G = 16)
  and on an MLP activation (16 x 512 rows x 4096, float16, G = 16 and 128); with the
  effective bandwidth (bytes read + written / time);
- `attention/<variant>`: forward + backward of one attention layer (q, k, v of
  16 x 512 x 16 x 64 in float16): the model's `causal_attention` under autodiff, and
  `fp8_saved_attention` with the probabilities saved per group of 16 (with each
  `saved_activations.PROBS_BARRIER` setting), per group of 128, and per tensor (the others
  with the default setting); with `--profile N`, the device time per kernel family of each
  (`experiments/nanogpt/kernel_profile.py`, written to `group_quant_profile.md`).
Everything runs in one process, so the ratios compare like with like. Writes
`group_quant.json` and `group_quant.md` to `--out`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from fp8_layout import measure  # benchmarks/ is sys.path[0] when run as a script
from scalify.ops.fp8 import E4M3
from scalify.ops import saved_activations as sa
from scalify.ops.saved_activations import SaveSpec, fp8_saved_attention
from scalify.quant import mx
from experiments.nanogpt.model import causal_attention


def _time(fn, args, iters: int, batches: int, profile: int = 0):
    """Median ms per call of the compiled `fn` (`fp8_layout.measure`); with `profile`,
    also (ms, kernel profile of `profile` calls)."""
    hlo, seconds = measure(fn, args, iters, batches)
    ms = 1e3 * seconds
    if not profile:
        return ms
    from experiments.nanogpt.kernel_profile import profile_kernels

    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(*args))  # compiled (or cached) before the trace starts
    return ms, profile_kernels(lambda: jax.block_until_ready(jitted(*args)), profile, hlo)


def quantize_rows(shape_probs, shape_act, iters, batches):
    rng = np.random.default_rng(0)
    probs = jax.nn.softmax(jnp.asarray(rng.standard_normal(shape_probs, np.float32) * 3), axis=-1)
    act = jnp.asarray(rng.standard_normal(shape_act, np.float32), jnp.float16)
    rows = []
    for name, x, g in (("probs", probs, 16), ("activation", act, 16), ("activation", act, 128)):
        moved = x.size * x.dtype.itemsize + x.size + x.size // g  # read x, write FP8 + E8M0
        ms = _time(lambda v: mx.mx_quantize(v, E4M3, g, -1, "ceil"), (x,), iters, batches)
        rows.append({"case": "quantize", "tensor": f"{name} {tuple(x.shape)} {x.dtype}",
                     "group": g, "ms": ms, "GB/s": moved / ms / 1e6})
    return rows


def attention_rows(b, t, h, d, iters, batches, profile=0):
    rng = np.random.default_rng(1)
    q, k, v, g = (jnp.asarray(rng.standard_normal((b, t, h, d), np.float32), jnp.float16) for _ in range(4))
    mask = jnp.tril(jnp.ones((t, t), bool))

    def fwd_bwd(attn):
        def f(q, k, v, g):
            out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, mask), q, k, v)
            return out, vjp(g)

        return f

    variants = [("autodiff (no FP8 save)", None, causal_attention)]
    for where in sa._PROBS_BARRIERS:
        variants.append((f"probs g16, barrier {where}", where,
                         lambda q, k, v, m: fp8_saved_attention(q, k, v, m, qkv_spec=None,
                                                                probs_spec=SaveSpec(group_size=16))))
    variants.append(("probs g128", None,
                     lambda q, k, v, m: fp8_saved_attention(q, k, v, m, qkv_spec=None,
                                                            probs_spec=SaveSpec(group_size=128))))
    variants.append(("probs per tensor, bound 1 (no reduction)", None,
                     lambda q, k, v, m: fp8_saved_attention(q, k, v, m, qkv_spec=None,
                                                            probs_spec=SaveSpec(amax_bound=1.0))))
    variants.append(("coat-attention-bound: probs bound 1 + qkv per tensor", None,
                     lambda q, k, v, m: fp8_saved_attention(q, k, v, m, qkv_spec=SaveSpec(),
                                                            probs_spec=SaveSpec(amax_bound=1.0))))
    variants.append(("probs per tensor", None,
                     lambda q, k, v, m: fp8_saved_attention(q, k, v, m, qkv_spec=None,
                                                            probs_spec=SaveSpec())))
    variants.append(("probs g16 + qkv per tensor", None,
                     lambda q, k, v, m: fp8_saved_attention(q, k, v, m, qkv_spec=SaveSpec(),
                                                            probs_spec=SaveSpec(group_size=16))))
    rows = []
    base = None
    default = sa.PROBS_BARRIER
    for name, where, attn in variants:
        sa.PROBS_BARRIER = where or default
        res = _time(fwd_bwd(attn), (q, k, v, g), iters, batches, profile)
        ms, prof = res if profile else (res, None)
        base = base or ms
        rows.append({"case": f"attention/{name}", "tensor": f"q,k,v {(b, t, h, d)} float16", "group": None,
                     "ms": ms, "vs autodiff": ms / base, **({"profile": prof} if prof else {})})
    sa.PROBS_BARRIER = default
    return rows


def markdown(doc) -> str:
    m = doc["meta"]
    lines = [f"# Per-group FP8 quantisation: {m['device']}, jax {m['jax']}", "", f"`{m['command']}`", "",
             "| case | tensor | G | ms | GB/s or vs autodiff |", "|---|---|---|---|---|"]
    for r in doc["rows"]:
        extra = f"{r['GB/s']:.0f} GB/s" if "GB/s" in r else f"{r['vs autodiff']:.3f}x"
        lines.append(f"| {r['case']} | {r['tensor']} | {r['group'] or '-'} | {r['ms']:.3f} | {extra} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke test)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="profile N calls of each attention case")
    a = p.parse_args(argv)
    if a.small:
        probs, act, att = (2, 2, 32, 32), (2, 32, 256), (2, 32, 2, 16)
    else:
        probs, act, att = (16, 16, 512, 512), (16, 512, 4096), (16, 512, 16, 64)
    rows = quantize_rows(probs, act, a.iters, a.batches) + attention_rows(*att, a.iters, a.batches, a.profile)
    doc = {"meta": {"command": "python benchmarks/group_quant.py " + " ".join(sys.argv[1:] if argv is None else argv),
                    "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                    "python": platform.python_version()},
           "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "group_quant.json"), "w") as f:
        json.dump(doc, f, indent=1)
    text = markdown(doc)
    with open(os.path.join(a.out, "group_quant.md"), "w") as f:
        f.write(text)
    profiled = [r for r in rows if "profile" in r]
    if profiled:
        from experiments.nanogpt.kernel_profile import markdown_profile

        with open(os.path.join(a.out, "group_quant_profile.md"), "w") as f:
            f.write("".join(markdown_profile(r["case"], r["profile"], r["ms"]) + "\n" for r in profiled))
    print(text)
    return doc


if __name__ == "__main__":
    main()
