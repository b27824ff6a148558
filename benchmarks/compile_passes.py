"""Where XLA's compile time of the Llama train step goes, by compiler pass, at several depths.

    PYTHONPATH=$PWD python -m benchmarks.compile_passes [--preset 1b] [--variants bf16,fp8-bf16]
        [--layers 4,8,16] [--out OUT]

For each variant (`benchmarks/stock_gpt.py`'s: ``bf16`` or a recipe name) and each depth L
of the Llama preset (its batch and sequence, `stock_gpt.LLAMA_SIZES`): the step is traced
and lowered from abstract values (nothing allocated), then compiled under the JAX
profiler. XLA records a host event per compiler pass and per kernel's code generation;
their durations are summed by name. A record holds the trace + lower and compile seconds
(wall clock), the optimized HLO's instruction count and the seconds of every event over
``--min-s`` (default 0.05 s). Events nest (``OptimizeHloModule`` holds the HLO passes) and
the kernels are compiled on several threads, so the sums are not parts of one total.

The table (``OUT/compile_passes.md``) gives, per variant and depth, the compile seconds,
the instructions and the passes of ``PASSES``; ``OUT/compile_passes.json`` every record.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import tempfile
import time

import jax

from benchmarks import llama_memory, stock_gpt
from experiments.nanogpt.kernel_profile import read_trace

# The events the table shows: the whole HLO optimization, the two GPU fusion passes, and
# the kernels' code generation (LLVM IR, then PTX to a cubin).
PASSES = ("OptimizeHloModule", "priority-fusion", "multi_output_fusion", "CompileModuleToLlvmIr", "PTX->CUBIN")


def host_events(fn) -> tuple[object, float, dict[str, float], dict[str, int]]:
    """(fn(), its wall seconds, seconds by event name, count by event name) of the
    profiler's host events of XLA while `fn` runs (Python frames, named ``$file:line``,
    left out)."""
    trace_dir = tempfile.mkdtemp(prefix="compile-passes-")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
    seconds, counts = collections.Counter(), collections.Counter()
    for e in read_trace(path):
        if e.get("ph") == "X" and not e["name"].startswith("$"):
            seconds[e["name"]] += e.get("dur", 0) / 1e6
            counts[e["name"]] += 1
    return out, wall, dict(seconds), dict(counts)


def measure(variant: str, preset: str, layers: int, attention, min_s: float = 0.05) -> dict:
    """The record of `variant` at `layers` layers (module doc)."""
    size = llama_memory._size(preset, layers)
    model, init, step, batch = llama_memory._parts(variant, size, attention)
    abstract = llama_memory._abstract_state(model, init, size, batch)
    t0 = time.perf_counter()
    lowered = step.trace(abstract, batch).lower()
    trace_lower = time.perf_counter() - t0
    compiled, wall, seconds, counts = host_events(lowered.compile)
    events = {k: {"s": round(v, 3), "n": counts[k]} for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])
              if v >= min_s}
    rec = {"variant": variant, "preset": preset, "layers": layers, "trace_lower_s": trace_lower, "compile_s": wall,
           "hlo_instructions": stock_gpt.hlo_instruction_count(compiled.as_text()), "events": events}
    print(f"[compile_passes] {variant} L={layers}: trace+lower {trace_lower:.1f} s, compile {wall:.1f} s, "
          f"HLO {rec['hlo_instructions']}; " + ", ".join(f"{k} {seconds.get(k, 0.0):.1f} s" for k in PASSES),
          flush=True)
    return rec


def markdown(records: list[dict], meta: dict) -> str:
    cols = " | ".join(f"{p} s" for p in PASSES)
    lines = [f"### Compile of the Llama `{meta['preset']}` step by pass ({meta['device_kind']}, jax {meta['jax']})", "",
             f"| variant | layers | trace+lower s | compile s | HLO instructions | {cols} |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(PASSES)]
    for r in records:
        ev = " | ".join(f"{r['events'].get(p, {}).get('s', 0.0):.2f}" for p in PASSES)
        lines.append(f"| {r['variant']} | {r['layers']} | {r['trace_lower_s']:.1f} | {r['compile_s']:.1f} | "
                     f"{r['hlo_instructions']:,} | {ev} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="1b", choices=sorted(stock_gpt.LLAMA_SIZES))
    p.add_argument("--variants", default="bf16,fp8-bf16")
    p.add_argument("--layers", default="4,8,16")
    p.add_argument("--min-s", type=float, default=0.05)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    dev = jax.devices()[0]
    attention = "cudnn" if dev.platform == "gpu" else None
    meta = {"preset": a.preset, "device_kind": dev.device_kind, "jax": jax.__version__}
    records = []
    for variant in a.variants.split(","):
        for layers in (int(n) for n in a.layers.split(",")):
            records.append(measure(variant, a.preset, layers, attention, a.min_s))
            if a.out:
                stock_gpt.write_records(a.out, "compile_passes", meta, records, markdown(records, meta))
    print(markdown(records, meta))
    return records


if __name__ == "__main__":
    main()
