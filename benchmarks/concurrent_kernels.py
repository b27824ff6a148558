"""What runs next to a kernel: for every device kernel of a Perfetto trace whose HLO op
matches a pattern, its duration and the kernels of the same device's other streams that
overlap it (a trace kept by `experiments.nanogpt.scaling_bench --profile N`, under
OUT/traces/).

    PYTHONPATH=$PWD python benchmarks/concurrent_kernels.py TRACE.json.gz N_STEPS 'wrapped_concatenate'

A memory-bound kernel that takes several times what its bytes need at the device's
bandwidth may share the device with another stream's kernel (an NCCL all-reduce on its
communication stream, say). This lists, per matching kernel, how long it ran, on which
stream, and each overlapping kernel with the microseconds they share; the summary gives,
per matching op, the mean duration alone and next to another stream's kernel.
"""
from __future__ import annotations

import argparse
import collections
import re

from experiments.nanogpt.kernel_profile import _op, _read_trace, _split_events


def concurrent(events: list[dict], pattern: str) -> list[dict]:
    """Per kernel whose op matches `pattern` (first device of the trace): op, stream, start,
    duration (us), and [(op of an overlapping kernel on another stream, shared us)]."""
    names, device, _ = _split_events(events)
    if not device:
        return []
    pid = device[0][2]["pid"]
    kernels = [iv for iv in device if iv[2]["pid"] == pid]
    rx = re.compile(pattern)
    rows = []
    for start, end, e in kernels:
        op = _op(e)
        if not rx.search(op):
            continue
        tid = e.get("tid")
        others = []
        for s2, e2, ev in kernels:
            if s2 >= end:
                break
            if ev.get("tid") == tid or e2 <= start:
                continue
            others.append((_op(ev), min(end, e2) - max(start, s2)))
        rows.append({"op": op, "stream": names.get((pid, tid), str(tid)), "start": start,
                     "us": end - start, "next_to": others})
    return rows


def summary(rows: list[dict]) -> dict:
    """op -> {"alone": [durations], "shared": [durations]} (shared: another stream's kernel
    overlaps at least half of it)."""
    out = collections.defaultdict(lambda: {"alone": [], "shared": []})
    for r in rows:
        shared = sum(us for _, us in r["next_to"]) >= r["us"] / 2
        out[r["op"]]["shared" if shared else "alone"].append(r["us"])
    return dict(out)


def _mean(xs):
    return f"{sum(xs) / len(xs):.1f}" if xs else "-"


def markdown(path: str, rows: list[dict], n_steps: int) -> str:
    lines = [f"### {path}", "", f"{len(rows)} kernels matched over {n_steps} steps.", "",
             "| op | runs alone | mean us alone | next to another stream's kernel | mean us there |",
             "|---|---|---|---|---|"]
    for op, s in sorted(summary(rows).items()):
        lines.append(f"| `{op}` | {len(s['alone'])} | {_mean(s['alone'])} | {len(s['shared'])} | {_mean(s['shared'])} |")
    lines += ["", "| op | stream | us | overlapping kernels (op: shared us) |", "|---|---|---|---|"]
    for r in rows:
        nxt = ", ".join(f"`{o}`: {us:.0f}" for o, us in r["next_to"][:4]) or "-"
        lines.append(f"| `{r['op']}` | {r['stream'][:30]} | {r['us']:.1f} | {nxt} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(prog="python benchmarks/concurrent_kernels.py", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a perfetto_trace.json.gz")
    p.add_argument("steps", type=int, help="number of steps (calls) in the trace")
    p.add_argument("pattern", help="regular expression matched against each kernel's HLO op")
    a = p.parse_args(argv)
    text = markdown(a.trace, concurrent(_read_trace(a.trace), a.pattern), a.steps)
    print(text)
    return text


if __name__ == "__main__":
    main()
