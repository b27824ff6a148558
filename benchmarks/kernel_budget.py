"""The fewest kernels a scalified step can run under XLA:GPU, against its plain step.

    python benchmarks/kernel_budget.py OUT/hlo_bf16.txt.gz OUT/hlo_fp8.txt.gz [--goal 1.2]

(`experiments.nanogpt.bench --dump-hlo` writes both compiled programs.) A kernel is a
fusion, custom call, copy, transpose or reduce of the ENTRY computation
(`kernel_classes.entry_lines`). The scalified step's kernels beyond the plain step's are
split into:

- FP8 layout transposes: kernels that write an FP8 array through a transpose
  (`fp8_speedup_bound.fp8_traffic`). cuBLASLt's
  FP8 GEMM on Hopper takes only the "TN" layout (both operands contracting-dim minor), so
  the backward GEMMs need x^T, dy^T and W^T: three per linear layer, which no bf16 step has.
- Dynamic scale measurements: kernels that reduce to a scalar (the max-abs or norm a
  run-time scale is taken from). XLA:GPU reduces a large array to a scalar in two kernels,
  the second of which writes the scalar; the first can share a kernel with the op that
  produces the array, the second cannot.
- Scale chains: scalar kernels with no reduction (the scale arithmetic between a
  measurement and the kernels that use its result).
- The rest (casts and rescales that XLA did not fuse into a neighbour, bias rescales).

Counts are differences against the plain step (whose optimizer has scalar reductions and
scalar kernels of its own). Two floors keep the plain step's kernels and one kernel per
dynamic measurement and drop everything else (every first-stage reduction fused into the
kernel that makes its input, every scale chain free, every cast fused): without the FP8
transposes (fused into the FP8 casts: one kernel writes both layouts, which XLA runs
slower than cast plus transpose) and with them (the fast layout).
`benchmarks/scalar_fusion_probe.py` measures what XLA:GPU does with a scale chain: a single
op after a reduction is fused (into the reduction's second kernel or into the kernel that
reads the scalar); every chain of four or more ops tried ran as a kernel of its own
(`benchmarks/results/scalar_fusion_probe_h100.txt`).
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from fp8_speedup_bound import fp8_traffic
from kernel_classes import _KERNEL, computations, entry_lines, is_scalar_shape

from experiments.nanogpt.kernel_profile import read_text


@dataclass(frozen=True)
class KernelCount:
    total: int
    fp8_transposes: int
    scalar_reductions: int
    scalar_chains: int


def count(text: str) -> KernelCount:
    """Kernels of a compiled module's ENTRY computation, by the classes of the module doc."""
    comps = computations(text)
    total = reductions = chains = 0
    for line in entry_lines(text):
        m = _KERNEL.match(line)
        if m is None:
            continue
        total += 1
        out, kind = m.group(2), m.group(3)
        called = re.search(r"calls=%([^,\s]+)", line)
        body = comps.get(called.group(1), "") if called else ""
        ops = set(re.findall(r" = \S+ ([a-z\-]+)\(", body))
        if is_scalar_shape(out):
            if "reduce" in ops or kind == "reduce":
                reductions += 1
            else:
                chains += 1
    return KernelCount(total, fp8_traffic(text)["transpose_kernels"], reductions, chains)


def budget(plain: KernelCount, scaled: KernelCount) -> dict[str, int | float]:
    """The excess of `scaled` over `plain` by class, the floor and the ratios."""
    transposes = scaled.fp8_transposes - plain.fp8_transposes
    reductions = max(scaled.scalar_reductions - plain.scalar_reductions, 0)
    chains = max(scaled.scalar_chains - plain.scalar_chains, 0)
    extra = scaled.total - plain.total
    floor = plain.total + reductions
    return dict(plain=plain.total, scaled=scaled.total, extra=extra, fp8_transposes=transposes,
                scale_measurements=reductions, scale_chains=chains,
                rest=extra - transposes - reductions - chains, floor=floor, floor_tn=floor + transposes,
                ratio=scaled.total / plain.total, floor_ratio=floor / plain.total,
                floor_tn_ratio=(floor + transposes) / plain.total)


def report(name: str, b: dict, goal: float) -> str:
    allowed = int(goal * b["plain"]) - b["plain"]
    rows = [
        ("plain step", b["plain"], ""),
        ("scalified step", b["scaled"], f"{b['ratio']:.2f}x"),
        ("extra kernels", b["extra"], f"goal {goal}x allows {allowed}"),
        ("- FP8 layout transposes", b["fp8_transposes"], "Hopper FP8 GEMMs take only TN"),
        ("- dynamic scale measurements (scalar second stages)", b["scale_measurements"], "one kernel each at least"),
        ("- scale chains (scalar kernels, no reduction)", b["scale_chains"], ""),
        ("- the rest (unfused casts, rescales, first stages)", b["rest"], ""),
        ("floor: plain + measurements", b["floor"], f"{b['floor_ratio']:.2f}x"),
        ("floor with the FP8 transposes", b["floor_tn"], f"{b['floor_tn_ratio']:.2f}x"),
    ]
    lines = [f"## {name}", "", "| kernels | count | |", "|---|---|---|"]
    lines += [f"| {label} | {n:,} | {note} |" for label, n, note in rows]
    left = int(goal * b["plain"]) - b["floor"]
    items = [f"the {b['scale_chains']} scale chains", f"the {b['rest']} other extra kernels"]
    if b["fp8_transposes"]:
        items.append(f"the {b['fp8_transposes']} FP8 transposes")
    lines += ["", f"Above the floor, the {goal}x goal leaves {left} kernels for "
              + ", ".join(items[:-1]) + " and " + items[-1] + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("plain")
    p.add_argument("scaled", nargs="+")
    p.add_argument("--goal", type=float, default=1.2)
    a = p.parse_args(argv)
    plain = count(read_text(a.plain))
    for path in a.scaled:
        print(report(path.split("/")[-1], budget(plain, count(read_text(path))), a.goal))


if __name__ == "__main__":
    main()
