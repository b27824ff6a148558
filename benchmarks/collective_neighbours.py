"""What a compiled step runs right before and right after its gradient collectives: the
kernels that produce each large collective's operands and those that read its result (an
HLO text from `experiments.nanogpt.scaling_bench --dump-hlo`, or any compiled program).

    PYTHONPATH=$PWD python benchmarks/collective_neighbours.py OUT/hlo_bf16_dp_x2.txt.gz OUT/hlo_fp8_dp-bfloat16_x2.txt.gz

A plain data-parallel step all-reduces the gradients its GEMMs wrote; a step whose values
are cast for the wire (``x_i = d_i * s_i`` rounded to bfloat16, then widened again) may add
a pass over every gradient before the collective and one after it. For each collective of
at least ``--min-elements`` elements (async ``-start``/``-done`` pairs counted once) this
lists the producing kernel of every operand (looking through ``get-tuple-element``,
``bitcast``, ``reshape`` and ``tuple``, and through the concatenation XLA's collective
combiner packs a bucket with, which is listed too) and the kernels that read its result,
with their kind (GEMM, a fusion and the ops of its computation, ...) and the bytes they
read and write (a kernel reading an operand twice counts it once; a slice reads what it
writes). The summary adds up, per side, the elementwise fusions (no reduce, no dot): the
passes a wire cast costs.
"""
from __future__ import annotations

import argparse
import collections
import re

from kernel_classes import computations, entry_lines
from experiments.nanogpt.kernel_profile import read_text
from scalify.inspect.hlo import _dtype_bytes, _shapes, hlo_op_kinds

_INSTR = re.compile(r"\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather")
_VIEWS = {"get-tuple-element", "bitcast", "reshape", "tuple"}


def _bytes(shape: str) -> float:
    return float(sum(n * _dtype_bytes(dt) for dt, n in _shapes(shape)))


def _elements(shape: str) -> int:
    return sum(n for _, n in _shapes(shape))


def parse_entry(text: str) -> dict[str, dict]:
    """Name -> {shape, op, operands, calls} of the ENTRY computation's instructions."""
    out = {}
    for line in entry_lines(text):
        m = _INSTR.match(line)
        if m is None:
            continue
        name, shape, op, rest = m.groups()
        args = rest.split("), ", 1)[0] if ")" in rest else rest
        called = re.search(r"calls=%([^,\s]+)", rest)
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        out[name] = {"shape": shape, "op": op, "operands": re.findall(r"%([\w.\-]+)", args),
                     "calls": called.group(1) if called else None,
                     "target": target.group(1) if target else ""}
    return out


def _users(instrs: dict[str, dict]) -> dict[str, list[str]]:
    users = collections.defaultdict(list)
    for name, ins in instrs.items():
        for o in ins["operands"]:
            users[o].append(name)
    return users


def kernel_kind(name: str, ins: dict, comps: dict[str, str], kinds: dict[str, str]) -> str:
    """"gemm" / "gemm-fp8" (as `scalify.inspect.hlo_op_kinds` says), "fusion(op,op,...)" with
    the fused computation's main ops, "custom-call(target)", or the opcode."""
    if kinds.get(name, "").startswith("gemm"):
        return kinds[name]
    if ins["op"] == "custom-call":
        return f"custom-call({ins['target']})"
    if ins["op"] != "fusion":
        return ins["op"]
    body = comps.get(ins["calls"] or "", "")
    ops = set(re.findall(r" = \S+ ([a-z][a-z0-9\-]*)\(", body)) - {"parameter", "constant", "broadcast",
                                                                   "bitcast", "reshape", "tuple",
                                                                   "get-tuple-element"}
    if ops & {"dot", "custom-call"}:
        return "gemm"
    return "fusion(" + ",".join(sorted(ops)) + ")"


def _elementwise(kind: str) -> bool:
    return kind.startswith("fusion(") and not re.search(r"reduce|dot|scatter|gather|sort", kind)


def operand_producers(name: str, instrs: dict, comps: dict[str, str], kinds: dict[str, str]) -> set[str]:
    """The kernels that produce `name`'s operands, looking through views and through the
    concatenation XLA's collective combiner packs a bucket with (which is listed too)."""

    def producer(n: str, seen=()):
        ins = instrs.get(n)
        if ins is None or n in seen or ins["op"] == "parameter":
            return []
        if ins["op"] in _VIEWS:
            return [p for o in ins["operands"] for p in producer(o, seen + (n,))]
        if kernel_kind(n, ins, comps, kinds) in ("concatenate", "fusion(concatenate)"):
            return [n] + [p for o in ins["operands"] for p in producer(o, seen + (n,))]
        return [n]

    return {p for o in instrs[name]["operands"] for p in producer(o)}


def neighbours(text: str, min_elements: int = 1024) -> list[dict]:
    """Per large collective: its op, operand bytes, and (kind, bytes read, bytes written) of
    the kernels producing its operands ("before") and reading its result ("after")."""
    instrs, comps, kinds = parse_entry(text), computations(text), hlo_op_kinds(text)
    users = _users(instrs)

    def consumers(name: str, seen=()):
        out = []
        for u in users.get(name, []):
            if u in seen:
                continue
            op = instrs[u]["op"]
            if op in _VIEWS or op.endswith("-done"):
                out += consumers(u, seen + (u,))
            else:
                out.append(u)
        return out

    def describe(name: str) -> dict:
        ins = instrs[name]
        kind = kernel_kind(name, ins, comps, kinds)
        written = _bytes(ins["shape"])
        read = sum(_bytes(instrs[o]["shape"]) for o in set(ins["operands"]) if o in instrs)
        if kind in ("slice", "fusion(slice)"):
            read = written
        return {"name": name, "kind": kind, "read": read, "written": written}

    rows = []
    for name, ins in instrs.items():
        base = ins["op"].removesuffix("-start")
        if base not in _COLLECTIVES or ins["op"].endswith("-done"):
            continue
        operand_shapes = " ".join(instrs[o]["shape"] for o in ins["operands"] if o in instrs)
        if _elements(operand_shapes) < min_elements:
            continue
        before = sorted(operand_producers(name, instrs, comps, kinds))
        after = sorted(set(consumers(name)))
        rows.append({"collective": name, "op": base, "operand_bytes": _bytes(operand_shapes),
                     "before": [describe(p) for p in before], "after": [describe(c) for c in after]})
    return rows


def summary(rows: list[dict]) -> dict:
    """Per side ("before", "after"): kernels by kind with their bytes read + written, and the
    elementwise passes' total."""
    out = {}
    for side in ("before", "after"):
        kinds = collections.defaultdict(lambda: [0, 0.0])
        seen = set()
        for r in rows:
            for k in r[side]:
                if k["name"] in seen:
                    continue
                seen.add(k["name"])
                kinds[k["kind"]][0] += 1
                kinds[k["kind"]][1] += k["read"] + k["written"]
        elementwise = sum(b for kind, (_, b) in kinds.items() if _elementwise(kind))
        out[side] = {"kinds": dict(kinds), "elementwise_bytes": elementwise}
    out["collectives"] = len(rows)
    out["operand_bytes"] = sum(r["operand_bytes"] for r in rows)
    return out


def markdown(name: str, s: dict) -> str:
    gib = 2.0**30
    lines = [f"### {name}", "",
             f"{s['collectives']} collectives of >= the size limit, {s['operand_bytes'] / gib:.3f} GiB of operands. "
             f"Elementwise fusions before them: {s['before']['elementwise_bytes'] / gib:.3f} GiB read + written; "
             f"after them: {s['after']['elementwise_bytes'] / gib:.3f} GiB.", "",
             "| side | kernel kind | kernels | GiB read + written |", "|---|---|---|---|"]
    for side in ("before", "after"):
        for kind, (n, b) in sorted(s[side]["kinds"].items(), key=lambda kv: -kv[1][1]):
            lines.append(f"| {side} | `{kind[:90]}` | {n} | {b / gib:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(prog="python benchmarks/collective_neighbours.py", description=__doc__.split("\n\n")[0])
    p.add_argument("hlo", nargs="+", help="optimized HLO texts (.txt or .txt.gz)")
    p.add_argument("--min-elements", type=int, default=1024)
    a = p.parse_args(argv)
    text = "".join(markdown(path, summary(neighbours(read_text(path), a.min_elements))) + "\n" for path in a.hlo)
    print(text)
    return text


if __name__ == "__main__":
    main()
