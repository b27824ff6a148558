"""Which scale rule each instruction of the compiled NanoGPT `tiny` step comes from.

    python benchmarks/hlo_by_rule.py --config fp8 --out benchmarks/results/hlo_by_rule_cpu.md

Compiles (nothing runs; CPU is fine) the scalified step with
`ScalifyConfig(rule_scopes=True)`, so that every operation a rule emits carries
"scalify.<primitive>" in its op name, and counts the compiled program's instructions
(parameters, constants, tuples and get-tuple-elements left out) by the innermost rule
named, the scalar-result ones apart. An instruction with no rule in its op name is the
plain program's (or the interpreter's: input guards, promotion, barriers). XLA copies
cheap producers, scalar scale arithmetic above all, into every fusion that reads them, so a
rule's count is what its operations cost after those copies, not what it emitted.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import re
from pathlib import Path

import jax

from experiments.nanogpt import configs as C
from experiments.nanogpt import step as S
from scalify.inspect import hlo_instruction_count

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\S+)\s+([a-z][a-z0-9\-]*)\(")
_SKIP = {"parameter", "constant", "get-tuple-element", "tuple"}


def by_rule(text: str) -> tuple[collections.Counter, collections.Counter]:
    """(instructions, scalar-result instructions) of an optimised HLO module's text per
    innermost "scalify.<primitive>" of their op names ("-" when none)."""
    every, scalar = collections.Counter(), collections.Counter()
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m is None or m.group(2) in _SKIP:
            continue
        name = re.search(r'op_name="([^"]+)"', line)
        rules = re.findall(r"scalify\.([\w\-]+)", name.group(1)) if name else []
        key = rules[-1] if rules else "-"
        every[key] += 1
        scalar[key] += bool(re.match(r"^[a-z0-9]+\[\]", m.group(1)))
    return every, scalar


def scopes_of(text: str, rule: str) -> tuple[collections.Counter, dict]:
    """For the instructions of `rule`: (count per model scope in front of its
    "scalify.<rule>", with layer numbers folded to N; the computations, fused ones included,
    that hold them)."""
    every, where = collections.Counter(), collections.defaultdict(set)
    comp = None
    for line in text.splitlines():
        if line and not line[0].isspace():
            comp = line.split(" ")[0]
        m = _INSTR.match(line)
        name = re.search(r'op_name="([^"]+)"', line) if m else None
        if name is None or m.group(2) in _SKIP:
            continue
        rules = re.findall(r"scalify\.([\w\-]+)", name.group(1))
        if not rules or rules[-1] != rule:
            continue
        scope = re.sub(r"_\d+/", "_N/", name.group(1)[: name.group(1).rfind(f"scalify.{rule}")])
        every[scope] += 1
        where[scope].add(comp)
    return every, where


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="fp8", help="a recipe of experiments/nanogpt/configs.py")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--scopes", default="add", help="a rule whose instructions to split by model scope")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    pair = S.abstract_step_pair(C.get_recipe(f"{a.config}:scalify_config=rule_scopes=True"), "tiny",
                                seq_len=64, batch_size=8)
    compiled = pair.scaled().lower(*pair.args).compile()
    plain = pair.plain().lower(*pair.plain_args).compile()
    every, scalar = by_rule(compiled.as_text())
    plain_every, _ = by_rule(plain.as_text())
    total, plain_total = sum(every.values()), sum(plain_every.values())
    lines = [f"# Instructions of the compiled NanoGPT `tiny` {a.config} step by scale rule, "
             f"{jax.default_backend().upper()}", "",
             f"jax {jax.__version__}, {datetime.date.today()}: "
             f"`python benchmarks/hlo_by_rule.py --config {a.config}`", "",
             f"Scalified step: {total:,} instructions (parameters, constants and tuples left out; "
             f"`hlo_instruction_count`: {hlo_instruction_count(compiled):,}); the plain step: "
             f"{plain_total:,} ({hlo_instruction_count(plain):,}).", "",
             "| rule (primitive) | instructions | share | of them scalar |", "|---|---|---|---|"]
    for key, n in every.most_common(a.top):
        name = "no rule (the plain program, guards, promotion)" if key == "-" else f"`{key}`"
        lines.append(f"| {name} | {n:,} | {n / total:.1%} | {scalar[key]:,} |")
    if a.scopes:
        per, where = scopes_of(compiled.as_text(), a.scopes)
        lines += ["", f"`{a.scopes}`'s instructions by model scope (layer numbers folded to N), and in how "
                  "many computations (fused ones included) they appear:", "",
                  "| scope | instructions | computations |", "|---|---|---|"]
        for scope, n in per.most_common(10):
            lines.append(f"| `{scope or '(top)'}` | {n:,} | {len(where[scope])} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if a.out:
        Path(a.out).write_text(report)


if __name__ == "__main__":
    main()
