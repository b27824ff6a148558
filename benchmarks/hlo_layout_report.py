"""Layout report of a compiled step's optimized HLO: FP8 GEMM output layouts and the
transpose kernels, by size (bytes moved) and by the op they come from.

    python benchmarks/hlo_layout_report.py OUT/hlo_fp8.txt.gz [more.txt.gz ...]

A transpose kernel is an entry-computation fusion named `*transpose*` (XLA's names on GPU);
its bytes are its output's. FP8 GEMMs are `__cublas$lt$matmul$f8` custom calls; an output
layout other than row-major (`{1,0}` for 2-D) makes XLA transpose its users' data.
"""
from __future__ import annotations

import collections
import re
import sys

from experiments.nanogpt.kernel_profile import read_text

_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s8": 1}
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]\{([\d,]*)\}")


def _shapes(text: str):
    for dt, dims, layout in _SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        yield dt, dims, layout, n * _BYTES.get(dt, 4)


def report(path: str) -> str:
    hlo = read_text(path)
    entry = hlo[hlo.index("\nENTRY"):]
    gemms = collections.Counter()
    moves = collections.defaultdict(lambda: [0, 0])
    for line in entry.splitlines():
        m = re.match(r"\s+(?:ROOT )?%(\S+) = (\(.*?\)|\S+) (\S+?)\(", line)
        if not m:
            continue
        name, shape, _ = m.groups()
        if "__cublas$lt$matmul$f8" in line:
            dt, dims, layout, _ = next(_shapes(shape))
            gemms[f"{dt}[{dims}]{{{layout}}}"] += 1
        elif "transpose" in name:
            total = sum(b for dt, _, _, b in _shapes(shape))
            dts = "+".join(sorted({dt for dt, _, _, _ in _shapes(shape)}))
            op = re.search(r'op_name="([^"]*)"', line)
            where = re.sub(r"block_\d+", "block_N", op.group(1).split("/", 1)[-1]) if op else "(no op name)"
            key = (dts, where[-70:])
            moves[key][0] += 1
            moves[key][1] += total
    lines = [f"## {path}", "", "FP8 GEMM outputs (shape{layout}: count):"]
    lines += [f"- {k}: {v}" for k, v in sorted(gemms.items())]
    total = sum(b for _, b in moves.values())
    lines += ["", f"Transpose kernels: {sum(n for n, _ in moves.values())}, "
              f"{total / 2**20:,.1f} MiB written", "", "| dtype | op | kernels | MiB |", "|---|---|---|---|"]
    for (dt, where), (n, b) in sorted(moves.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {dt} | `{where}` | {n} | {b / 2**20:,.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(report(p))
