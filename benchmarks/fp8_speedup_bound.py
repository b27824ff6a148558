"""How fast can an FP8 step be against bf16? A bound from a measured pair of steps.

    python benchmarks/fp8_speedup_bound.py OUT/bench.json [--hlo OUT/hlo_fp8_....txt.gz]
        [--baseline bf16] [--config fp8] [--bandwidth-tbs 3.35]

`OUT/bench.json` is `experiments.nanogpt.bench --profile N` output holding the baseline
and the FP8 config; `--hlo` the FP8 step's compiled program (`--dump-hlo`). FP8 GEMM
kernels are told apart by their cuBLASLt names (`nvjet_sm90_q...`: FP8 operands) or an
FP8 type in the name; the FP8 step's other GEMMs (the bfloat16 output head) are taken to
cost the same in both steps. With B the baseline's device-busy time per step, G_b its GEMM
time on the GEMMs that the FP8 step runs in FP8 and G_8 the FP8 step's time on them:

- zero-overhead bound: B / (B - (G_b - G_8)), every other kernel of the FP8 step as fast
  as the baseline's (Amdahl: FP8 only speeds up those GEMMs); and the same with the other
  GEMMs (time H, the output head) in FP8 too, at the measured ratio:
  B / (B - (G_b - G_8) - H (1 - G_8 / G_b));
- with the FP8 step's own memory traffic at the device's peak bandwidth W: the FP8
  transposes (Hopper's FP8 GEMMs take only the "TN" layout, so the weight-gradient GEMMs
  read x^T and dy^T, the data-gradient GEMMs W^T; each transpose reads and writes its
  elements) and the FP8 copies of the GEMM operands (written once; their 16-bit sources
  are written by the baseline too): B / (B - (G_b - G_8) + (T + C) / W), read from
  the HLO.
"""
from __future__ import annotations

import argparse
import json
import math
import re

from experiments.nanogpt.kernel_profile import read_text

try:
    from benchmarks.kernel_classes import entry_lines
except ImportError:  # run as a script: benchmarks/ is the first path entry
    from kernel_classes import entry_lines

# cuBLASLt kernels name their operand types after "sm90_": t bfloat16, h float16, s float32,
# q E4M3, r E5M2 (e.g. nvjet_sm90_qrtst: E4M3 x E5M2).
_FP8_GEMM = re.compile(r"sm90_[qr]{2}|e4m3|e5m2|f8", re.I)
_FP8_TYPES = {"f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1}
_BYTES = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, **_FP8_TYPES}
_DEF = re.compile(r"\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) ([a-z\-]+)\((.*)")


def _arrays(shape: str):
    """[(dtype, elements)] of an HLO shape (a tuple's members)."""
    return [(t, math.prod(int(d) for d in dims.split(",")) if dims else 1)
            for t, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", shape)]


def fp8_traffic(text: str) -> dict:
    """Bytes of the FP8 step's FP8 transposes (read + write) and FP8 copies (written) among
    the kernels of the ENTRY computation of a compiled HLO text."""
    entry = entry_lines(text)
    shapes, out = {}, dict(transpose_kernels=0, transpose_bytes=0, copy_kernels=0, copy_bytes=0)
    for line in entry:
        m = _DEF.match(line)
        if m is None:
            continue
        name, shape, op, rest = m.groups()
        shapes[name] = shape
        if op not in ("fusion", "transpose", "copy"):
            continue
        written = [(t, n) for t, n in _arrays(shape) if t in _FP8_TYPES]
        if not written:
            continue
        if op == "transpose" or "transpose" in name:
            operands = re.findall(r"%([^,\s)]+)", rest.split("), ")[0])
            read = sum(_BYTES.get(t, 0) * n for o in operands for t, n in _arrays(shapes.get(o, "")))
            out["transpose_kernels"] += 1
            out["transpose_bytes"] += read + sum(n for _, n in written)
        else:
            out["copy_kernels"] += 1
            out["copy_bytes"] += sum(n for _, n in written)
    return out


def zero_overhead(baseline_profile: dict, fp8_profile: dict) -> dict:
    """The zero-overhead bounds (module doc) from two kernel profiles
    (`experiments.nanogpt.kernel_profile`: `busy_us`, `by_category_us`, `families`)."""
    b, f = baseline_profile, fp8_profile
    gemms = [x for x in f["families"] if x["kind"].startswith("gemm")]
    fp8_us = sum(x["us"] for x in gemms if _FP8_GEMM.search(x["family"]))
    wide_us = sum(x["us"] for x in gemms if not _FP8_GEMM.search(x["family"]))
    base_gemm = sum(us for cat, us in b["by_category_us"].items() if cat.startswith("gemm"))
    base_us = base_gemm - wide_us  # the baseline on the GEMMs FP8 runs
    saved = base_us - fp8_us
    busy_b, busy_f = b["busy_us"], f["busy_us"]
    return dict(busy_baseline_us=busy_b, busy_fp8_us=busy_f, gemm_baseline_us=base_us, gemm_fp8_us=fp8_us,
                wide_gemm_us=wide_us, saved_us=saved, bound_zero_overhead=busy_b / (busy_b - saved),
                bound_all_gemms=busy_b / (busy_b - saved - wide_us * (1 - fp8_us / base_us)),
                measured_busy=busy_b / busy_f)


def bound(bench: dict, baseline: str = "bf16", config: str = "fp8", traffic: dict | None = None,
          bandwidth_tbs: float = 3.35) -> dict:
    rows = {r["config"]: r for r in bench["results"]}
    out = zero_overhead(rows[baseline]["profile"], rows[config]["profile"])
    out["measured_pipelined"] = rows[baseline]["step_ms_pipelined"] / rows[config]["step_ms_pipelined"]
    busy_b, saved = out["busy_baseline_us"], out["saved_us"]
    if traffic is not None:
        floor_us = (traffic["transpose_bytes"] + traffic["copy_bytes"]) / (bandwidth_tbs * 1e6)
        out.update(traffic, floor_us=floor_us, bound_with_traffic=busy_b / (busy_b - saved + floor_us))
    return out


def markdown(r: dict, baseline: str, config: str, bandwidth_tbs: float) -> str:
    lines = [f"| quantity | {config} against {baseline} |", "|---|---|",
             f"| {baseline} device busy per step | {r['busy_baseline_us']:,.0f} us |",
             f"| {config} device busy per step | {r['busy_fp8_us']:,.0f} us |",
             f"| GEMMs run in FP8: {baseline} time | {r['gemm_baseline_us']:,.0f} us |",
             f"| GEMMs run in FP8: {config} time | {r['gemm_fp8_us']:,.0f} us |",
             f"| other GEMMs (same in both) | {r['wide_gemm_us']:,.0f} us |",
             f"| GEMM time FP8 saves | {r['saved_us']:,.0f} us |",
             f"| bound, zero overhead | {r['bound_zero_overhead']:.3f}x |",
             f"| bound, zero overhead, the other GEMMs in FP8 too (same ratio) | {r['bound_all_gemms']:.3f}x |"]
    if "floor_us" in r:
        lines += [f"| FP8 transposes: kernels, bytes read + written | {r['transpose_kernels']}, "
                  f"{r['transpose_bytes'] / 1e9:.2f} GB |",
                  f"| FP8 copies: kernels, bytes written | {r['copy_kernels']}, {r['copy_bytes'] / 1e9:.2f} GB |",
                  f"| their time at {bandwidth_tbs} TB/s | {r['floor_us']:,.0f} us |",
                  f"| bound with that traffic | {r['bound_with_traffic']:.3f}x |"]
    lines += [f"| measured, device busy | {r['measured_busy']:.3f}x |",
              f"| measured, pipelined step | {r['measured_pipelined']:.3f}x |"]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench")
    p.add_argument("--hlo", default=None, help="the FP8 step's compiled HLO (bench --dump-hlo)")
    p.add_argument("--baseline", default="bf16")
    p.add_argument("--config", default="fp8")
    p.add_argument("--bandwidth-tbs", type=float, default=3.35, help="peak HBM bandwidth (H100 SXM: 3.35)")
    a = p.parse_args(argv)
    with open(a.bench) as f:
        bench = json.load(f)
    traffic = fp8_traffic(read_text(a.hlo)) if a.hlo else None
    print(markdown(bound(bench, a.baseline, a.config, traffic, a.bandwidth_tbs), a.baseline, a.config,
                   a.bandwidth_tbs))


if __name__ == "__main__":
    main()
