"""Collectives of the compiled NanoGPT train step per parallel mode: how many, of which
kind, and the bytes they move, for scalified recipes against the plain bf16 step of the
same mode. Counted from the compiled HLO (`scalify.inspect.collective_bytes`); nothing runs.

On CPU with 8 host devices (the numbers of `results/cpu/collectives`)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=$PWD \\
        python -m experiments.nanogpt.collective_budget --model tiny --configs bf16,fp8 \\
        --out OUT

Modes are those of `experiments/nanogpt/parallel.py`; ``fsdp:kernel[:GRAD_WIRE]`` is
``fsdp:WIRE[:GRAD_WIRE]`` with WIRE the format the recipe's matmuls cast kernels to
(bfloat16 for bf16, e4m3 for fp8).
For each mode the record has the number of collectives (all, and those under
``--small-elements`` elements: scalars of scales, amaxes, norms, losses), and per kind
(all-reduce, all-gather, reduce-scatter, all-to-all) the count, the operand bytes and the
ring bytes per device ("wire", see `scalify.inspect.CollectiveOp`), also by dtype. The markdown table
relates each scalified record to the plain config's record of the same mode (and the
wire-format modes to the plain ``dp``/``fsdp``).

XLA combines and places collectives per backend: XLA:CPU has no reduce-scatter (FSDP
gradients are all-reduced and sliced), widens FP8 and bfloat16 collectives (to float16 and
float32), and combines other groups than XLA:GPU. The counts here are those of the CPU
program, not a GPU measurement.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

from scalify.inspect import collective_bytes
from experiments.nanogpt import configs as C
from experiments.nanogpt import parallel as PL
from experiments.nanogpt import step as S

__all__ = ["MODES", "KINDS", "resolve_mode", "measure", "markdown", "main"]

MODES = ("dp", "fsdp", "fsdp:kernel", "fsdp:kernel:bfloat16", "dp:e5m2", "dp:e5m2:auto:all_to_all", "dp:e4m3",
         "dp:float16", "dp:bfloat16", "dp:float32")
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


def resolve_mode(mode: str, recipe) -> str:
    """``fsdp:kernel[:GRAD_WIRE]`` -> ``fsdp:WIRE[:GRAD_WIRE]`` with WIRE the recipe's kernel
    format; others as given."""
    if mode.split(":")[:2] != ["fsdp", "kernel"]:
        return mode
    kernel = C.resolve_dtype(recipe.matmul_kernel) or C.resolve_dtype(recipe.dtype)
    wire = next(k for k, v in PL.WIRES.items() if np.dtype(v) == kernel)
    return ":".join(["fsdp", wire] + mode.split(":")[2:])


def summary(compiled, small_elements: int = 64) -> dict:
    """Counts and bytes of the collectives of a compiled program, by kind."""
    every = collective_bytes(compiled)
    out = {"count": every["count"],
           "small": sum(1 for o in every["ops"] if o.elements < small_elements),
           "operand_bytes": every["operand_bytes"], "wire_bytes": every["wire_bytes"],
           "by_dtype": every["by_dtype"], "kinds": {}}
    for kind in KINDS:
        ops = [o for o in every["ops"] if o.op == kind]
        by_dtype: dict[str, float] = {}
        for o in ops:
            key = "+".join(o.dtypes)
            by_dtype[key] = by_dtype.get(key, 0.0) + o.wire_bytes
        out["kinds"][kind] = {"count": len(ops), "operand_bytes": sum(o.operand_bytes for o in ops),
                              "wire_bytes": float(sum(o.wire_bytes for o in ops)),
                              "wire_by_dtype": by_dtype}
    return out


def measure(config: str, mode: str, mesh, model: str = "tiny", batch_size: int | None = None,
            small_elements: int = 64, **gpt_overrides) -> dict:
    """Compiles the step of `config` in `mode` on `mesh` and returns its collectives
    (`summary`) with the config, the resolved mode and the compile time."""
    recipe = C.get_recipe(config)
    gpt = S.gpt_config(recipe, model, **gpt_overrides)
    tx = S.make_optimizer(recipe, S.OptimConfig())
    state = S.init_state(recipe, gpt, tx)
    spec = resolve_mode(mode, recipe)
    par = PL.parse_mesh(spec)
    step = PL.make_parallel_train_step(recipe, gpt, tx, mesh, par, state)
    state = PL.shard_state(state, mesh, par.mode)
    tokens = np.zeros((batch_size or mesh.size, gpt.seq_len), np.int32)
    t0 = time.perf_counter()
    compiled = step.lower(state, tokens, tokens).compile()
    rec = {"config": config, "scalify": recipe.scalify, "mode": mode, "mesh": spec,
           "devices": mesh.size, "compile_s": time.perf_counter() - t0}
    rec.update(summary(compiled, small_elements))
    return rec


def _fmt(n) -> str:
    for unit, div in (("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _ratio(a, b) -> str:
    return "-" if not b else f"{a / b:.2f}x"


def _reference(records, rec, mode):
    return next((r for r in records if not r["scalify"] and r["mode"] == mode
                 and r["devices"] == rec["devices"]), None)


def markdown(records: list[dict]) -> str:
    """One table: per mode and config, the collectives by kind, and the scalified step
    against the plain one of the same mode (count and wire-byte ratios)."""
    head = ("| mode | config | collectives (of them < 64 elem.) | all-reduce | all-gather | "
            "reduce-scatter | all-to-all | wire bytes / device | vs plain, same mode: count, "
            "wire bytes | vs plain dp/fsdp: wire bytes (all-gather) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    order = {m: i for i, m in enumerate(MODES)}
    for r in sorted(records, key=lambda r: (order.get(r["mode"], 99), r["scalify"], r["config"])):
        kinds = []
        for k in KINDS:
            st = r["kinds"][k]
            kinds.append(f"{st['count']} / {_fmt(st['wire_bytes'])}" if st["count"] else "-")
        same = _reference(records, r, r["mode"])
        vs_same = "-" if same is None or same is r else (
            f"{_ratio(r['count'], same['count'])}, {_ratio(r['wire_bytes'], same['wire_bytes'])}")
        base = "fsdp" if r["mode"].startswith("fsdp") else "dp"
        plain = _reference(records, r, base)
        vs_base = "-"
        if plain is not None and plain is not r:
            vs_base = _ratio(r["wire_bytes"], plain["wire_bytes"])
            if base == "fsdp":
                vs_base += " (" + _ratio(r["kinds"]["all-gather"]["wire_bytes"],
                                         plain["kinds"]["all-gather"]["wire_bytes"]) + ")"
        mode = r["mode"] if r["mode"] == r["mesh"] else f"{r['mode']} (`{r['mesh']}`)"
        lines.append(f"| {mode} | {r['config']} | {r['count']} ({r['small']}) | " + " | ".join(kinds)
                     + f" | {_fmt(r['wire_bytes'])} | {vs_same} | {vs_base} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.nanogpt.collective_budget",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=sorted(S.PRESETS))
    p.add_argument("--gpt", action="append", metavar="FIELD=VALUE", help="model overrides")
    p.add_argument("--configs", default="bf16,fp8", help="the plain reference first")
    p.add_argument("--meshes", default=",".join(MODES))
    p.add_argument("--devices", type=int, default=None, help="default: all")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default: one row per device)")
    p.add_argument("--out", default="runs/collectives")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    from experiments.nanogpt.cli import model_overrides

    overrides = model_overrides(a.gpt)
    mesh = PL.make_mesh(a.devices)
    records = []
    for config in [c.strip() for c in a.configs.split(",") if c.strip()]:
        for mode in [m.strip() for m in a.meshes.split(",") if m.strip()]:
            t0 = time.time()
            rec = measure(config, mode, mesh, a.model, a.batch_size, **overrides)
            records.append(rec)
            print(f"[collectives] {config} {rec['mesh']}: {rec['count']} collectives ({rec['small']} small), "
                  f"{_fmt(rec['wire_bytes'])} wire, {({k: v['count'] for k, v in rec['kinds'].items() if v['count']})} "
                  f"({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    meta = {"command": "python -m experiments.nanogpt.collective_budget " + " ".join(argv),
            "date": time.strftime("%Y-%m-%d"), "backend": jax.default_backend(),
            "device": str(jax.devices()[0].device_kind), "devices": mesh.size, "jax": jax.__version__,
            "python": platform.python_version(), "model": a.model, "model_overrides": overrides}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "results": records}
    (out / "collectives.json").write_text(json.dumps(doc, indent=1, default=str))
    table = markdown(records)
    (out / "collectives.md").write_text(
        f"# Collectives of the compiled NanoGPT step\n\n`{meta['command']}`\n\n{table}\n"
        f"{meta['devices']} x {meta['device']} ({meta['backend']}), jax {meta['jax']}, model `{a.model}` "
        f"{overrides or ''}, {meta['date']}. Counted from the compiled HLO (XLA:{meta['backend'].upper()}), "
        "not timed. Cells: number / ring bytes per device. Wire bytes: all-reduce 2(N-1)/N x operand, "
        "all-gather (N-1) x operand, reduce-scatter and all-to-all (N-1)/N x operand.\n")
    print(table)
    return doc


if __name__ == "__main__":
    main()
