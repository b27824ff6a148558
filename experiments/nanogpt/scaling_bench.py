"""Multi-device scaling of the NanoGPT train step: steps/s, scaling efficiency, loss vs one
device, and bytes of gradient communication per step, per precision config and mesh mode.

On a GPU host (the reference measurement; every device count in one process, on the first N
devices)::

    PYTHONPATH=$PWD python -m experiments.nanogpt.scaling_bench --model small \\
        --configs bf16,fp8 --meshes dp,fsdp,dp:e5m2,dp:e5m2:auto:all_to_all,dp:float32 \\
        --devices 1,2,4 --batch-size 32 --out OUT

CPU smoke test (8 host devices; numbers meaningless)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.nanogpt.scaling_bench \\
        --model tiny --gpt n_layers=1,d_model=32,n_heads=2 --seq-len 16 --batch-size 8 \\
        --configs fp32 --meshes dp,dp:e5m2 --devices 1,2 --steps 2 --warmup 1 --loss-steps 2 \\
        --out /tmp/scaling

For each config, the one-device step (`--mesh none`) is the reference; for each device count
N > 1 and each mesh mode of `experiments/nanogpt/parallel.py`:

- ``step_ms``: the batch is placed on the devices and ``--steps`` calls are dispatched
  back to back with one ``block_until_ready`` at the end, after ``--warmup`` calls; the
  median over ``--repeats`` such runs of their time per step (what a training loop whose
  input pipeline runs ahead sees).
  ``steps_per_s``, ``tokens_per_s``; ``speedup`` = one-device
  step_ms / step_ms and ``efficiency`` = speedup / N (strong scaling: the global batch
  ``--batch-size`` is fixed; with ``--weak`` the batch per device is fixed and efficiency is
  tokens/s / (N x one-device tokens/s));
- ``loss_max_rel_diff``: the largest relative difference of the losses of ``--loss-steps``
  steps (same state, same random-token batches) to the one-device run (strong scaling only);
- ``comm``: the collectives of the compiled step (`scalify.inspect.collective_bytes`):
  operand bytes and per-device ring bytes ("wire"), by operation and dtype, counting only
  collectives of at least ``--comm-min-elements`` elements (leaves out the scalar reductions
  of losses, norms, scales and amaxes; they are reported apart as ``comm_small``);
- ``compile_s``, trace+lower time.

``--processes N`` runs the N-device steps with one process per device, as a multi-host job
runs (`jax.distributed`: each process launches the kernels of its own GPU; with one
process, one host thread launches every GPU's). The command starts N copies of itself on
this host (process i gets GPU i through ``CUDA_VISIBLE_DEVICES``; on CPU one device each,
collectives through gloo), each places its shards of the state and of the batch, and
process 0 writes the records (``processes: N``; the one-device reference is a run of its
own, without ``--processes``)::

    PYTHONPATH=$PWD python -m experiments.nanogpt.scaling_bench --model paper --configs bf16,fp8 \
        --meshes dp:bfloat16 --devices 4 --processes 4 --batch-size 32 --out OUT

Results are merged into ``OUT/scaling.json`` (one record per config, mesh and device count;
a record measured again replaces the old one, so the runs can be split over several calls)
and ``OUT/scaling.md`` is rewritten from all records after each measurement (a command
stopped by a timeout keeps what it measured), with the FP8-vs-FP32 gradient bytes.
``--compile-cache DIR`` keeps XLA's compilations between calls.
"""
from __future__ import annotations

import argparse
import gc
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
from experiments.nanogpt.model import param_count

__all__ = ["run_one", "main", "markdown", "merge"]


def _key(r: dict) -> tuple:
    return (r["config"], r["mesh"], int(r["devices"]), int(r.get("processes", 1)))


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """Records of `old` not measured again, then `new`."""
    keys = {_key(r) for r in new}
    return [r for r in old if _key(r) not in keys] + list(new)


def _comm(compiled, min_elements: int) -> tuple[dict, dict]:
    big = collective_bytes(compiled, min_elements=min_elements)
    every = collective_bytes(compiled)

    def summary(st):
        return {k: st[k] for k in ("count", "operand_bytes", "wire_bytes", "by_op", "by_dtype")}

    small = {"count": every["count"] - big["count"],
             "operand_bytes": every["operand_bytes"] - big["operand_bytes"],
             "wire_bytes": every["wire_bytes"] - big["wire_bytes"]}
    return summary(big), small


def run_one(config: str, mesh_spec: str, n_devices: int, a, batches) -> dict:
    """Measures one (config, mesh, device count); `batches` are (tokens, targets) arrays of
    the global batch."""
    recipe = C.get_recipe(config, **a.recipe_overrides)
    gpt = S.gpt_config(recipe, a.model, **a.model_overrides)
    tx = S.make_optimizer(recipe, S.OptimConfig(lr=a.lr, warmup_steps=max(1, a.loss_steps // 2),
                                                total_steps=1000))
    state = S.init_state(recipe, gpt, tx, seed=a.seed)
    par = PL.parse_mesh(mesh_spec if n_devices > 1 else "none")
    mesh = PL.make_mesh(n_devices) if par.mode != "none" else None
    out = {"config": config, "mesh": par.name if n_devices > 1 else "none", "devices": n_devices,
           "processes": jax.process_count(), "parameters": param_count(state.params),
           "batch_size": int(batches[0][0].shape[0]), "seq_len": gpt.seq_len}
    out["pack_scales"] = a.pack_scales
    packing = S.ScalePacking(state) if a.pack_scales else None
    step = PL.make_parallel_train_step(recipe, gpt, tx, mesh, par, state, seed=a.seed, donate=True,
                                       packing=packing)
    if packing is not None:
        state = PL.pack_state(packing, state, mesh, par.mode)
    elif mesh is not None:
        state = PL.shard_state(state, mesh, par.mode)
    x0, y0 = batches[0]
    if jax.process_count() > 1:  # host arrays with a sharding are refused: trace on shapes
        x0, y0 = (jax.ShapeDtypeStruct(v.shape, v.dtype) for v in (x0, y0))
    t0 = time.perf_counter()
    traced = step.trace(state, x0, y0)
    lowered = traced.lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    out["trace_lower_s"], out["compile_s"] = t1 - t0, t2 - t1
    out["comm"], out["comm_small"] = _comm(compiled, a.comm_min_elements)
    del traced, lowered
    if jax.process_count() > 1:  # global arrays from the host batches every process holds
        batches = [PL.place_batch(b, mesh) for b in batches]
        x0, y0 = batches[0]

    losses = []
    for x, y in batches[: a.loss_steps]:
        state, loss = compiled(state, x, y)
        losses.append(float(loss))
    # The batch on the devices first, then `--steps` calls dispatched back to back and one
    # wait at the end (a training loop with its input pipeline ahead of the step).
    x0, y0 = (jax.device_put(v, sh) for v, sh in zip((x0, y0), compiled.input_shardings[0][1:3]))
    for _ in range(a.warmup):
        state, loss = compiled(state, x0, y0)
    jax.block_until_ready((state, loss))
    timed = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        for _ in range(a.steps):
            state, loss = compiled(state, x0, y0)
        jax.block_until_ready((state, loss))
        timed.append((time.perf_counter() - t) / a.steps)
    out["losses"] = losses
    out["loss_finite"] = bool(np.all(np.isfinite(losses)))
    out["step_ms"] = 1e3 * float(np.median(timed))
    out["step_ms_all"] = [round(1e3 * s, 3) for s in timed]
    out["steps_per_s"] = 1e3 / out["step_ms"]
    out["tokens_per_s"] = out["batch_size"] * out["seq_len"] / (out["step_ms"] / 1e3)
    del state, compiled, step
    gc.collect()
    jax.clear_caches()
    return out


def _relate(records: list[dict], weak: bool) -> None:
    """Speed-up, efficiency and loss difference of each record vs its config's 1-device one."""
    ones = {r["config"]: r for r in records if r["devices"] == 1 and "step_ms" in r}
    for r in records:
        one = ones.get(r["config"])
        if one is None or "step_ms" not in r:
            continue
        n = r["devices"]
        if weak:
            r["efficiency"] = r["tokens_per_s"] / (n * one["tokens_per_s"])
            r["speedup"] = r["tokens_per_s"] / one["tokens_per_s"]
        else:
            r["speedup"] = one["step_ms"] / r["step_ms"]
            r["efficiency"] = r["speedup"] / n
            k = min(len(r["losses"]), len(one["losses"]))
            if k:
                a, b = np.asarray(r["losses"][:k]), np.asarray(one["losses"][:k])
                r["loss_max_rel_diff"] = float(np.max(np.abs(a - b) / np.abs(b)))


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _timing_text(meta: dict) -> str:
    return (f"pipelined steps (batch on the devices, {meta['steps']} calls back to back, one wait; "
            f"median of {meta.get('repeats', 1)} runs, after {meta['warmup']} warm-up calls)")


def markdown(records: list[dict], meta: dict) -> str:
    """The records as markdown: one table of speed and communication, one of FP8 vs FP32
    gradient bytes."""
    head = ("| config | mesh | devices | step (ms) | steps/s | speed-up | efficiency | tokens/s | "
            "loss max rel. diff vs 1 device | gradient comm. per step (ring bytes per device) | "
            "operand bytes by dtype | collectives | compile (s) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    order = sorted(records, key=lambda r: (r["config"], r["devices"] > 1, r["mesh"], r["devices"],
                                           r.get("processes", 1)))
    for r in order:
        procs = r.get("processes", 1)
        devices = f"{r['devices']} ({procs} processes)" if procs > 1 else f"{r['devices']}"
        if "error" in r:
            lines.append(f"| {r['config']} | {r['mesh']} | {devices} | error: "
                         f"{r['error'][:80]} |" + " |" * (head.count("|") - 5))
            continue
        comm = r["comm"]
        dtypes = ", ".join(f"{d} {_fmt_bytes(b)}" for d, b in sorted(comm["by_dtype"].items())) or "-"
        ops = ", ".join(f"{o}" for o in sorted(comm["by_op"])) or "-"
        loss = "-" if "loss_max_rel_diff" not in r else f"{r['loss_max_rel_diff']:.2e}"
        sp = "-" if "speedup" not in r else f"{r['speedup']:.2f}x"
        eff = "-" if "efficiency" not in r else f"{100 * r['efficiency']:.0f}%"
        lines.append(
            f"| {r['config']} | {r['mesh']} | {devices} | {r['step_ms']:.2f} | {r['steps_per_s']:.1f} | "
            f"{sp} | {eff} | {r['tokens_per_s']:,.0f} | {loss} | {_fmt_bytes(comm['wire_bytes'])} | "
            f"{dtypes} | {ops} | {r['compile_s']:.1f} |")
    # FP8 (and FP16) wire vs FP32 wire, same config and device count.
    rows = []
    for r in order:
        if r["devices"] == 1 or "comm" not in r:
            continue
        same = [q for q in records if q["config"] == r["config"] and q["devices"] == r["devices"]
                and q.get("processes", 1) == r.get("processes", 1) and "comm" in q]
        ref = next((q for m in ("dp:float32", "dp") for q in same if q["mesh"] == m), None)
        if ref is None or ref is r or not ref["comm"]["wire_bytes"]:
            continue
        rows.append(f"| {r['config']} | {r['devices']} | {r['mesh']} | {ref['mesh']} | "
                    f"{_fmt_bytes(r['comm']['wire_bytes'])} | {_fmt_bytes(ref['comm']['wire_bytes'])} | "
                    f"{r['comm']['wire_bytes'] / ref['comm']['wire_bytes']:.3f} |")
    text = "\n".join(lines) + "\n"
    if rows:
        text += ("\nCommunication per step vs a float32 gradient all-reduce of the same step "
                 "(`dp:float32`, else XLA's `dp`):\n\n| config | devices | mesh | reference | bytes | "
                 "reference bytes | ratio |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    scaling = "weak (batch per device fixed)" if meta.get("weak") else "strong (global batch fixed)"
    text += (f"\n{meta['device']} x {meta['device_count']} ({meta['backend']}), jax {meta['jax']}, model "
             f"`{meta['model']}`, global batch {meta['batch_size']} x seq {meta['seq_len']} at 1 device; "
             f"{scaling} scaling; {_timing_text(meta)}; "
             f"{'state scalars packed in one vector; ' if meta.get('pack_scales') else ''}"
             f"losses over {meta['loss_steps']} steps on random tokens. Communication: collectives of "
             f">= {meta['comm_min_elements']} elements in the compiled step (the gradient reductions in "
             "the dp modes; fsdp also gathers parameters); ring bytes per device = "
             "2(N-1)/N x operand for an all-reduce, (N-1)/N for reduce-scatter and all-to-all, "
             "(N-1) x operand for an all-gather.\n")
    return text


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.nanogpt.scaling_bench",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=sorted(S.PRESETS))
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=32, help="global batch (per device with --weak)")
    p.add_argument("--weak", action="store_true", help="fixed batch per device (weak scaling)")
    p.add_argument("--configs", default="bf16,fp8")
    p.add_argument("--meshes", default="dp,fsdp,dp:e5m2,dp:float32",
                   help="mesh modes for N > 1 (experiments/nanogpt/parallel.py)")
    p.add_argument("--devices", default=None, help="device counts, e.g. 1,2,4 (default: 1, 2, 4, ... "
                                                   "up to the available devices)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loss-steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--comm-min-elements", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpt", action="append", metavar="FIELD=VALUE", help="model overrides")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="recipe overrides (all configs)")
    p.add_argument("--compile-cache", default=None, help="persistent compilation cache directory")
    p.add_argument("--pack-scales", action="store_true",
                   help="pass the state's float32 scalars (scales) as one replicated vector "
                        "(step.ScalePacking) instead of one buffer each per device")
    p.add_argument("--out", default="runs/scaling")
    p.add_argument("--fresh", action="store_true", help="do not merge with OUT/scaling.json")
    p.add_argument("--processes", type=int, default=1,
                   help="run the --devices steps with one process per device on this host "
                        "(jax.distributed; see the module docstring)")
    p.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _launch(argv: list[str], a) -> dict:
    """Start `a.processes` copies of this command (`parallel.launch`) and wait for them;
    process 0 writes the records."""
    codes = PL.launch("experiments.nanogpt.scaling_bench", argv, a.processes)
    if any(codes):
        raise SystemExit(f"--processes {a.processes}: exit codes {codes}.")
    return json.loads((Path(a.out) / "scaling.json").read_text())


def _device_counts(spec, available: int) -> list[int]:
    if spec:
        counts = [int(s) for s in spec.split(",") if s.strip()]
    else:
        counts, n = [], 1
        while n <= available:
            counts.append(n)
            n *= 2
    bad = [n for n in counts if n > available or n < 1]
    if bad:
        raise SystemExit(f"--devices {spec}: {available} devices available.")
    return sorted(set(counts))


def _write_records(a, argv: list[str], gpt, results: list[dict], t_start: float) -> dict:
    """Merges `results` into OUT/scaling.json (records of earlier runs kept unless --fresh,
    the same key replaced) and rewrites OUT/scaling.md; returns the document. Called after
    each measurement, so a command stopped later (a timeout) keeps what it measured."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "scaling.json"
    # `results` holds every record of this run: with --fresh the file's are left out.
    old = [] if a.fresh or not path.exists() else json.loads(path.read_text())["results"]
    records = merge(old, results)
    _relate(records, a.weak)
    meta = {
        "command": "python -m experiments.nanogpt.scaling_bench " + " ".join(PL.user_args(argv)),
        "device": str(jax.devices()[0].device_kind), "device_count": jax.device_count(),
        "backend": jax.default_backend(), "jax": jax.__version__, "python": platform.python_version(),
        "model": a.model, "model_overrides": a.model_overrides, "recipe_overrides": a.recipe_overrides,
        "batch_size": a.batch_size, "seq_len": gpt.seq_len, "weak": a.weak, "steps": a.steps,
        "warmup": a.warmup, "timing": "pipelined", "repeats": a.repeats, "loss_steps": a.loss_steps,
        "comm_min_elements": a.comm_min_elements, "pack_scales": a.pack_scales,
        "processes": jax.process_count(), "wall_s": time.time() - t_start,
    }
    doc = {"meta": meta, "results": records}
    path.write_text(json.dumps(doc, indent=1, default=str))
    (out / "scaling.md").write_text(f"# NanoGPT multi-device scaling\n\n`{meta['command']}`\n\n"
                                    f"{markdown(records, meta)}")
    return doc


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    if a.processes > 1 and a.process_id is None:
        return _launch(argv, a)
    if a.process_id is not None:
        PL.init_process(a.coordinator, a.processes, a.process_id)
    from experiments.nanogpt.cli import model_overrides

    a.model_overrides = model_overrides(a.gpt)
    if a.seq_len is not None:
        a.model_overrides["seq_len"] = a.seq_len
    a.recipe_overrides = C.parse_overrides(a.set)
    if a.compile_cache:
        jax.config.update("jax_compilation_cache_dir", a.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    counts = _device_counts(a.devices, jax.device_count())
    if a.processes > 1 and counts != [jax.device_count()]:
        raise SystemExit(f"--processes {a.processes}: give --devices {jax.device_count()} "
                         "(one device per process; the one-device reference is a run of its own).")
    meshes = [m.strip() for m in a.meshes.split(",") if m.strip()]
    for m in meshes:
        PL.parse_mesh(m)  # fail early on a typo
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    gpt = S.gpt_config(C.get_recipe(configs[0]), a.model, **a.model_overrides)

    results = []
    t_start = time.time()
    for config in configs:
        for n in counts:
            batch = a.batch_size * (n if a.weak else 1)
            if batch % n:
                raise SystemExit(f"--batch-size {a.batch_size} is not a multiple of {n} devices.")
            # The same batches for every device count (strong scaling: the same losses).
            rng = np.random.default_rng((a.seed, batch))
            tokens = rng.integers(0, gpt.vocab_size, (max(a.loss_steps, 1), batch, gpt.seq_len + 1))
            batches = [(t[:, :-1].astype(np.int32), t[:, 1:].astype(np.int32)) for t in tokens]
            for mesh_spec in (meshes if n > 1 else ["none"]):
                t0 = time.time()
                try:
                    res = run_one(config, mesh_spec, n, a, batches)
                except Exception as e:  # noqa: BLE001 - one failure must not lose the others
                    res = {"config": config, "mesh": mesh_spec, "devices": n,
                           "error": f"{type(e).__name__}: {e}"}
                res["wall_s"] = time.time() - t0
                results.append(res)
                msg = res.get("error") or (
                    f"{res['step_ms']:.2f} ms/step, grad comm {_fmt_bytes(res['comm']['wire_bytes'])} "
                    f"{sorted(res['comm']['by_dtype'])}, losses {['%.4f' % l for l in res['losses'][:3]]}, "
                    f"compile {res['compile_s']:.1f} s")
                if jax.process_index() == 0:
                    print(f"[scaling] {config} {mesh_spec if n > 1 else 'none'} x{n}: {msg} "
                          f"({res['wall_s']:.0f} s)", file=sys.stderr, flush=True)
                    _write_records(a, argv, gpt, results, t_start)  # a later timeout keeps this one

    if jax.process_index() != 0:
        return {"meta": {}, "results": results}
    doc = _write_records(a, argv, gpt, results, t_start)
    print(markdown(doc["results"], doc["meta"]))
    return doc


if __name__ == "__main__":
    main()
