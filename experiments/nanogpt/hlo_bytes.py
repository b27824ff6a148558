"""Bytes written per step by the large outputs of a compiled step's top-level instructions.

``python -m experiments.nanogpt.hlo_bytes HLO.txt.gz [HLO2.txt.gz ...] [--min-elements N]``
reads optimized HLO text (``bench --dump-hlo`` writes it) and sums, over the instructions
of the ENTRY computation (fusions, custom calls, copies, ...), the bytes of every output
array with at least ``N`` elements (default 2^20), by dtype and by (dtype, shape), with the
name of one instruction of each group. Each such output is written to device memory once
per step, so the totals compare how much memory traffic two steps make. cuBLAS workspaces
(``s8``/``u8`` outputs of custom calls) are left out.
"""
from __future__ import annotations

import argparse
import collections
import re

from experiments.nanogpt.kernel_profile import read_text

__all__ = ["large_outputs", "markdown_large_outputs", "main"]

_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2,
          "s16": 2, "u16": 2, "f8e4m3fn": 1, "f8e5m2": 1, "s8": 1, "u8": 1, "pred": 1}
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(")


def large_outputs(hlo_text: str, min_elements: int = 2 ** 20) -> dict:
    """{"by_dtype": {dtype: bytes}, "groups": [{dtype, shape, count, bytes, example}], "total"}."""
    start = hlo_text.find("\nENTRY")
    if start < 0:
        raise ValueError("No ENTRY computation in the HLO text: pass an optimized HLO module.")
    groups = collections.defaultdict(lambda: [0, 0, ""])
    for line in hlo_text[start:].splitlines()[1:]:
        m = _INSTRUCTION.match(line)
        if not m or m.group(3) in ("parameter", "get-tuple-element", "bitcast", "tuple", "constant"):
            continue
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(2)):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            if n < min_elements or dtype in ("s8", "u8"):
                continue
            g = groups[(dtype, dims)]
            g[0] += 1
            g[1] += n * _BYTES.get(dtype, 4)
            g[2] = g[2] or m.group(1)
    by_dtype = collections.Counter()
    for (dtype, _), (_, b, _) in groups.items():
        by_dtype[dtype] += b
    rows = [{"dtype": d, "shape": s, "count": c, "bytes": b, "example": e}
            for (d, s), (c, b, e) in sorted(groups.items(), key=lambda kv: -kv[1][1])]
    return {"total": sum(by_dtype.values()), "by_dtype": dict(by_dtype.most_common()), "groups": rows}


def markdown_large_outputs(name: str, res: dict, top: int = 25) -> str:
    mb = lambda b: f"{b / 2 ** 20:,.0f}"  # noqa: E731
    lines = [f"### {name}", "", f"{mb(res['total'])} MiB written per step by large outputs: "
             + ", ".join(f"{d} {mb(b)} MiB" for d, b in res["by_dtype"].items()), "",
             "| dtype | shape | outputs | MiB | e.g. |", "|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | [{r['shape']}] | {r['count']} | {mb(r['bytes'])} | `{r['example']}` |"
              for r in res["groups"][:top]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m experiments.nanogpt.hlo_bytes",
                                description=__doc__.splitlines()[0])
    p.add_argument("hlo", nargs="+", help="optimized HLO text files (.txt or .txt.gz)")
    p.add_argument("--min-elements", type=int, default=2 ** 20)
    a = p.parse_args(argv)
    out = []
    for path in a.hlo:
        out.append(markdown_large_outputs(path, large_outputs(read_text(path), a.min_elements)))
    text = "\n".join(out)
    print(text)
    return text


if __name__ == "__main__":
    main()
