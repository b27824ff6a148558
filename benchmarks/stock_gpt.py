"""Benchmark of a stock Flax GPT, or of the Llama example: plain bf16, Flax's FP8 ops and
the scalify recipes.

    PYTHONPATH=$PWD python -m benchmarks.stock_gpt --size d1024 --out OUT \\
        [--recipes bf16,flax-fp8,fp16,fp8,fp8-fp16-state] [--warmup 5 --steps 20 --repeats 3]
    PYTHONPATH=$PWD python -m benchmarks.stock_gpt --arch llama --size 1b --out OUT \\
        [--profile 2] [--hlo-dir DIR]   (kernels per step; each variant's compiled HLO text)

The model is written as a Flax user writes a GPT (not `experiments/nanogpt`): pre-LayerNorm
blocks, a fused qkv `nn.Dense`, `jax.nn.dot_product_attention(is_causal=True)` (cuDNN on
GPU, XLA elsewhere), a 4x GELU MLP, learned positions, the output head tied to the token
`nn.Embed` (`attend`), `dtype=bfloat16` compute and float32 parameters; loss: mean softmax
cross-entropy of the float32 logits; optimizer: global-norm clipping at 1.0, then
`optax.adamw(3e-4, weight_decay=0.1)`. The batch is random tokens from a fixed key, the same
batch every step (a step that trains lowers its loss). ``XLA_FLAGS`` are the user's; the
recipes' steps compile with `scalify.compiler_options()`, the plain ones with XLA's defaults.

``--arch llama`` runs the same variants, loss function and optimizer on the Llama-3-style
decoder of `experiments/llama/model.py` (RMSNorm, rotary embeddings, grouped-query
`jax.nn.dot_product_attention`, SwiGLU, untied ``lm_head``; ``dtype=bfloat16``, float32
parameters), sizes ``tiny`` (its preset, batch 2 x seq 32), ``1b`` (batch 4 x seq 2048) and
``8b-shape`` (the 8B model's width, 4 layers, batch 2 x seq 2048; ``--batch`` sets another). The batches are sized
for one H200 (141 GB): float32 weights, gradients and AdamW moments take 16 bytes a
parameter, 24 GB for ``1b`` (1.50B parameters) and 31 GB for ``8b-shape`` (1.92B), and the
rest holds the activations and the 128256-wide logits. ``flax-fp8`` sets the Llama
config's ``dot_general_cls`` (every ``nn.Dense``, the head included, as in the GPT).

Variants (rows), all in this process one after the other, so the times are side by side:

- ``bf16``: the model as written, a plain `jax.jit` step (state donated, XLA's defaults);
- ``flax-fp8``: the same step with `dot_general_cls=nn.Fp8DirectDotGeneralOp` in every
  `nn.Dense` (Flax's delayed-scaling FP8 ops); their amax histories and scales, in the
  ``_overwrite_with_gradient`` collection, are replaced by their gradient as Flax's
  `TrainState.apply_gradients` does; the optimizer sees only ``params``;
- ``fp16``, ``fp8``, ``fp8-fp16-state`` (any of `scalify.recipes.RECIPES`):
  ``scalify.recipes.get(name).train_step(loss_fn, optimizer)``, the same loss function
  and optimizer, the float32 parameters given to ``init``; the model keeps
  ``dtype=bfloat16`` (the recipe overrides it during the step); the step is jitted as the
  API jits it (state donated, `scalify.compiler_options()`);
- ``NAME-head`` (``fp8-head``, ``fp8-fp16-state-head``): recipe NAME with ``keep=()``
  (`experiments.llama.train.recipe_of`), the output head in the recipe's formats too (FP8
  for the FP8 recipes), as Flax's FP8 ops run it; a head tied to the embedding (the GPT's)
  keeps the model's precision anyway.

Columns (per variant):

- ``step ms``: ``--warmup`` steps, then ``--repeats`` windows of ``--steps`` steps each
  dispatched back to back with one ``block_until_ready`` at the end; the median over the
  windows of (window time / ``--steps``);
- ``vs bf16``: bf16's step ms / this step ms (above 1: faster than bf16);
- ``trace+lower s``: ``jitted.trace(state, batch).lower()`` of the state from ``init``
  (for a recipe, that includes sizing its delayed statistics: one abstract trace of the
  step; the compiled step measures them on its first call, a warm-up step);
  ``compile s``: ``lowered.compile()`` (XLA, autotuning
  included); ``compile vs bf16``: this variant's compile s / bf16's (the JSON also has
  ``trace_lower_compile_vs_bf16``, of their sums);
- ``HLO instr``: instructions of the compiled program, fused computations included
  (`scalify.inspect.hlo.hlo_instruction_count`); ``FP8 GEMMs``: cuBLASLt FP8 calls and
  GEMM fusions of two FP8 operands (`count_fp8_gemms`; 0 on CPU, which has no FP8 GEMMs);
- ``memory GB``: XLA's `memory_analysis()` of the compiled step: arguments + outputs -
  aliased (donated) + temporaries, in 1e9 bytes (per variant, with no fresh process); the
  device's ``peak_bytes_in_use`` is recorded too, a running maximum over the variants run
  so far (JAX cannot reset it);
- ``loss``: the loss of the last timed step; ``finite``: every step's loss is finite.

``--profile N``: N more steps of each variant under the JAX profiler; the record gets the
kernels per step and the device time per kernel category (FP8 GEMMs, other GEMMs,
reductions, scalar kernels, elementwise, copies: `experiments.nanogpt.kernel_profile`), and
``OUT/profile_<variant>.md`` the top kernels.

With ``--profile``, the markdown also sums each variant's kernels that are not GEMMs by the
part of the model they come from (`model_part` of their source label: norms, MLP, attention
projections, attention and residual adds, loss, embeddings, optimizer update, kernels with
no op name), in ms per step.

``busy vs bf16`` (with ``--profile``): bf16's device time per step (the sum of its kernels'
durations in the profiled steps) over this variant's: the ratio of the kernels alone,
which the host's dispatch and the gaps between steps do not move (``vs bf16`` is the
ratio a training loop sees).

``FP8 bound`` (with ``--profile``, for a variant with FP8 GEMMs): the zero-overhead bound of
`benchmarks/fp8_speedup_bound.py` against bf16, from the two profiles: bf16's device-busy
time over itself less what the variant's FP8 GEMMs save on the GEMMs they replace, every
other kernel as fast as bf16's (Amdahl); ``vs bf16`` over it says how close the step comes.

Writes ``OUT/stock_ARCH.json`` (all records, the arguments, JAX version, device kind) and
``OUT/stock_ARCH.md`` (the table; ARCH is ``gpt`` or ``llama``) after every variant, and
prints the table at the end. CPU smoke test (a few minutes for the five variants; numbers
meaningless): ``--size tiny --warmup 1 --steps 2 --repeats 1``.
"""
from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

import scalify.recipes
from experiments.llama import model as llama
from experiments.llama import train as llama_train
from benchmarks.fp8_speedup_bound import zero_overhead
from scalify.inspect.hlo import XLA_MEMORY_FIELDS, count_fp8_gemms, hlo_instruction_count, xla_memory

SIZES = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, batch=2, seq=32, vocab=256),
    "d1024": dict(d_model=1024, n_layers=8, n_heads=16, batch=16, seq=512, vocab=50304),
    "d2048": dict(d_model=2048, n_layers=8, n_heads=16, batch=8, seq=512, vocab=50304),
    "d4096": dict(d_model=4096, n_layers=4, n_heads=32, batch=8, seq=512, vocab=50304),
}


def _llama_size(preset: str, batch: int, seq: int, **overrides) -> dict:
    cfg = llama.get_config(preset, **overrides)
    return dict(preset=preset, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                n_kv_heads=cfg.n_kv_heads, ffn_dim=cfg.ffn_dim, batch=batch, seq=seq, vocab=cfg.vocab_size)


LLAMA_SIZES = {
    "tiny": _llama_size("tiny", batch=2, seq=32),
    "1b": _llama_size("1b", batch=4, seq=2048),
    "8b-shape": _llama_size("8b-shape", batch=2, seq=2048, n_layers=4),
}
ARCHS = {"gpt": SIZES, "llama": LLAMA_SIZES}
TITLES = {"gpt": "stock GPT", "llama": "Llama"}
PLAIN = ("bf16", "flax-fp8")
VARIANTS = PLAIN + ("fp16", "fp8", "fp8-fp16-state")


# ------------------------------------------------------------------------ the model
class Block(nn.Module):
    n_heads: int
    dtype: Any = jnp.bfloat16
    dot_general_cls: Any = None
    attention_impl: str | None = None

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        dense = lambda n, name: nn.Dense(n, dtype=self.dtype, dot_general_cls=self.dot_general_cls, name=name)
        h = nn.LayerNorm(dtype=self.dtype, name="ln1")(x)
        q, k, v = jnp.split(dense(3 * d, "qkv")(h), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.n_heads, d // self.n_heads) for a in (q, k, v))
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention_impl)
        x = x + dense(d, "proj")(y.reshape(b, t, d))
        h = nn.LayerNorm(dtype=self.dtype, name="ln2")(x)
        h = dense(d, "fc2")(nn.gelu(dense(4 * d, "fc1")(h)))
        return x + h


class GPT(nn.Module):
    vocab: int
    seq: int
    d_model: int
    n_layers: int
    n_heads: int
    dtype: Any = jnp.bfloat16
    dot_general_cls: Any = None
    attention_impl: str | None = None

    @nn.compact
    def __call__(self, tokens):
        init = nn.initializers.normal(0.02)
        wte = nn.Embed(self.vocab, self.d_model, dtype=self.dtype, embedding_init=init, name="wte")
        wpe = nn.Embed(self.seq, self.d_model, dtype=self.dtype, embedding_init=init, name="wpe")
        x = wte(tokens) + wpe(jnp.arange(tokens.shape[1]))
        for i in range(self.n_layers):
            x = Block(self.n_heads, self.dtype, self.dot_general_cls, self.attention_impl, name=f"block_{i}")(x)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
        return wte.attend(x)


def make_loss_fn(model: GPT):
    def loss_fn(params, batch):
        x, y = batch
        logits = model.apply(params, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss_fn


def make_optimizer():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))


# --------------------------------------------------------------- the steps per variant
def plain_train_step(loss_fn, tx):
    """(init, jitted step) of a plain step; an ``_overwrite_with_gradient`` collection is
    replaced by its gradient (Flax's `TrainState.apply_gradients`)."""

    def init(variables, *, batch=None):
        del batch  # a plain state has nothing sized by the batch
        trained = variables["params"] if OVERWRITE_WITH_GRADIENT in variables else variables
        return variables, tx.init(trained)

    def step(state, batch):
        variables, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(variables, batch)
        owg = OVERWRITE_WITH_GRADIENT in grads
        params, g = (variables["params"], grads["params"]) if owg else (variables, grads)
        updates, opt_state = tx.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        variables = {"params": params, OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]} if owg else params
        return (variables, opt_state), {"loss": loss}

    return init, jax.jit(step, donate_argnums=(0,))


_VARIABLES = {}  # the float32 variables of each model, initialised (and compiled) once


def build_model(arch: str, size: dict, attention_impl, dot_general_cls=None) -> nn.Module:
    """The bfloat16 model of `arch` at `size` (a row of `SIZES` or `LLAMA_SIZES`)."""
    if arch == "gpt":
        return GPT(size["vocab"], size["seq"], size["d_model"], size["n_layers"], size["n_heads"],
                   dtype=jnp.bfloat16, dot_general_cls=dot_general_cls, attention_impl=attention_impl)
    cfg = llama.get_config(size["preset"], n_layers=size["n_layers"], dot_general_cls=dot_general_cls,
                           attention="cudnn" if attention_impl == "cudnn" else "xla")
    return llama.Llama(cfg, dtype=jnp.bfloat16)


def _setup(variant: str, arch: str, size: dict, attention_impl):
    """(init, jitted step, float32 variables: a fresh copy, as the step donates them)."""
    fp8 = nn.Fp8DirectDotGeneralOp if variant == "flax-fp8" else None
    model = build_model(arch, size, attention_impl, fp8)
    key = (arch, tuple(size.items()), fp8 is not None)
    if key not in _VARIABLES:
        tokens = jnp.zeros((size["batch"], size["seq"]), jnp.int32)
        _VARIABLES[key] = flax.core.unfreeze(jax.jit(model.init)(jax.random.key(0), tokens))
    variables = jax.tree.map(lambda a: a.copy(), _VARIABLES[key])
    loss_fn, tx = make_loss_fn(model), make_optimizer()
    if variant in PLAIN:
        init, step = plain_train_step(loss_fn, tx)
        return init, step, variables
    train = llama_train.recipe_of(variant).train_step(loss_fn, tx)
    return train.init, train.step, variables


def _batch(size: dict):
    tokens = jax.random.randint(jax.random.key(1), (size["batch"], size["seq"] + 1), 0, size["vocab"])
    return tokens[:, :-1], tokens[:, 1:]


def _memory(compiled) -> dict:
    """The record's `xla_memory` (XLA's fields, or why not) and `memory_bytes`."""
    m = xla_memory(compiled)
    if "unavailable" in m:
        return {"xla_memory": f"unavailable: {m['unavailable']}", "memory_bytes": None}
    return {"xla_memory": {k: m[k] for k in XLA_MEMORY_FIELDS}, "memory_bytes": m["bytes"]}


def write_records(out_dir, stem: str, meta: dict, records: list, table: str) -> None:
    """OUT/<stem>.json ({"meta", "records"}) and OUT/<stem>.md (`table`), the folder made:
    written after every record, so that a run stopped part-way keeps what it measured."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    (out / f"{stem}.md").write_text(table)


def _peak_bytes_in_use():
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001
        return None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def _profile(compiled, state, batch, n: int, hlo: str, name: str, out_dir) -> tuple[dict, Any]:
    """Device kernels of `n` steps grouped by category (`kernel_profile.profile_kernels`);
    the markdown profile is written to OUT/profile_<name>.md. Returns (summary, state)."""
    from experiments.nanogpt.kernel_profile import markdown_profile, profile_kernels

    holder = [state]

    def run():
        holder[0], metrics = compiled(holder[0], batch)
        jax.block_until_ready((holder[0], metrics))

    prof = profile_kernels(run, n, hlo)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, f"profile_{name}.md").write_text(markdown_profile(name, prof))
    keep = ("kernels_per_step", "busy_us", "by_category_us", "kernels_under_5us_per_step", "families", "by_source")
    return {k: prof[k] for k in keep if k in prof}, holder[0]


def save_hlo(compiled_or_text, hlo_dir: str | None, name: str) -> None:
    """The compiled step's HLO text (XLA's schedule and fusion names, as the profile and
    `scalify.inspect.peak_temporaries` read them; a compiled step or its text) as
    ``hlo_dir/NAME.hlo.gz``, for reading it offline; nothing without `hlo_dir`."""
    if hlo_dir:
        text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
        os.makedirs(hlo_dir, exist_ok=True)
        with gzip.open(os.path.join(hlo_dir, f"{name}.hlo.gz"), "wt") as f:
            f.write(text)


def bench_variant(variant: str, size: dict, attention_impl, warmup: int, steps: int, repeats: int,
                  profile: int = 0, out_dir=None, arch: str = "gpt", hlo_dir: str | None = None) -> dict:
    """One variant's record (module docstring); its compiled HLO text saved in `hlo_dir`
    (`save_hlo`)."""
    init, step, variables = _setup(variant, arch, size, attention_impl)
    batch = _batch(size)
    state = init(variables)  # nothing compiled before the timed compile
    jax.block_until_ready((state, batch))
    out = {"variant": variant, "parameters": sum(x.size for x in jax.tree.leaves(variables["params"]))}
    t0 = time.perf_counter()
    lowered = step.trace(state, batch).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    out["trace_lower_s"], out["compile_s"] = t1 - t0, time.perf_counter() - t1
    hlo = compiled.as_text()
    save_hlo(hlo, hlo_dir, variant)
    out["hlo_instructions"], out["fp8_gemms"] = hlo_instruction_count(hlo), count_fp8_gemms(hlo)
    out.update(_memory(compiled))
    del lowered, variables
    losses = []
    for _ in range(warmup):
        state, metrics = compiled(state, batch)
        losses.append(metrics["loss"])
    jax.block_until_ready(state)
    windows = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            state, metrics = compiled(state, batch)
            losses.append(metrics["loss"])
        jax.block_until_ready((state, metrics))
        windows.append(1e3 * (time.perf_counter() - t0) / steps)
    if profile:
        out["profile"], state = _profile(compiled, state, batch, profile, hlo, variant, out_dir)
    del hlo
    losses = [float(x) for x in losses]
    out.update(step_ms=statistics.median(windows), step_ms_windows=windows, loss_first=losses[0],
               loss_final=losses[-1], loss_finite=bool(np.all(np.isfinite(losses))), n_steps=len(losses),
               peak_bytes_in_use_running_max=_peak_bytes_in_use())
    del state, compiled, step, init
    gc.collect()
    jax.clear_caches()
    return out


# ---------------------------------------------------------------------------- output
def _ratios(records: list[dict]) -> None:
    base = next((r for r in records if r["variant"] == "bf16"), None)
    for r in records:
        r["speedup_vs_bf16"] = base["step_ms"] / r["step_ms"] if base else None
        r["compile_vs_bf16"] = r["compile_s"] / base["compile_s"] if base else None
        r["trace_lower_compile_vs_bf16"] = ((r["trace_lower_s"] + r["compile_s"])
                                            / (base["trace_lower_s"] + base["compile_s"]) if base else None)
        r["fp8_bound"] = r["busy_vs_bf16"] = None
        if base and "busy_us" in base.get("profile", {}) and "busy_us" in r.get("profile", {}):
            r["busy_vs_bf16"] = base["profile"]["busy_us"] / r["profile"]["busy_us"]
        if base and "profile" in base and "profile" in r and r["fp8_gemms"]:
            r["fp8_bound"] = zero_overhead(base["profile"], r["profile"])["bound_zero_overhead"]


def model_part(source: str) -> str:
    """The part of the model a profile's source label (`scalify.inspect.source_label`,
    e.g. "backward block_*/fc1" or "forward layers_*/feed_forward/w1") belongs to."""
    if source == "other -":
        return "optimizer update"
    if source.startswith("(no"):
        return "no op name"
    path = source.split(" ", 1)[1].replace("/Fp8DirectDotGeneralOp_*", "")
    leaf = path.split("/")
    if path == "-":
        return "loss"
    if any(p.startswith("ln") or p.endswith("norm") for p in leaf):
        return "norms"
    if any(p in ("fc1", "fc2", "feed_forward") for p in leaf):
        return "MLP"
    if any(p in ("qkv", "proj", "wq", "wk", "wv", "wo") for p in leaf):
        return "attention projections"
    if any(p in ("wte", "wpe", "tok_embeddings", "wte.attend") for p in leaf):
        return "embeddings"
    if "lm_head" in leaf:
        return "head"
    return "attention and residual adds"


def by_part(records: list[dict]) -> str:
    """Markdown: the kernels that are not GEMMs by `model_part`, ms per step, one column per
    profiled variant ("" when no record has a source table)."""
    cols = [r for r in records if r.get("profile", {}).get("by_source")]
    if not cols:
        return ""
    sums = []
    for r in cols:
        parts: dict[str, float] = {}
        for row in r["profile"]["by_source"]:
            part = model_part(row["source"])
            parts[part] = parts.get(part, 0.0) + row["us"] / 1e3
        sums.append(parts)
    names = sorted(set().union(*sums), key=lambda k: -max(p.get(k, 0.0) for p in sums))
    lines = ["", "Kernels that are not GEMMs by part of the model (ms per step):", "",
             "| part | " + " | ".join(r["variant"] for r in cols) + " |", "|---" + "|---:" * len(cols) + "|"]
    lines += [f"| {n} | " + " | ".join(f"{p.get(n, 0.0):.2f}" for p in sums) + " |" for n in names]
    lines.append("| all | " + " | ".join(f"{sum(p.values()):.2f}" for p in sums) + " |")
    return "\n".join(lines) + "\n"


def markdown(records: list[dict], meta: dict) -> str:
    f = lambda x, spec: "-" if x is None else format(x, spec)
    lines = [f"### {TITLES[meta.get('arch', 'gpt')]} `{meta['size']}` ({meta['model']}; {records[0]['parameters']:,} parameters), "
             f"{meta['device_kind']}, jax {meta['jax']}, attention {meta['attention']}, median of {meta['repeats']} x "
             f"{meta['steps']} steps after {meta['warmup']} warm-up", "",
             "| variant | step ms | vs bf16 | busy vs bf16 | trace+lower s | compile s | compile vs bf16 | "
             "HLO instr | FP8 GEMMs | FP8 bound | memory GB | loss | finite |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in records:
        mem = None if r["memory_bytes"] is None else r["memory_bytes"] / 1e9
        lines.append(f"| {r['variant']} | {r['step_ms']:.2f} | {f(r['speedup_vs_bf16'], '.3f')} | "
                     f"{f(r.get('busy_vs_bf16'), '.3f')} | {r['trace_lower_s']:.1f} | {r['compile_s']:.1f} | "
                     f"{f(r['compile_vs_bf16'], '.2f')} | "
                     f"{r['hlo_instructions']} | {r['fp8_gemms']} | {f(r.get('fp8_bound'), '.3f')} | "
                     f"{f(mem, '.3f')} | {r['loss_final']:.4f} | "
                     f"{'yes' if r['loss_finite'] else 'NO'} |")
    return "\n".join(lines) + "\n" + by_part(records)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=list(ARCHS), default="gpt",
                   help="gpt (the stock GPT of this file) or llama (experiments/llama/model.py)")
    p.add_argument("--size", default="tiny",
                   help=f"gpt: {', '.join(SIZES)}; llama: {', '.join(LLAMA_SIZES)}")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the size's)")
    p.add_argument("--recipes", default=None,
                   help=f"comma-separated variants among {', '.join(VARIANTS)} and any scalify recipe "
                        f"(default: all of {', '.join(VARIANTS)})")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="steps per timed window")
    p.add_argument("--repeats", type=int, default=3, help="timed windows (the median is reported)")
    p.add_argument("--attention", default=None,
                   help="jax.nn.dot_product_attention implementation (default: cudnn on GPU, xla elsewhere)")
    p.add_argument("--out", default=None, help="folder for stock_gpt.json and stock_gpt.md")
    p.add_argument("--profile", type=int, default=0,
                   help="profile this many more steps per variant: kernels per step and device time "
                        "by category in the JSON, OUT/profile_<variant>.md")
    p.add_argument("--hlo-dir", default=None,
                   help="save each variant's compiled HLO text as HLO_DIR/<variant>.hlo.gz")
    a = p.parse_args(argv)
    if a.size not in ARCHS[a.arch]:
        p.error(f"--arch {a.arch} has sizes {', '.join(ARCHS[a.arch])}, not {a.size!r}")
    a.recipes = [v.strip() for v in (a.recipes or ",".join(VARIANTS)).split(",") if v.strip()]
    for v in a.recipes:
        if v not in PLAIN:
            try:
                llama_train.recipe_of(v)
            except ValueError:
                p.error(f"unknown variant {v!r}; choose among {list(PLAIN) + list(scalify.recipes.RECIPES)}, "
                        f"or a recipe name with suffixes {tuple(llama_train.SUFFIXES)}")
    if a.warmup < 1 or a.steps < 1 or a.repeats < 1:
        p.error("--warmup, --steps and --repeats must be >= 1")
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    dev = jax.devices()[0]
    impl = a.attention or ("cudnn" if dev.platform == "gpu" else None)
    impl = None if impl == "xla" else impl
    size = dict(ARCHS[a.arch][a.size], **({"batch": a.batch} if a.batch else {}))
    meta = {"arch": a.arch, "size": a.size, "model": ", ".join(f"{k} {v}" for k, v in size.items()), "device_kind": dev.device_kind,
            "platform": dev.platform, "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "attention": impl or "xla", "warmup": a.warmup, "steps": a.steps, "repeats": a.repeats,
            "compilation_cache_dir": jax.config.jax_compilation_cache_dir}  # set: compile s may be cache loads
    records, t0 = [], time.perf_counter()
    for v in a.recipes:
        print(f"[stock_gpt] {a.arch} {a.size} {v} ...", flush=True)
        r = bench_variant(v, size, impl, a.warmup, a.steps, a.repeats, a.profile, a.out, arch=a.arch,
                            hlo_dir=a.hlo_dir)
        records.append(r)
        print(f"[stock_gpt] {v}: {r['step_ms']:.2f} ms, trace+lower {r['trace_lower_s']:.1f} s, compile "
              f"{r['compile_s']:.1f} s, loss {r['loss_first']:.3f} -> {r['loss_final']:.3f}", flush=True)
        _ratios(records)
        meta["wall_s"] = time.perf_counter() - t0
        table = markdown(records, meta)
        if a.out:  # after every variant: a run stopped part-way keeps the variants done
            write_records(a.out, f"stock_{a.arch}", meta, records, table)
    print(table)
    return {"meta": meta, "records": records}

if __name__ == "__main__":
    main()
