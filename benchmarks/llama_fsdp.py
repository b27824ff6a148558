"""FSDP scaling of the Llama example: plain bf16 against the scalify recipes, the state
sharded over 1, 2, 4 ... GPUs, one process per GPU.

    PYTHONPATH=$PWD python -m benchmarks.llama_fsdp --size 8b-shape --batch 4 --devices 1 --out OUT
    PYTHONPATH=$PWD python -m benchmarks.llama_fsdp --size 8b-shape --batch 4 --devices 2 --processes 2 --out OUT

The model, loss and optimizer are `benchmarks/stock_gpt.py`'s Llama (`--arch llama`):
bfloat16 compute, float32 parameters, cuDNN flash attention on GPU, global-norm clipping and
AdamW. The global batch (`--batch`, sequences of the preset's length) is fixed: strong
scaling. Every variant runs in the same process, one after the other:

- ``bf16``: the model as written, `jax.jit` of the plain step with FSDP shardings
  (`scalify.distributed.fsdp_shardings` of the parameters and the AdamW state: each array
  along its largest dimension divisible by the devices; the batch split along its first
  dimension): XLA all-gathers the parameters and reduce-scatters the gradients;
- a scalify recipe (``fp8``, ``fp8-fp16-state``, ``fp16``, ``NAME-head`` for `keep=()`):
  ``recipe.train_step(loss_fn, optimizer, fsdp=scalify.recipes.FSDP(mesh))`` (the same
  sharding: XLA partitions every parameter's use as in bf16, and gathers FP8 kernels after
  their cast to E4M3; with ``--gather e4m3``, ``FSDP(mesh, fp8_gather=True)``: every FP8
  kernel all-gathered as E4M3 words).

With ``--processes N`` the command starts N copies of itself on this host, process i on GPU
i (`experiments.nanogpt.parallel.launch`; `jax.distributed`), each placing its shards; the
one-device runs are a command of their own without it. Per variant and device count:
``step_ms`` (``--warmup`` steps, then ``--repeats`` windows of ``--steps`` steps dispatched
back to back, one wait; the median window), ``vs_bf16`` (bf16's step_ms at the same device
count / this one), ``speedup`` (this variant's one-device step_ms / this one, from an earlier
record in OUT) and ``efficiency`` (speedup / devices), trace+lower and compile seconds,
XLA's memory of the compiled step per device (arguments + outputs - aliased + temporaries),
the collectives of at least 1024 elements (`scalify.inspect.collective_bytes`: per-device
ring bytes, by dtype), the losses. Records are merged into OUT/llama_fsdp.json (a record
measured again replaces the old one) and OUT/llama_fsdp.md is rewritten after each.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import scalify.recipes
from scalify.distributed import fsdp_shardings, make_mesh
from scalify.inspect import collective_bytes, xla_memory
from benchmarks import stock_gpt as G
from experiments.llama import train as llama_train
from experiments.nanogpt import parallel as PL

__all__ = ["main", "markdown"]


def _plain_step(loss_fn, tx, mesh, abstract_state):
    """The bf16 baseline: (state shardings, jitted FSDP step)."""
    state_sh = fsdp_shardings(abstract_state, mesh)
    batch_sh = NamedSharding(mesh, P("data"))

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (jax.tree.map(jnp.add, params, updates), opt_state), {"loss": loss}

    return state_sh, jax.jit(step, in_shardings=(state_sh, (batch_sh, batch_sh)),
                             out_shardings=(state_sh, NamedSharding(mesh, P())), donate_argnums=(0,))


def _batch(size: dict, batch: int, mesh):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, size["vocab"], (batch, size["seq"] + 1)).astype(np.int32)
    sh = NamedSharding(mesh, P("data"))
    host = (tokens[:, :-1], tokens[:, 1:])
    return tuple(jax.make_array_from_callback(x.shape, sh, lambda idx, x=x: x[idx]) for x in host)


_START = time.perf_counter()


def _phase(variant: str, what: str) -> None:
    """A progress line on stderr (seconds since the start): where a long setup spends its time."""
    print(f"[llama_fsdp {time.perf_counter() - _START:7.1f} s] {variant}: {what}", file=sys.stderr, flush=True)


def bench(variant: str, size: dict, batch_size: int, mesh, impl, a) -> dict:
    """One variant's record on `mesh`."""
    model = G.build_model("llama", size, impl)
    loss_fn, tx = G.make_loss_fn(model), G.make_optimizer()
    tokens = jnp.zeros((1, size["seq"]), jnp.int32)
    init_params = lambda: model.init(jax.random.key(0), tokens)  # noqa: E731
    params_sh = fsdp_shardings(jax.eval_shape(init_params), mesh)
    params = jax.jit(init_params, out_shardings=params_sh)()  # float32, each device its shards
    batch = _batch(size, batch_size, mesh)
    if variant == "bf16":
        abstract = jax.eval_shape(lambda p: (p, tx.init(p)), params)
        state_sh, step = _plain_step(loss_fn, tx, mesh, abstract)
        state = jax.jit(lambda p: (p, tx.init(p)), out_shardings=state_sh)(params)
        sized = state
    else:
        fsdp = scalify.recipes.FSDP(mesh, fp8_gather=a.gather == "e4m3")
        train = llama_train.recipe_of(variant).train_step(loss_fn, tx, fsdp=fsdp)
        state = train.init(params)
        step = train.step
        _phase(variant, "state built")
        sized = step.sized(state, batch)
        _phase(variant, "delayed statistics sized")
    del params
    out = {"variant": variant if variant == "bf16" or a.gather == "xla" else f"{variant} (gather {a.gather})",
           "devices": mesh.size, "processes": jax.process_count(), "batch": batch_size}
    t0 = time.perf_counter()
    lowered = step.trace(sized, batch).lower()
    t1 = time.perf_counter()
    _phase(variant, f"traced and lowered in {t1 - t0:.1f} s")
    compiled = lowered.compile()
    _phase(variant, "compiled")
    out["trace_lower_s"], out["compile_s"] = t1 - t0, time.perf_counter() - t1
    comm = collective_bytes(compiled, min_elements=1024)
    out["comm"] = {k: comm[k] for k in ("count", "wire_bytes", "by_op", "by_dtype")}
    out["memory_bytes"] = xla_memory(compiled).get("bytes")
    del lowered
    losses = []
    for _ in range(a.warmup):
        state, metrics = compiled(state, batch)
        losses.append(metrics["loss"])
    jax.block_until_ready(state)
    _phase(variant, f"{a.warmup} warm-up steps run")
    windows = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        for _ in range(a.steps):
            state, metrics = compiled(state, batch)
            losses.append(metrics["loss"])
        jax.block_until_ready((state, metrics))
        windows.append(1e3 * (time.perf_counter() - t) / a.steps)
    losses = [float(x) for x in losses]
    out.update(step_ms=statistics.median(windows), step_ms_windows=windows, loss_first=losses[0],
               loss_final=losses[-1], loss_finite=bool(np.all(np.isfinite(losses))))
    del state, compiled, step
    gc.collect()
    jax.clear_caches()
    return out


def _key(r):
    return (r["variant"], r["devices"])


def _relate(records):
    ones = {r["variant"]: r for r in records if r["devices"] == 1}
    bf16 = {r["devices"]: r for r in records if r["variant"] == "bf16"}
    for r in records:
        one, base = ones.get(r["variant"].split(" (")[0]), bf16.get(r["devices"])
        r["speedup"] = one["step_ms"] / r["step_ms"] if one else None
        r["efficiency"] = r["speedup"] / r["devices"] if one else None
        r["vs_bf16"] = base["step_ms"] / r["step_ms"] if base else None


def _fmt_bytes(n) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def markdown(records, meta) -> str:
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    lines = [f"### Llama `{meta['size']}` FSDP ({meta['model']}), global batch {meta['batch']}, "
             f"{meta['device_kind']}, jax {meta['jax']}, median of {meta['repeats']} x {meta['steps']} steps "
             f"after {meta['warmup']} warm-up", "",
             "| variant | devices (processes) | step ms | vs bf16 | speed-up vs 1 device | efficiency | "
             "trace+lower s | compile s | memory GB per device | comm per device | by dtype | loss | finite |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in sorted(records, key=lambda r: (r["devices"], r["variant"] != "bf16", r["variant"])):
        dtypes = ", ".join(f"{d} {_fmt_bytes(b)}" for d, b in sorted(r["comm"]["by_dtype"].items())) or "-"
        mem = None if r["memory_bytes"] is None else r["memory_bytes"] / 1e9
        lines.append(f"| {r['variant']} | {r['devices']} ({r['processes']}) | {r['step_ms']:.2f} | "
                     f"{f(r['vs_bf16'], '.3f')} | {f(r['speedup'], '.2f')} | "
                     f"{f(None if r['efficiency'] is None else 100 * r['efficiency'], '.1f')}% | "
                     f"{r['trace_lower_s']:.1f} | {r['compile_s']:.1f} | {f(mem, '.2f')} | "
                     f"{_fmt_bytes(r['comm']['wire_bytes']) if r['comm']['count'] else '-'} | {dtypes} | "
                     f"{r['loss_final']:.4f} | {'yes' if r['loss_finite'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.llama_fsdp", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", choices=sorted(G.LLAMA_SIZES))
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the size's)")
    p.add_argument("--variants", default="bf16,fp8-head")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--gather", choices=("xla", "e4m3"), default="xla",
                   help="FP8 recipes: leave the partitioning of every parameter to XLA (default), or "
                        "all-gather every FP8 kernel as E4M3 words (FSDP(mesh, fp8_gather=True))")
    p.add_argument("--processes", type=int, default=1, help="one process per device (give --devices N)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--attention", default=None, help="default: cudnn on GPU, xla elsewhere")
    p.add_argument("--out", default="runs/llama_fsdp")
    p.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.processes > 1 and a.processes != a.devices:
        p.error("--processes N runs one device per process: give --devices N too")
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in a.variants:
        if v != "bf16":
            llama_train.recipe_of(v)  # fails early on a typo
    return a


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    if a.processes > 1 and a.process_id is None:
        codes = PL.launch("benchmarks.llama_fsdp", argv, a.processes)
        if any(codes):
            raise SystemExit(f"--processes {a.processes}: exit codes {codes}.")
        return
    if a.process_id is not None:
        PL.init_process(a.coordinator, a.processes, a.process_id)
    size = G.LLAMA_SIZES[a.size]
    batch = a.batch or size["batch"]
    mesh = make_mesh(a.devices)
    dev = jax.devices()[0]
    impl = a.attention or ("cudnn" if dev.platform == "gpu" else None)
    impl = None if impl == "xla" else impl
    meta = {"size": a.size, "model": ", ".join(f"{k} {v}" for k, v in size.items() if k != "batch"),
            "batch": batch, "device_kind": dev.device_kind, "jax": jax.__version__, "attention": impl or "xla",
            "warmup": a.warmup, "steps": a.steps, "repeats": a.repeats,
            "command": "python -m benchmarks.llama_fsdp " + " ".join(PL.user_args(argv))}
    out = Path(a.out)
    path = out / "llama_fsdp.json"
    for v in a.variants:
        r = bench(v, size, batch, mesh, impl, a)
        if jax.process_index() != 0:
            continue
        print(f"[llama_fsdp] {a.size} {v} x{mesh.size}: {r['step_ms']:.2f} ms, compile {r['compile_s']:.1f} s, "
              f"comm {_fmt_bytes(r['comm']['wire_bytes'])}, loss {r['loss_first']:.3f} -> {r['loss_final']:.3f}",
              flush=True)
        old = json.loads(path.read_text())["records"] if path.exists() else []
        records = [q for q in old if _key(q) != _key(r)] + [r]
        _relate(records)
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
        (out / "llama_fsdp.md").write_text(markdown(records, meta))
    if jax.process_index() == 0 and path.exists():
        print((out / "llama_fsdp.md").read_text())


if __name__ == "__main__":
    main()
