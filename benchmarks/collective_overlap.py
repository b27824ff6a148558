"""How much of a compiled step's compute its gradient collectives can hide behind: where
each large asynchronous collective starts and ends in the schedule, how many GEMMs run
while it is in flight, and which kernels feed more than one collective (an HLO text from
`experiments.nanogpt.scaling_bench --dump-hlo`, or any scheduled program).

    PYTHONPATH=$PWD python benchmarks/collective_overlap.py OUT/hlo_bf16_dp_x2.txt.gz OUT/hlo_fp8_dp-bfloat16_x2.txt.gz

The ENTRY computation of an optimized module is in execution order: its kernels run one
after the other on the compute stream, and an asynchronous collective runs on its own
stream from its ``-start`` to its ``-done``. A gradient all-reduce can only overlap the
GEMMs scheduled after its start. A kernel that feeds several collectives (through views
and the concatenation of a combined bucket) makes all of them wait for its last input:
a multi-output fusion that merged, say, one cast per layer, holds every bucket until the
last layer of the backward pass.
"""
from __future__ import annotations

import argparse
import collections

from collective_neighbours import _COLLECTIVES, _elements, kernel_kind, operand_producers, parse_entry
from kernel_classes import computations
from experiments.nanogpt.kernel_profile import read_text
from scalify.inspect.hlo import hlo_op_kinds


def _is_gemm(name: str, ins: dict, comps: dict, kinds: dict) -> bool:
    kind = kernel_kind(name, ins, comps, kinds)
    return kind.startswith("gemm") or (ins["op"] == "custom-call" and "cudnn" in ins["target"])


def overlap(text: str, min_elements: int = 1024) -> dict:
    """{"gemms": GEMM kernels in the step, "collectives": [per large async collective: name,
    op, elements, gemms_before (scheduled before its start), gemms_in_flight (between its
    start and done), feeders_shared (its producing kernels that also feed another
    collective)]}."""
    instrs, comps, kinds = parse_entry(text), computations(text), hlo_op_kinds(text)
    order = {name: i for i, name in enumerate(instrs)}
    gemm_at = [order[n] for n, ins in instrs.items() if _is_gemm(n, ins, comps, kinds)]

    done_of = {}
    for name, ins in instrs.items():
        if ins["op"].endswith("-done") and ins["operands"]:
            done_of[ins["operands"][0]] = name
    rows = []
    for name, ins in instrs.items():
        if not ins["op"].endswith("-start") or ins["op"].removesuffix("-start") not in _COLLECTIVES:
            continue
        shapes = " ".join(instrs[o]["shape"] for o in ins["operands"] if o in instrs)
        if _elements(shapes) < min_elements:
            continue
        start, done = order[name], order.get(done_of.get(name, name), order[name])
        rows.append({"name": name, "op": ins["op"].removesuffix("-start"), "elements": _elements(shapes),
                     "gemms_before": sum(g < start for g in gemm_at),
                     "gemms_in_flight": sum(start < g < done for g in gemm_at),
                     "feeders": operand_producers(name, instrs, comps, kinds)})
    fed = collections.Counter(f for r in rows for f in r["feeders"])
    for r in rows:
        r["feeders_shared"] = sorted(f for f in r.pop("feeders") if fed[f] > 1)
    return {"gemms": len(gemm_at), "collectives": rows}


def markdown(path: str, s: dict) -> str:
    rows = s["collectives"]
    hidden = sum(r["gemms_in_flight"] > 0 for r in rows)
    shared = sorted({f for r in rows for f in r["feeders_shared"]})
    first = min((r["gemms_before"] for r in rows), default=s["gemms"])
    lines = [f"### {path}", "",
             f"{s['gemms']} GEMM kernels (cuBLAS, cuDNN, GEMM fusions); {len(rows)} asynchronous collectives "
             f">= the size limit, {hidden} of them with GEMMs in flight; the first starts after "
             f"{first} of the GEMMs. Kernels feeding more than one collective: {len(shared)}"
             + (f" ({', '.join(f'`{f}`' for f in shared[:6])}{', ...' if len(shared) > 6 else ''})." if shared else "."),
             "", "| collective | op | elements | GEMMs before its start | GEMMs in flight | shared feeders |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['name']}` | {r['op']} | {r['elements']:,} | {r['gemms_before']} | "
                     f"{r['gemms_in_flight']} | {len(r['feeders_shared'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(prog="python benchmarks/collective_overlap.py", description=__doc__.split("\n\n")[0])
    p.add_argument("hlo", nargs="+", help="optimized HLO texts (.txt or .txt.gz)")
    p.add_argument("--min-elements", type=int, default=1 << 16)
    a = p.parse_args(argv)
    text = "".join(markdown(path, overlap(read_text(path), a.min_elements)) + "\n" for path in a.hlo)
    print(text)
    return text


if __name__ == "__main__":
    main()
