"""Classify the kernels of a compiled GPU step by the size of what they write and by the
"expensive" scalar ops they hold (an HLO text from `experiments.nanogpt.bench --dump-hlo`).

    python benchmarks/kernel_classes.py OUT/hlo_bf16.txt.gz OUT/hlo_fp8.txt.gz

A kernel is a fusion, custom call, copy, transpose or reduce of the ENTRY computation. Its
size class is the largest array it writes (scalar, <= 4096 elements, <= 1M, larger).
Scalar kernels are listed with the divide, sqrt, rsqrt, power, exp, log or tanh ops they
hold and the rule that emitted them (the innermost `scalify.<primitive>` of the op name, for
a step compiled with `ScalifyConfig(rule_scopes=True)`). `benchmarks/fp8_speedup_bound.py`
reads the ENTRY computation with `entry_lines`.
"""
from __future__ import annotations

import collections
import math
import re
import sys

from experiments.nanogpt.kernel_profile import read_text

_KERNEL = re.compile(r"\s*(?:ROOT )?%(\S+) = (.*?) (fusion|custom-call|copy|transpose|reduce)\(")
_EXPENSIVE = {"divide", "sqrt", "rsqrt", "power", "exponential", "log", "tanh"}


def entry_lines(text: str) -> list[str]:
    """The instruction lines of the ENTRY computation of an HLO module's text."""
    return re.search(r"\nENTRY [^\n]*\{\n(.*?)\n\}", text, re.S).group(1).splitlines()


def computations(text: str) -> dict[str, str]:
    """Name -> body of every computation of an HLO module's text."""
    return {m.group(1): m.group(2) for m in re.finditer(r"\n(?:ENTRY )?%(\S+) [^\n]*\{\n(.*?)\n\}", text, re.S)}


def is_scalar_shape(shape: str) -> bool:
    """Whether an HLO result shape (one array or a tuple) holds only scalars."""
    return re.fullmatch(r"\(?([a-z0-9]+\[\](\{\})?(, )?)+\)?", shape) is not None


def classify(text: str) -> tuple[collections.Counter, collections.Counter]:
    """(kernels per size class, scalar kernels per (kind, expensive ops, rule))."""
    comps = computations(text)
    entry = entry_lines(text)
    sizes, scalars = collections.Counter(), collections.Counter()
    for line in entry:
        m = _KERNEL.match(line)
        if m is None:
            continue
        shapes = re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", m.group(2))
        n = max((math.prod(int(d) for d in dims.split(",")) if dims else 1
                 for dtype, dims in shapes if dtype not in ("s8", "u8")), default=0)
        sizes["scalar" if n <= 1 else "<= 4096" if n <= 4096 else "<= 1M" if n <= 1 << 20 else "> 1M"] += 1
        if n > 1:
            continue
        called = re.search(r"calls=%([^,\s]+)", line)
        body = comps.get(called.group(1), "") if called else ""
        ops = set(re.findall(r" = \S+ ([a-z\-]+)\(", body))
        op_name = re.search(r'op_name="([^"]+)"', line)
        rules = re.findall(r"scalify\.([a-z0-9_\-]+)", op_name.group(1) if op_name else "")
        kind = "reduction" if "reduce" in ops or m.group(3) == "reduce" else "elementwise"
        scalars[(kind, ", ".join(sorted(ops & _EXPENSIVE)) or "-", rules[-1] if rules else "(none)")] += 1
    return sizes, scalars


def main(paths):
    for path in paths:
        sizes, scalars = classify(read_text(path))
        print(f"## {path.split('/')[-1]}\n\n{sum(sizes.values())} kernels:", ", ".join(
            f"{k} {sizes[k]}" for k in ("scalar", "<= 4096", "<= 1M", "> 1M")), "\n")
        print("| scalar kernels | kind | expensive ops | rule |\n|---|---|---|---|")
        for (kind, ops, rule), n in scalars.most_common():
            print(f"| {n} | {kind} | {ops} | {rule} |")
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
