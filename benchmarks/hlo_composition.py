"""What the compiled NanoGPT `tiny` fp8 step's HLO instructions are, against the plain step.

    python benchmarks/hlo_composition.py --barriers 0,1,4 --out benchmarks/results/hlo_composition_cpu.md

Compiles (nothing runs; CPU is fine) the scalified fp8 step and the same step without
scalify, and reports: instructions per opcode (largest excess first), how many sit inside
fused computations and how many produce a scalar (the scale arithmetic), and the total
against `ScalifyConfig.scale_barrier` (how often scale chains are cut so that XLA cannot
re-fuse them into every consumer).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import re

import jax

from experiments.nanogpt import configs as C
from experiments.nanogpt import step as S
from scalify.inspect import hlo_instruction_count

_INSTR = re.compile(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*([a-z0-9]+)\[([0-9,]*)\]\S*\s.*?\b([a-z][a-z0-9\-]*)\(")


def composition(text: str) -> dict:
    """Opcode counts, and instructions (and scalar-result ones) in fused computations and in
    the others, of an optimised HLO module's text."""
    ops = collections.Counter()
    where = collections.Counter()
    for comp in re.split(r"\n(?=\S)", text):
        head = comp.split("\n", 1)[0]
        kind = "entry" if head.startswith("ENTRY") else "fused" if "fused" in head.split("(")[0] else "other"
        for line in comp.splitlines()[1:]:
            m = _INSTR.match(line)
            if m:
                ops[m.group(3)] += 1
                where[kind] += 1
                where[kind + " scalar"] += m.group(2) == ""
    return {"ops": ops, "where": where}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--barriers", default="4", help="ScalifyConfig.scale_barrier values, e.g. 0,1,4")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    plain_pair = S.abstract_step_pair(C.get_recipe("fp8"), "tiny", seq_len=64, batch_size=8)
    plain = plain_pair.plain().lower(*plain_pair.plain_args).compile()
    n_plain = hlo_instruction_count(plain)
    rows, scaled_text = [], None
    for b in [int(x) for x in a.barriers.split(",")]:
        pair = S.abstract_step_pair(C.get_recipe(f"fp8:scalify_config=scale_barrier={b}"), "tiny",
                                    seq_len=64, batch_size=8)
        compiled = pair.scaled().lower(*pair.args).compile()
        n = hlo_instruction_count(compiled)
        rows.append(f"| {b} | {n:,} | {n / n_plain:.2f}x |")
        if b == 4 or scaled_text is None:
            scaled_text = compiled.as_text()
    pc, sc = composition(plain.as_text()), composition(scaled_text)
    lines = [f"# HLO composition of the NanoGPT `tiny` fp8 step, {jax.default_backend().upper()}",
             "", f"jax {jax.__version__}, {datetime.date.today()}: "
             f"`python benchmarks/hlo_composition.py --barriers {a.barriers}`", "",
             f"Plain step: {n_plain:,} instructions (`scalify.inspect.hlo_instruction_count`).", "",
             "| scale_barrier | scalified instructions | vs plain |", "|---|---|---|", *rows, "",
             "Where the instructions are (the default `scale_barrier`, or the first listed):", "",
             "| | plain | scalified |", "|---|---|---|"]
    for k in ("fused", "fused scalar", "entry", "entry scalar", "other", "other scalar"):
        lines.append(f"| {k} | {pc['where'][k]:,} | {sc['where'][k]:,} |")
    lines += ["", "| opcode | plain | scalified | excess |", "|---|---|---|---|"]
    for op in sorted(set(pc["ops"]) | set(sc["ops"]), key=lambda o: pc["ops"][o] - sc["ops"][o])[:20]:
        lines.append(f"| {op} | {pc['ops'][op]:,} | {sc['ops'][op]:,} | {sc['ops'][op] - pc['ops'][op]:+,} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
