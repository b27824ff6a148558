"""Where XLA's compile time goes: the NanoGPT train step of each config compiled under
`jax.profiler.trace`, XLA's own host annotations (one per compiler pass, autotuner and
code-generation phase) summed by name.

    python benchmarks/compile_profile.py --model paper --configs bf16,fp8 --out OUT

Each config is lowered, then compiled once inside the trace, in this process, with no
persistent compilation cache (the point is what a first compile costs). Run one config per
process to keep an earlier config's autotuning results from shortening a later compile.
Prints and writes `OUT/compile_profile.md`: per config the wall time of `.compile()`, the
HLO instruction count of the compiled program, and the annotations with the most time
(nested annotations are each counted, so a parent's time includes its children's).

    python benchmarks/compile_profile.py --gemm-fusions DUMP.txt[.gz]

lists the GEMM fusions of an XLA:GPU HLO dump taken after the Triton GEMM rewriter
(`XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_pass_re=triton-gemm-rewriter"`), grouped by
their body with names stripped: each group is one autotuning problem for XLA.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.nanogpt import xla_flags  # noqa: E402

xla_flags.configure()

import jax  # noqa: E402

from experiments.nanogpt import configs as C  # noqa: E402
from experiments.nanogpt.kernel_profile import _read_trace, read_text  # noqa: E402
from experiments.nanogpt import step as S  # noqa: E402
from scalify.inspect import hlo_instruction_count  # noqa: E402


def _events(trace_dir: str) -> list[dict]:
    path, = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    return _read_trace(path)


def annotation_totals(events: list[dict]) -> dict[str, list[float]]:
    """{name: [total ms, count]} over the complete ("X") events of the trace."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            name = str(e.get("name", "?"))[:120]
            totals[name][0] += float(e["dur"]) / 1e3
            totals[name][1] += 1
    return dict(totals)


def profile_compile(config: str, model: str, batch_size: int, seq_len: int | None,
                    gpt: dict, plain: bool) -> dict:
    recipe = C.get_recipe(config)
    pair = S.abstract_step_pair(recipe, model, seq_len=seq_len, batch_size=batch_size,
                                **gpt)
    fn, args = (pair.plain(), pair.plain_args) if plain else (pair.scaled(), pair.args)
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t_lower = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            t0 = time.perf_counter()
            compiled = lowered.compile()
            t_compile = time.perf_counter() - t0
        totals = annotation_totals(_events(d))
    return dict(config=config, trace_lower_s=t_lower, compile_s=t_compile,
                hlo_instructions=hlo_instruction_count(compiled), annotations=totals)


def gemm_fusion_groups(hlo_text: str) -> list[tuple[int, str]]:
    """[(count, signature)] of the `gemm_fusion*` computations of `hlo_text`, one entry per
    distinct body (instruction names, metadata and parameter names stripped)."""
    comps = re.findall(r"^%(gemm_fusion[\w.]*_computation) \((.*?)\) -> (\S+) \{\n(.*?)\n\}",
                       hlo_text, re.S | re.M)
    groups: dict[str, int] = collections.Counter()
    for _, params, out, body in comps:
        body = re.sub(r", metadata=\{[^}]*\}", "", re.sub(r"%[\w.\-]+", "%x", body))
        params = re.sub(r"[\w.]+: ", "", params)
        groups[f"({params}) -> {out}\n{body}"] += 1
    return sorted(((n, k) for k, n in groups.items()), key=lambda t: -t[0])


def report(rows: list[dict], top: int) -> str:
    lines = []
    for r in rows:
        lines.append(f"## {r['config']}: compile {r['compile_s']:.1f} s, trace+lower "
                     f"{r['trace_lower_s']:.1f} s, {r['hlo_instructions']:,} HLO instructions\n")
        lines.append("| annotation | ms | count |\n|---|---|---|")
        items = sorted(r["annotations"].items(), key=lambda kv: -kv[1][0])[:top]
        lines += [f"| `{k}` | {v[0]:,.1f} | {v[1]} |" for k, v in items]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="paper", choices=sorted(S.PRESETS))
    p.add_argument("--configs", default="bf16,fp8")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--gpt", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", default=None)
    p.add_argument("--gemm-fusions", default=None, metavar="DUMP",
                   help="only list the distinct GEMM fusions of an HLO dump (see above)")
    a = p.parse_args(argv)
    if a.gemm_fusions:
        groups = gemm_fusion_groups(read_text(a.gemm_fusions))
        print(f"{sum(n for n, _ in groups)} GEMM fusions, {len(groups)} distinct\n")
        print("| fusions | array operands -> output | scalar operands | instructions | divisions |\n"
              "|---|---|---|---|---|")
        for n, k in groups:
            head, body = k.split("\n", 1)
            params, out = head[1:].split(") -> ")
            shapes = re.findall(r"\w+\[[\d,]*\]", params)
            arrays = [t for t in shapes if not t.endswith("[]")]
            print(f"| {n} | `{', '.join(arrays)} -> {out}` | {len(shapes) - len(arrays)} | "
                  f"{body.count(chr(10)) + 1} | {body.count(' divide(')} |")
        return
    gpt = {k: int(v) if v.isdigit() else v for k, v in (s.split("=", 1) for s in a.gpt)}
    rows = []
    for config in a.configs.split(","):
        plain = config.endswith(":plain")
        name = config.removesuffix(":plain")
        rows.append(profile_compile(name, a.model, a.batch_size, a.seq_len, gpt, plain))
        rows[-1]["config"] = config
        print(report(rows[-1:], a.top), flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        head = (f"# Compile profile, {jax.devices()[0].device_kind}, jax {jax.__version__}\n\n"
                f"`{' '.join(sys.argv)}`\n\nXLA_FLAGS=`{os.environ.get('XLA_FLAGS', '')}`\n\n")
        with open(os.path.join(a.out, "compile_profile.md"), "w") as f:
            f.write(head + report(rows, a.top))
        with open(os.path.join(a.out, "compile_profile.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
