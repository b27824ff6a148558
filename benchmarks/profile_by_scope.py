"""Device time of a profiled step grouped by where each kernel's HLO op comes from.

    python benchmarks/profile_by_scope.py OUT/trace_fp8/.../perfetto_trace.json.gz OUT/hlo_fp8.txt.gz N [--by rule]

(`experiments.nanogpt.bench --profile N --dump-hlo --out OUT` writes both.) Each kernel is
matched to its HLO instruction's `op_name`, which carries the model's name scopes (scalify
keeps the user's scopes on what its rules emit): GEMM and attention kernels; `fwd` / `bwd`
ops inside the model (`block/...` for the transformer blocks); `step:` ops outside the
model (the optimizer update, the scale guards, the master-weight encodes); `nometa:`
kernels XLA made without an op name (layout transposes of GEMM operands). Times are per
step (the trace's total over N steps / N), in microseconds.

`--by rule`, for a step scalified with `ScalifyConfig(rule_scopes=True)` (e.g. the bench
config `fp8:scalify_config=rule_scopes=true`): kernels grouped by the scalify rule that
emitted their HLO op (the innermost `scalify.<primitive>` scope of its `op_name`), or
`no rule` (the plain program: what scalify passed through unchanged, guards and
promotions outside a rule).
"""
from __future__ import annotations

import collections
import re
import sys

from experiments.nanogpt.kernel_profile import _device_pids, _read_trace, read_text

_GEMM = re.compile(r"nvjet|gemm|cublas|sm90_|cudnn|xmma|cutlass")
_INSTR = re.compile(r"^\s+(?:ROOT )?%(\S+) = (.*?) (?:fusion|custom-call|copy|transpose)\(")


def op_names(hlo_text: str) -> dict[str, str]:
    """Kernel name (XLA's instruction name with '.' and '-' as '_') -> op_name."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m:
            op = re.search(r'op_name="([^"]*)"', line)
            out[re.sub(r"[.\-]", "_", m.group(1))] = op.group(1) if op else ""
    return out


def scope(kernel: str, op: str | None) -> str:
    if _GEMM.search(kernel):
        return "GEMM and attention kernels"
    if not op:
        return "nometa:" + re.sub(r"[._]\d+$", "", kernel)
    op = op.split("/", 1)[-1]
    m = re.match(r"(transpose\()?jvp\([^)]*\)\)?/(block_\d+/)?([^/]*)", op)
    if m:
        return ("bwd " if m.group(1) else "fwd ") + ("block/" if m.group(2) else "") + m.group(3)
    return "step:" + op.split("/")[0][:40]


def rule(kernel: str, op: str | None) -> str:
    """The scalify rule of a kernel's HLO op (`ScalifyConfig.rule_scopes`); GEMM and attention
    kernels apart."""
    if _GEMM.search(kernel):
        return "GEMM and attention kernels"
    rules = re.findall(r"scalify\.([A-Za-z0-9_\-]+)", op or "")
    return f"rule {rules[-1]}" if rules else ("no rule" if op else "nometa:" + re.sub(r"[._]\d+$", "", kernel))


def by_scope(events: list[dict], names: dict[str, str], n_steps: int, key=scope) -> dict[str, list[float]]:
    pids = _device_pids([e for e in events if e.get("ph") == "M"])
    agg = collections.defaultdict(lambda: [0.0, 0.0])
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in pids:
            row = agg[key(e["name"], names.get(e["name"]))]
            row[0] += e.get("dur", 0.0) / n_steps
            row[1] += 1 / n_steps
    return dict(agg)


def main(argv=None) -> None:
    args = list(argv or sys.argv[1:])
    by_rule = args[3:5] == ["--by", "rule"]
    trace, hlo, n = args[:3]
    names = op_names(read_text(hlo))
    agg = by_scope(_read_trace(trace), names, int(n), rule if by_rule else scope)
    total = sum(t for t, _ in agg.values())
    if by_rule:
        print(f"device busy {total:,.0f} us/step, {sum(c for _, c in agg.values()):,.0f} kernels/step")
        print("\n| rule | us/step | kernels/step |\n|---|---|---|")
        for k, (t, c) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
            print(f"| {k} | {t:,.1f} | {c:g} |")
        return
    groups = collections.defaultdict(float)
    for k, (t, _) in agg.items():
        groups["step (outside the model)" if k.startswith("step:") else
               "model blocks (non-GEMM)" if "block/" in k else
               "GEMM and attention" if k.startswith("GEMM") else "other"] += t
    print(f"device busy {total:,.0f} us/step; " + ", ".join(f"{k} {v:,.0f}" for k, v in groups.items()))
    print("\n| scope | us/step | kernels/step |\n|---|---|---|")
    for k, (t, c) in sorted(agg.items(), key=lambda kv: -kv[1][0]):
        print(f"| {k} | {t:,.1f} | {c:g} |")


if __name__ == "__main__":
    main()
