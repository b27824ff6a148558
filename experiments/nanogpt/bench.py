"""Speed, memory and compile-time benchmark of the NanoGPT train step, per precision config.

On the GPU (the reference measurement)::

    PYTHONPATH=$PWD python -m experiments.nanogpt.bench --model paper --seq-len 512 \\
        --batch-size 16 --configs all --out OUT

CPU smoke test (seconds; numbers meaningless)::

    python -m experiments.nanogpt.bench --model tiny --gpt n_layers=1,d_model=32,n_heads=2 \\
        --seq-len 32 --batch-size 2 --steps 2 --warmup 1 --configs bf16,fp8 --out /tmp/bench

Per config, in this process and one after the other (so step times are comparable):

- ``trace_s`` / ``lower_s``: tracing and lowering of the jitted step (for scalify configs
  also of the same step without the transform, on plain arrays: ``plain_trace_lower_s``, and
  the ratio); ``compile_s``: XLA compilation;
- ``step_ms``: median of ``--steps`` timed steps after ``--warmup`` steps, each ended with
  ``block_until_ready``; ``speedup_vs_bf16 = bf16 step_ms / step_ms``; tokens/s;
  ``step_ms_pipelined``: ``--steps`` more steps dispatched back to back with one
  ``block_until_ready`` at the end, divided by their number (as a training loop that does
  not read the loss every step sees them: the host's dispatch overlaps the device's work);
- ``fp8_gemms``: number of ``__cublas$lt$matmul$f8`` custom calls in the compiled HLO;
- memory: XLA's ``memory_analysis()`` of the compiled step (arguments, outputs, temporaries:
  exact and per config), the live bytes of the state, and the device's
  ``peak_bytes_in_use`` (JAX cannot reset the peak: a running maximum over the configs).

The batch is random tokens (speed and memory do not depend on the data). Writes
``OUT/bench.json`` and ``OUT/bench.md`` (a markdown table), and prints the table.

Compiling the scalified step of the ``paper`` model takes minutes on the GPU host. To time
all configs in one process within a time limit, warm a persistent compilation cache in
several calls (a few configs each, same options, ``--compile-cache DIR`` in an ignored
folder that survives between calls, e.g. ``runs/jax_cache``), then run all configs once
more with the same cache: the compilations are cache hits (``compile_s`` then measures
loading, not compiling; the trace and lower times are measured as always).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import scalify
from scalify.inspect.hlo import XLA_MEMORY_FIELDS, xla_memory

from experiments.nanogpt import configs as C
from experiments.nanogpt import step as S
from experiments.nanogpt import xla_flags
from experiments.nanogpt.cli import model_overrides
from experiments.nanogpt.model import ATTENTIONS, PRESETS, GPTConfig, param_count

__all__ = ["bench_config", "main", "markdown_table", "BENCH_CONFIGS"]

# `--configs all`: the paper's five, the two baselines, and plain float32 (the reference of
# "scalify without low precision costs nothing").
BENCH_CONFIGS = C.ALL_CONFIGS + ("fp32-plain",)


@dataclasses.dataclass
class BenchArgs:
    model: str = "paper"
    seq_len: int | None = None
    batch_size: int = 16
    steps: int = 20
    warmup: int = 3
    seed: int = 0
    model_overrides: dict = dataclasses.field(default_factory=dict)
    recipe_overrides: dict = dataclasses.field(default_factory=dict)
    plain_trace: bool = True
    profile_steps: int = 0
    hlo_dir: str | None = None
    trace_dir: str | None = None
    pack_scales: bool = False


def _mib(n) -> float | None:
    return None if n is None else round(n / 2**20, 1)


def _memory_stats() -> dict:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - backends without stats
        stats = None
    return dict(stats) if stats else {}


def _tree_bytes(tree) -> int:
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


def _file_part(config: str) -> str:
    """A config name (variants hold ':' and '=') as part of a portable file name."""
    return re.sub(r"[^\w.\-]", "_", config)


def _timed_lowering(fn, *args) -> tuple[float, float, object]:
    t0 = time.perf_counter()
    traced = fn.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, lowered


def _inputs(name: str, args: BenchArgs):
    """(recipe, model config, optimizer, x, y): random tokens, speed and memory do not
    depend on the data."""
    recipe = C.get_recipe(name, **args.recipe_overrides)
    overrides = dict(args.model_overrides)
    if args.seq_len is not None:
        overrides["seq_len"] = args.seq_len
    gpt = S.gpt_config(recipe, args.model, **overrides)
    b, t = args.batch_size, gpt.seq_len
    tx = S.make_optimizer(recipe, S.OptimConfig(lr=1e-4, warmup_steps=10, total_steps=1000))
    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(0, gpt.vocab_size, (b, t + 1)).astype(np.int32)
    return recipe, gpt, tx, jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])


def _init_state(recipe, gpt, tx, seed: int) -> tuple[object, dict]:
    """The train state and its sizes: parameters, bytes, and the device bytes it holds."""
    mem0 = _memory_stats().get("bytes_in_use")
    state = S.init_state(recipe, gpt, tx, seed=seed)
    jax.block_until_ready(state)
    facts = {
        "parameters": param_count(state.params),
        "state_bytes": _tree_bytes(state),
        "param_bytes": _tree_bytes(state.params),
        "opt_state_bytes": _tree_bytes(state.opt_state),
    }
    mem1 = _memory_stats().get("bytes_in_use")
    if mem0 is not None and mem1 is not None:
        facts["state_live_bytes"] = int(mem1 - mem0)
    return state, facts


def _compile(raw_step, state, x, y, options: dict) -> tuple[object, dict]:
    """The step jitted (state donated, XLA `options`), traced, lowered and compiled, with
    the three times."""
    step = jax.jit(raw_step, donate_argnums=(0,), compiler_options=options)
    times = {}
    times["trace_s"], times["lower_s"], lowered = _timed_lowering(step, state, x, y)
    times["trace_lower_s"] = times["trace_s"] + times["lower_s"]
    t0 = time.perf_counter()
    compiled = lowered.compile()
    times["compile_s"] = time.perf_counter() - t0
    return compiled, times


def bench_config(name: str, args: BenchArgs) -> dict:
    """Measures one config (see the module docstring); returns a JSON-able dict."""
    recipe, gpt, tx, x, y = _inputs(name, args)
    state, facts = _init_state(recipe, gpt, tx, args.seed)
    out = {"config": name, "paper": recipe.paper, "description": recipe.description,
           "attention": gpt.attention_name(), **facts}
    raw_step = S.make_train_step(recipe, gpt, tx, jit=False)
    packing = None
    if args.pack_scales:  # float32 scalars of the state in one vector (step.ScalePacking)
        packing = S.ScalePacking(state)
        raw_step = packing.step(raw_step)
        state = packing.pack(state)
    out["pack_scales"] = args.pack_scales
    options = S.compiler_options(recipe)
    out["compiler_options"] = options
    compiled, times = _compile(raw_step, state, x, y, options)
    out.update(times)
    from scalify.inspect import count_fp8_gemms

    hlo = compiled.as_text()
    _write_hlo(hlo, name, args.hlo_dir)
    out["fp8_gemms"] = count_fp8_gemms(hlo)
    out["hlo_ops"] = sum(1 for line in hlo.splitlines() if " = " in line)
    out.update(_xla_memory(compiled))
    if recipe.scalify and args.plain_trace:
        out.update(_plain_trace_lower(recipe, gpt, tx, packing.unpack(state) if packing else state,
                                      x, y, out["trace_lower_s"]))
    state, timing = _time_steps(compiled, state, x, y, args)
    out.update(timing)
    if args.profile_steps:
        from experiments.nanogpt.kernel_profile import profile_train_steps

        trace_dir = str(Path(args.trace_dir) / f"trace_{_file_part(name)}") if args.trace_dir else None
        out["profile"], state = profile_train_steps(compiled, state, x, y, args.profile_steps, hlo,
                                                    trace_dir)
    del state, compiled
    gc.collect()
    jax.clear_caches()
    return out


def _write_hlo(hlo: str, name: str, hlo_dir: str | None) -> None:
    if hlo_dir:
        import gzip

        Path(hlo_dir).mkdir(parents=True, exist_ok=True)
        with gzip.open(Path(hlo_dir) / f"hlo_{_file_part(name)}.txt.gz", "wt") as f:
            f.write(hlo)


def _xla_memory(compiled) -> dict:
    """XLA's memory analysis of the compiled step (`scalify.inspect.xla_memory`); peak
    estimate = arguments + outputs - aliased + temporaries."""
    m = xla_memory(compiled)
    if "unavailable" in m:
        return {"xla_memory": f"unavailable: {m['unavailable']}"}
    return {"xla_memory": {k: m[k] for k in XLA_MEMORY_FIELDS}, "xla_peak_estimate_bytes": m["bytes"]}


def _plain_trace_lower(recipe, gpt, tx, state, x, y, trace_lower_s: float) -> dict:
    """Trace + lower time of the same step without scalify, on the plain state, and the
    ratio ``scalified / plain``."""
    plain = jax.jit(S.make_train_step(recipe, gpt, tx, use_scalify=False, jit=False))
    pt, pl, _ = _timed_lowering(plain, S.plain_state(state), x, y)
    return {"plain_trace_lower_s": pt + pl, "trace_lower_ratio": trace_lower_s / (pt + pl)}


def _synced_steps(compiled, state, x, y, n_steps: int) -> tuple[object, list[float], list[float]]:
    """`n_steps` steps, each ended with ``block_until_ready``: (state, times in s, losses)."""
    times, losses = [], []
    for _ in range(n_steps):
        t0 = time.perf_counter()
        state, loss = compiled(state, x, y)
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return state, times, losses


def _pipelined_ms(compiled, state, x, y, n_steps: int) -> tuple[object, float]:
    """`n_steps` steps dispatched back to back, one sync at the end: (state, ms per step)."""
    t0 = time.perf_counter()
    for _ in range(n_steps):
        state, loss = compiled(state, x, y)
    jax.block_until_ready((state, loss))
    return state, 1e3 * (time.perf_counter() - t0) / n_steps


def _time_steps(compiled, state, x, y, args: BenchArgs) -> tuple[object, dict]:
    """Step times: the median of the synced steps after the warm-up, the pipelined step
    time, tokens/s; the losses; the device's peak memory."""
    state, times, losses = _synced_steps(compiled, state, x, y, args.warmup + args.steps)
    timed = times[args.warmup:]
    out = {}  # the same steps dispatched back to back, one sync at the end
    state, out["step_ms_pipelined"] = _pipelined_ms(compiled, state, x, y, args.steps)
    out["step_ms"] = 1e3 * float(np.median(timed))
    out["step_ms_min"] = 1e3 * float(np.min(timed))
    out["step_ms_all"] = [round(1e3 * s, 3) for s in timed]
    out["tokens_per_s"] = x.size / (out["step_ms"] / 1e3)
    out["losses"] = losses
    out["loss_finite"] = bool(np.all(np.isfinite(losses)))
    stats = _memory_stats()
    if stats:
        out["peak_bytes_in_use"] = int(stats.get("peak_bytes_in_use", 0))
    return state, out


def _bf16(results: list[dict], key: str):
    """`key` of the bf16 result (the reference of the speed-ups), or None."""
    return next((r[key] for r in results if r.get("config") == "bf16" and key in r), None)


def markdown_table(results: list[dict], meta: dict) -> str:
    """The results as a markdown table (times in ms and s, memory in MiB)."""
    bf16, bf16_pipe = _bf16(results, "step_ms"), _bf16(results, "step_ms_pipelined")
    head = ("| config | paper | attention | step (ms) | speed-up vs bf16 | pipelined step (ms) | speed-up | tokens/s | trace+lower (s) | plain "
            "trace+lower (s) | ratio | compile (s) | peak memory (MiB) | XLA args+temp (MiB) | "
            "state (MiB) | FP8 GEMMs | loss finite |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | {r.get('paper') or '-'} | {r.get('attention', '-')} | "
                         "error (see bench.json) |" + " |" * (head.count("|") - 5))
            continue
        speed = f"{bf16 / r['step_ms']:.2f}x" if bf16 else "-"
        peak = r.get("peak_bytes_in_use")
        peak_s = "-" if peak is None else f"{_mib(peak)} (running max)"
        if "plain_trace_lower_s" in r:
            plain = f"{r['plain_trace_lower_s']:.2f} | {r['trace_lower_ratio']:.2f}x"
        else:
            plain = "- | -"
        xla = r.get("xla_peak_estimate_bytes")
        pipe = r.get("step_ms_pipelined")
        pipe_s = "- | -" if pipe is None else (
            f"{pipe:.2f} | " + (f"{bf16_pipe / pipe:.2f}x" if bf16_pipe else "-"))
        lines.append(
            f"| {r['config']} | {r.get('paper') or '-'} | {r.get('attention', '-')} | {r['step_ms']:.2f} | {speed} | {pipe_s} | "
            f"{r['tokens_per_s']:,.0f} | {r['trace_lower_s']:.2f} | {plain} | {r['compile_s']:.1f} | "
            f"{peak_s} | {'-' if xla is None else _mib(xla)} | {_mib(r['state_bytes'])} | "
            f"{r.get('fp8_gemms', '-')} | {r['loss_finite']} |")
    info = (f"\n{meta['device']} ({meta['backend']}), jax {meta['jax']}, model `{meta['model']}` "
            f"({meta['parameters']:,} parameters), batch {meta['batch_size']} x seq {meta['seq_len']}, "
            f"median of {meta['steps']} steps after {meta['warmup']} warm-up steps; "
            f"XLA_FLAGS `{meta.get('xla_flags') or ''}`; scalified steps compiled with "
            f"`{scalify.compiler_options()}` (scalify.compiler_options).\n")
    return "\n".join(lines) + "\n" + info


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.nanogpt.bench",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="paper", choices=sorted(S.PRESETS))
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    p.add_argument("--configs", default="all",
                   help=f"comma-separated names, or 'all' ({', '.join(BENCH_CONFIGS)})")
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpt", action="append", metavar="FIELD=VALUE", help="model overrides")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="recipe overrides (all configs)")
    p.add_argument("--attention", choices=ATTENTIONS, default=None,
                   help="attention of every config (model field `attention`; default: each recipe's, "
                        "else auto = cuDNN flash attention on a GPU for 16-bit models, else softmax); "
                        "per config: NAME:attention=VALUE, e.g. bf16:attention=softmax")
    # every config runs in this process; the recorded commands of results/ name the option
    p.add_argument("--isolate", choices=["none"], default="none", help=argparse.SUPPRESS)
    p.add_argument("--no-plain-trace", dest="plain_trace", action="store_false",
                   help="skip tracing the un-scalified step")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile N steps and write OUT/profile.md: device time per "
                        "kernel category and HLO op, and the device's idle gaps "
                        "(experiments/nanogpt/kernel_profile.py); the raw Perfetto trace is "
                        "kept under OUT/trace_CONFIG/ (CONFIG with ':' and '=' as '_')")
    p.add_argument("--pack-scales", action="store_true",
                   help="pass the state's float32 scalars (scales) as one vector (step.ScalePacking)")
    p.add_argument("--dump-hlo", action="store_true",
                   help="write each config's optimized HLO to OUT/hlo_CONFIG.txt.gz (CONFIG with ':' "
                        "and '=' as '_')")
    p.add_argument("--compile-cache", default=None, help="persistent compilation cache directory")
    p.add_argument("--xla-excess-precision", action="store_true",
                   help="leave XLA's default --xla_allow_excess_precision=true (by default the "
                        "example turns it off for every config: experiments/nanogpt/xla_flags.py)")
    return p.parse_args(argv)


def _expand(spec: str) -> list[str]:
    names = []
    for part in spec.split(","):
        part = part.strip()
        group = {"all": BENCH_CONFIGS, "paper": C.PAPER_CONFIGS}.get(part, (part,))
        for n in group:
            try:
                C.get_recipe(n)
            except ValueError as e:
                raise SystemExit(f"{e} Configs: {', '.join(C.RECIPES)}, all, paper; a variant "
                                 "is NAME:FIELD=VALUE (e.g. fp8:kernel_layout=in_out).") from e
            if n not in names:
                names.append(n)
    return names


def _enable_cache(path: str) -> None:
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _bench_args(a) -> BenchArgs:
    return BenchArgs(model=a.model, seq_len=a.seq_len, batch_size=a.batch_size, steps=a.steps,
                     warmup=a.warmup, seed=a.seed,
                     model_overrides=model_overrides(a.gpt, attention=a.attention),
                     recipe_overrides=C.parse_overrides(a.set), plain_trace=a.plain_trace,
                     profile_steps=a.profile, hlo_dir=a.out if a.dump_hlo else None,
                     trace_dir=a.out if a.profile else None,
                     pack_scales=a.pack_scales)


def _measure(names: list[str], bargs: BenchArgs) -> list[dict]:
    """`bench_config` of every config, one after the other."""
    results = []
    for name in names:
        t0 = time.time()
        try:
            res = bench_config(name, bargs)
        except Exception as e:  # noqa: BLE001 - one failing config must not lose the others
            res = {"config": name, "error": f"{type(e).__name__}: {e}"}
        res["wall_s"] = time.time() - t0
        results.append(res)
        msg = res.get("error") or (f"{res['step_ms']:.2f} ms/step, trace+lower {res['trace_lower_s']:.2f} s, "
                                    f"compile {res['compile_s']:.1f} s, fp8 gemms {res.get('fp8_gemms')}")
        print(f"[bench] {name}: {msg} ({res['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    return results


def _seq_len(model: str, model_overrides: dict, seq_len: int | None) -> int:
    """The sequence length of the benchmarked model: ``--seq-len``, else a ``--gpt`` override,
    else the preset's. Read without building a `GPTConfig`: the model overrides of a run
    (e.g. ``attention=cudnn``) need not be valid for every dtype (a float32 model has no
    cuDNN attention)."""
    if seq_len:
        return seq_len
    return model_overrides.get("seq_len", PRESETS[model].get("seq_len", GPTConfig.seq_len))


def _meta(a, argv: list[str], bargs: BenchArgs, results: list[dict], wall_s: float) -> dict:
    first = next((r for r in results if "parameters" in r), {})
    return {
        "command": "python -m experiments.nanogpt.bench " + " ".join(argv),
        "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
        "jax": jax.__version__, "python": platform.python_version(), "model": a.model,
        "parameters": first.get("parameters", 0), "batch_size": a.batch_size,
        "seq_len": _seq_len(a.model, bargs.model_overrides, a.seq_len),
        "steps": a.steps, "warmup": a.warmup, "total_wall_s": wall_s,
        "model_overrides": bargs.model_overrides, "recipe_overrides": bargs.recipe_overrides,
        "compile_cache": a.compile_cache, "pack_scales": a.pack_scales,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def _write_outputs(out: Path, doc: dict) -> None:
    """OUT/bench.json, OUT/bench.md (printed) and, with --profile, OUT/profile.md."""
    meta, results = doc["meta"], doc["results"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(doc, indent=1, default=str))
    table = markdown_table(results, meta)
    (out / "bench.md").write_text(f"# NanoGPT step benchmark\n\n`{meta['command']}`\n\n{table}")
    print(table)
    profiles = [r for r in results if "profile" in r]
    if profiles:
        from experiments.nanogpt.kernel_profile import markdown_profile

        text = "".join(markdown_profile(r["config"], r["profile"], r["step_ms"]) + "\n"
                       for r in profiles)
        (out / "profile.md").write_text(f"# Device time per kernel\n\n`{meta['command']}`\n\n{text}")


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    xla_flags.configure(a.xla_excess_precision)  # before JAX starts
    bargs = _bench_args(a)
    if a.compile_cache:
        _enable_cache(a.compile_cache)
    t_start = time.time()
    results = _measure(_expand(a.configs), bargs)
    doc = {"meta": _meta(a, argv, bargs, results, time.time() - t_start), "results": results}
    bf16 = _bf16(results, "step_ms")
    for r in results:
        if bf16 and "step_ms" in r:
            r["speedup_vs_bf16"] = bf16 / r["step_ms"]
    _write_outputs(Path(a.out), doc)
    return doc


if __name__ == "__main__":
    main()
