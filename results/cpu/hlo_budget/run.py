"""What the compiled recipe step holds: HLO instructions with one element (the scale
arithmetic: scales, their products, power-of-two fits, range clamps, statistics reads)
against instructions on arrays, the recipe step against the plain step.

The stock GPT of `benchmarks/trace_time.py` (2 layers, d_model 128, sequence 64, batch 4,
bfloat16 compute) compiled on CPU, as in `tests/e2e/test_trace_time.py`: the plain jitted
step against `scalify.recipes.get(NAME).train_step` (sized delayed statistics). Every
instruction of the compiled module is counted, fused computations included
(`scalify.inspect.hlo_instruction_count`'s count): "scalar" when its output has one
element, "array" otherwise; scalar instructions are split by pass (`source_label` of their
op name: forward, backward, other, or none when XLA gave it no op name) and by opcode.

    PYTHONPATH=$PWD python results/cpu/hlo_budget/run.py > results/cpu/hlo_budget/output.json
"""
import json
import re
import sys

import jax
import jax.numpy as jnp

from benchmarks import trace_time as T
from scalify.inspect.hlo import hlo_instruction_count, source_label

RECIPES = ("fp16", "fp16-master", "fp8", "fp8-bf16", "fp8-fp16-state")
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\S+)(.*)$", re.M)


def _elements(shape: str) -> int | None:
    m = re.fullmatch(r"[a-z0-9]+\[([\d,]*)\](\{[^}]*\})?", shape)
    if m is None:  # a tuple ("(f32[...], ...)")
        return None
    n = 1
    for d in filter(None, m.group(1).split(",")):
        n *= int(d)
    return n


def budget(text: str) -> dict:
    out = {"instructions": 0, "array": 0, "scalar": 0,
           "scalar_by_pass": {"forward": 0, "backward": 0, "other": 0, "none": 0}, "scalar_by_opcode": {}}
    for shape, rest in _LINE.findall(text):
        out["instructions"] += 1
        if _elements(shape) != 1:
            out["array"] += 1
            continue
        out["scalar"] += 1
        opcode = re.match(r"\s*([\w\-]+)\(", rest)
        key = opcode.group(1) if opcode else "?"
        out["scalar_by_opcode"][key] = out["scalar_by_opcode"].get(key, 0) + 1
        op = re.search(r'op_name="([^"]*)"', rest)
        out["scalar_by_pass"][source_label(op.group(1)).split(" ")[0] if op else "none"] += 1
    assert out["instructions"] == hlo_instruction_count(text), "instruction counts disagree"
    out["scalar_by_opcode"] = dict(sorted(out["scalar_by_opcode"].items(), key=lambda kv: -kv[1]))
    return out


def main():
    model, params, opt, opt_state, tokens = T.setup(dtype=jnp.bfloat16, n_layers=2, d_model=128, seq_len=64,
                                                    batch=4)
    plain = budget(jax.jit(T.make_step(model, opt)).lower(params, opt_state, tokens).compile().as_text())
    records = []
    for name in RECIPES:
        step, init = T.recipe_step(name, model, opt)
        state = step.sized(init(params), tokens)
        records.append({"recipe": name, **budget(jax.jit(step).lower(state, tokens).compile().as_text())})
    json.dump({"jax": jax.__version__, "backend": jax.default_backend(), "plain": plain, "recipes": records},
              sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
