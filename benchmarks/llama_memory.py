"""The deepest Llama at the 8B model's width that trains on one GPU, per variant.

    PYTHONPATH=$PWD python -m benchmarks.llama_memory [--recipes bf16,fp8-fp16-state] [--out OUT]

For each variant (`benchmarks/stock_gpt.py`'s: ``bf16``, a recipe name, ``NAME-head``),
the Llama `8b-shape` preset (d_model 4096, ffn 14336, 32/8 heads, vocabulary 128256) at
batch 2 x sequence 2048 with L layers:

1. XLA's memory of the compiled step (`memory_analysis()`: arguments + outputs - donated +
   temporaries) at ``--probe-layers`` (default 2 and 4) layers, without running it; every
   layer has the same parameters and activations, so two points give the line
   ``memory(L) = fixed + per_layer * L`` (an estimate: XLA's schedule of a deep program
   can hold more than it, which is why the depth is then trained);
2. the L that this line puts under the device's memory (`memory_stats()["bytes_limit"]`,
   what JAX's allocator may use);
3. that L, trained for real: the step compiled, its state made on the device in its storage
   formats one leaf at a time, as a checkpoint restore makes it (``init`` from float32
   parameters would hold a float32 copy of them beside the state), and ``--steps`` steps
   run (finite losses); if the device runs out of memory, L - 1, and so on (at most
   ``--tries`` times).

``--layers L`` skips steps 1 and 2 (a depth already predicted). ``--compiler-options
JSON`` adds XLA options to every compile (recorded in the JSON's meta), e.g.
``'{"xla_disable_hlo_passes": "multi_output_fusion"}'``; the memory is then that of the
program compiled with these options. The largest L that trained, its parameter count and XLA's memory are the variant's
row; ``vs bf16``: its parameters over bf16's. ``--preset tiny --limit-gb G`` runs the
same on a CPU (a smoke test). Each compile also records what holds its temporaries at
their peak (`peak`: `scalify.inspect.peak_temporaries`, rows of at least 1% of it); the
markdown shows those of each variant's deepest compiled step; ``--hlo-dir DIR`` saves each
compiled step's HLO text there (``VARIANT_LAYERS.hlo.gz``, what that replay reads). Writes
``OUT/llama_memory.json`` and ``OUT/llama_memory.md`` after the probes and after every attempt.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import scalify.inspect
from benchmarks import stock_gpt
from experiments.llama import model as llama

def _size(preset: str, layers: int) -> dict:
    """`stock_gpt.LLAMA_SIZES[preset]` (its batch and sequence) with `layers` layers."""
    row = stock_gpt.LLAMA_SIZES[preset]
    return stock_gpt._llama_size(preset, batch=row["batch"], seq=row["seq"], n_layers=layers)


def _parts(variant: str, size: dict, attention):
    """(model, init, jitted step, batch) of `variant` at `size`."""
    model = stock_gpt.build_model("llama", size, attention)
    loss_fn, tx = stock_gpt.make_loss_fn(model), stock_gpt.make_optimizer()
    if variant == "bf16":
        init, step = stock_gpt.plain_train_step(loss_fn, tx)
    else:
        train = stock_gpt.llama_train.recipe_of(variant).train_step(loss_fn, tx)
        init, step = train.init, train.step
    return model, init, step, stock_gpt._batch(size)


def _abstract_state(model, init, size: dict, batch):
    tokens = jax.ShapeDtypeStruct((size["batch"], size["seq"]), np.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    return jax.eval_shape(lambda v, b: init(v, batch=b), variables, batch)


def peak(compiled, share: float = 0.01) -> dict:
    """What holds the compiled step's temporaries at their peak (`scalify.inspect.
    peak_temporaries`): the peak's bytes, its instruction and the rows of at least `share`
    of it, as [source, type, count, bytes]."""
    p = scalify.inspect.peak_temporaries(compiled)
    rows = [list(r) for r in p.live if r[3] >= share * p.bytes]
    return {"bytes": p.bytes, "at": p.at, "live": rows}


def xla_memory(variant: str, size: dict, attention, options: dict | None = None,
               hlo_dir: str | None = None) -> tuple[int, dict]:
    """XLA's memory of the compiled step at `size`, from abstract values (nothing run), and
    what holds its temporaries at their peak (`peak`); `options`: XLA options of the
    compile; `hlo_dir`: where to save its HLO text (`stock_gpt.save_hlo`)."""
    model, init, step, batch = _parts(variant, size, attention)
    compiled = step.trace(_abstract_state(model, init, size, batch), batch).lower().compile(options)
    return _memory_of(compiled, variant, size, hlo_dir)


def _memory_of(compiled, variant: str, size: dict, hlo_dir: str | None) -> tuple[int, dict]:
    """(XLA's memory bytes, `peak`) of a compiled step, its HLO text saved in `hlo_dir`
    as ``VARIANT_LAYERS.hlo.gz``."""
    stock_gpt.save_hlo(compiled, hlo_dir, f"{variant}_{size['n_layers']}")
    return scalify.inspect.xla_memory(compiled).get("bytes"), peak(compiled)


def _materialize(abstract, seed: int = 0):
    """A state of `abstract`'s shapes and storage dtypes on the device, made one leaf at a
    time (as a checkpoint restores it): parameter matrices N(0, 0.02) and their other float
    leaves (norm weights, scales) 1; delayed statistics NaN (no record yet, as `init`
    leaves them); the rest (optimizer moments, counts) 0, scalar float leaves (the scales of
    scaled moments) 1."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    out = []
    for i, (path, leaf) in enumerate(leaves):
        top = jax.tree_util.keystr(path[:1])
        floating = np.issubdtype(leaf.dtype, np.floating)
        if top in (".params", "[0]") and floating and len(leaf.shape) >= 2:
            x = (0.02 * jax.random.normal(jax.random.key(seed + i), leaf.shape, np.float32)).astype(leaf.dtype)
        elif top == ".statistics":
            x = jnp.full(leaf.shape, np.nan, leaf.dtype)
        elif floating and (top in (".params", "[0]") or len(leaf.shape) == 0):
            x = jnp.ones(leaf.shape, leaf.dtype)
        else:
            x = jnp.zeros(leaf.shape, leaf.dtype)
        out.append(jax.block_until_ready(x))
    return jax.tree_util.tree_unflatten(treedef, out)


def trains(variant: str, size: dict, attention, steps: int, options: dict | None = None,
           hlo_dir: str | None = None) -> dict:
    """The step compiled (with the XLA `options`; its HLO text saved in `hlo_dir`) and run
    `steps` times at `size`, on a state made in its storage formats (`_materialize`); the
    record, or the error."""
    model, init, step, batch = _parts(variant, size, attention)
    cfg = llama.get_config(size["preset"], n_layers=size["n_layers"])
    out = {"layers": size["n_layers"], "parameters": llama.expected_param_count(cfg)}
    try:
        abstract = _abstract_state(model, init, size, batch)
        t0 = time.perf_counter()
        compiled = step.trace(abstract, batch).lower().compile(options)
        out["compile_s"] = time.perf_counter() - t0
        out["memory_bytes"], out["peak"] = _memory_of(compiled, variant, size, hlo_dir)
        state = _materialize(abstract)
        losses = []
        for _ in range(steps):
            state, metrics = compiled(state, batch)
            losses.append(float(metrics["loss"]))
        out.update(trained=bool(np.all(np.isfinite(losses))), losses=losses,
                   peak_bytes_in_use=stock_gpt._peak_bytes_in_use())
    except Exception as e:  # noqa: BLE001 - running out of memory is the answer sought
        out.update(trained=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    finally:
        state = compiled = None
        gc.collect()
        jax.clear_caches()
    return out


def deepest(variant: str, preset: str, attention, probe_layers, steps: int, tries: int, limit: int,
            on_progress=lambda rec: None, layers: int | None = None, options: dict | None = None,
            hlo_dir: str | None = None) -> dict:
    """The row of `variant` (module doc); `on_progress(record)` after the probes and after
    every attempt. `layers`: no probes, the first attempt at that depth. `options`: XLA
    options of every compile; `hlo_dir`: where to save each compiled step's HLO text."""
    rec = {"variant": variant, "attempts": []}
    if layers is None:
        l0, l1 = probe_layers
        (m0, _), (m1, deep) = (xla_memory(variant, _size(preset, n), attention, options, hlo_dir) for n in (l0, l1))
        per_layer = (m1 - m0) / (l1 - l0)
        fixed = m0 - per_layer * l0
        layers = int(math.floor((limit - fixed) / per_layer))
        rec.update(probe={str(l0): m0, str(l1): m1}, fixed_bytes=fixed, per_layer_bytes=per_layer,
                   predicted_layers=layers, probe_peak=dict(deep, layers=l1))
        print(f"[llama_memory] {variant}: {fixed / 1e9:.2f} GB + {per_layer / 1e9:.3f} GB/layer -> "
              f"{layers} layers predicted", flush=True)
    on_progress(rec)
    for _ in range(tries):
        attempt = trains(variant, _size(preset, layers), attention, steps, options, hlo_dir)
        rec["attempts"].append(attempt)
        on_progress(rec)
        print(f"[llama_memory] {variant} at {layers} layers: "
              f"{'trained' if attempt['trained'] else attempt.get('error', 'non-finite loss')}", flush=True)
        if attempt["trained"]:
            rec.update(layers=layers, parameters=attempt["parameters"], memory_bytes=attempt["memory_bytes"])
            break
        layers -= 1
    return rec


def markdown(records: list[dict], meta: dict) -> str:
    base = next((r for r in records if r["variant"] == "bf16" and "parameters" in r), None)
    lines = [f"### Deepest Llama `{meta['preset']}` (batch {meta['batch']} x seq {meta['seq']}) that trains, "
             f"{meta['device_kind']}, "
             f"jax {meta['jax']}, allocator limit {meta['bytes_limit'] / 1e9:.1f} GB", "",
             "| variant | GB fixed + GB per layer (XLA) | predicted layers | trained layers | parameters "
             "| vs bf16 | XLA memory GB |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in records:
        params = r.get("parameters")
        ratio = f"{params / base['parameters']:.2f}x" if params and base else "-"
        line = (f"{r['fixed_bytes'] / 1e9:.2f} + {r['per_layer_bytes'] / 1e9:.3f}" if "fixed_bytes" in r
                else "not probed")
        lines.append(f"| {r['variant']} | {line} | {r.get('predicted_layers', '-')} | {r.get('layers', 'none')} | "
                     f"{f'{params / 1e9:.2f}B' if params else '-'} | {ratio} | "
                     f"{r['memory_bytes'] / 1e9 if 'memory_bytes' in r else float('nan'):.1f} |")
    for r in records:  # what holds the temporaries at the deepest step compiled
        compiled = [(r["probe_peak"]["layers"], r["probe_peak"])] if "probe_peak" in r else []
        compiled += [(a["layers"], a["peak"]) for a in r["attempts"] if "peak" in a]
        if not compiled:
            continue
        layers, pk = max(compiled, key=lambda c: c[0])
        lines += ["", f"{r['variant']} at {layers} layers: temporaries at their peak {pk['bytes'] / 1e9:.2f} GB "
                      f"(at `{pk['at']}`), by the op that wrote them:", "",
                  "| source | type | buffers | GB |", "|---|---|---:|---:|"]
        lines += [f"| {src} | `{kind}` | {n} | {b / 1e9:.2f} |" for src, kind, n, b in pk["live"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="8b-shape", choices=list(stock_gpt.LLAMA_SIZES))
    p.add_argument("--recipes", default="bf16,fp8-fp16-state")
    p.add_argument("--limit-gb", type=float, default=None,
                   help="memory to fill, in 1e9 bytes (default: the device allocator's limit)")
    p.add_argument("--probe-layers", default="2,4")
    p.add_argument("--layers", type=int, default=None,
                   help="skip the probes: train at this depth (then one layer less on running out of memory)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tries", type=int, default=3)
    p.add_argument("--compiler-options", type=json.loads, default=None,
                   help='XLA options of every compile, as JSON: {"xla_disable_hlo_passes": "multi_output_fusion"}')
    p.add_argument("--out", default=None)
    p.add_argument("--hlo-dir", default=None,
                   help="save each compiled step's HLO text there, as VARIANT_LAYERS.hlo.gz")
    a = p.parse_args(argv)
    if a.compiler_options is not None and not isinstance(a.compiler_options, dict):
        raise SystemExit(f"--compiler-options takes a JSON object of XLA options, got {a.compiler_options!r}.")
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    limit = int(a.limit_gb * 1e9) if a.limit_gb else int(stats.get("bytes_limit", 0))
    if not limit:
        raise SystemExit(f"{dev.platform} reports no memory limit (memory_stats()['bytes_limit']): run on a GPU.")
    attention = "cudnn" if dev.platform == "gpu" else None
    row = stock_gpt.LLAMA_SIZES[a.preset]
    meta = {"device_kind": dev.device_kind, "jax": jax.__version__, "bytes_limit": limit, "preset": a.preset,
            "batch": row["batch"], "seq": row["seq"], "compiler_options": a.compiler_options}
    probe = tuple(int(x) for x in a.probe_layers.split(","))
    records = []
    def save(records):  # after the probes and after every attempt: a cut run keeps what it found
        if a.out:
            stock_gpt.write_records(a.out, "llama_memory", meta, records, markdown(records, meta))

    for v in (x.strip() for x in a.recipes.split(",") if x.strip()):
        records.append(deepest(v, a.preset, attention, probe, a.steps, a.tries, limit,
                               on_progress=lambda rec: save(records + [rec]), layers=a.layers,
                               options=a.compiler_options, hlo_dir=a.hlo_dir))
        save(records)
    print(markdown(records, meta))
    return records


if __name__ == "__main__":
    main()
