"""Train the Llama example (`model.py`) through the public recipe API, `scalify.recipes`.

    python -m experiments.llama.train --config fp8 --model tiny --steps 300 --out runs/llama
    python -m experiments.llama.train --config bf16,fp32,fp16,fp8 --model small \\
        --data path/to/wikitext-103 --steps 2000 --batch-size 16 --out runs/llama-small

Configurations (``--config``, comma-separated; ``all``: every one). The model code is the
same in all of them; the loss is the mean softmax cross-entropy of the float32 logits; the
optimizer is NanoGPT's (`experiments.nanogpt.step.adamw`): global-norm clipping at
``--clip-norm``, then AdamW (b1 0.9, b2 0.95, weight decay on the matrices) with a linear
warm-up over ``--warmup`` steps and a cosine decay to 10% of ``--lr``.

- ``bf16``: a plain jitted step (`plain_train_step`): the model with ``dtype=bfloat16``,
  float32 parameters and optimizer state, ``optax.apply_updates``.
- ``fp32``, ``fp16``, ``fp16-master``, ``fp8``, ``fp8-fp16-state``:
  ``scalify.recipes.get(name).train_step(loss_fn, optimizer)``. ``fp32`` runs the model
  built with ``dtype=float32`` (the recipe keeps the model's dtype: the float32
  reference); the others the model built with ``dtype=bfloat16``, which the recipe
  replaces by float16 in every layer but ``lm_head`` (kept in bfloat16 by the recipes'
  default ``keep``), with FP8 matmuls from ``fp8`` on (`docs/recipes.md`).
- ``fp8-head``, ``fp8-fp16-state-head``: those recipes with ``keep=()``, the ``lm_head``
  matmul in FP8 too (`recipe_of`).

Evaluation runs the loss in the configuration's formats (the recipe's `precision` under
`scalify.scalify`, on the state's parameters as stored). Data, tokenizers, metrics, the
training loop, checkpoints and plots are NanoGPT's (`experiments/nanogpt`): ``--data
pydoc`` (default, no download) or a WikiText directory; bytes for a 256-token vocabulary
(``tiny``), else a byte-level BPE of the model's vocabulary size.

Outputs, under ``--out`` (default ``runs/llama``)::

    OUT/CONFIG/metrics.jsonl, metrics.csv   one row per logged step and per evaluation
    OUT/CONFIG/summary.json                 final losses, step time, config, model, data
    OUT/CONFIG/checkpoint/                  state.npz + state.json (at evaluations, the end)
    OUT/loss.png, OUT/summary.md            every config found under OUT

``--resume`` restarts from ``OUT/CONFIG/checkpoint``; batches are a function of (seed,
step), so the loss sequence is the one of an uninterrupted run. ``--stop-at S`` ends a
run at step S with the schedule of ``--steps``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import scalify
import scalify.recipes
from experiments.llama import model as M
from experiments.nanogpt import checkpoint as ckpt
from experiments.nanogpt import cli
from experiments.nanogpt import loop
from experiments.nanogpt import step as S
from experiments.nanogpt import xla_flags
from experiments.nanogpt.cli import TrainArgs
from experiments.nanogpt.evaluation import mean_loss
from experiments.nanogpt.metrics import MetricsWriter, StepLog, summary_table
from experiments.nanogpt.train import (environment, load_run_dataset, loss_facts, run_schedule, timing_facts,
                                       write_plots)
from scalify.core.scaled_array import ScaledArray
from scalify.recipes import TrainState, TrainStep
from scalify.recipes.kernel_layout import to_model

__all__ = ["CONFIGS", "recipe_of", "model_dtype", "make_loss_fn", "plain_train_step", "make_train_step", "make_eval_fn",
           "init_params", "train", "parse_args", "main"]

HEAD_SUFFIX = "-head"  # NAME-head: recipe NAME with keep=(), the output head in its formats too
SAVED_SUFFIX = "-fp8act"  # NAME-fp8act: recipe NAME with fp8_saved_activations=True
RECOMPUTE_SUFFIX = "-fp8w"  # NAME-fp8w: recipe NAME with recompute_fp8_weights=True
STATE_SUFFIX = "-fp16state"  # NAME-fp16state: recipe NAME with FP16 Adam moments (state_dtype)
SUFFIXES = {HEAD_SUFFIX: dict(keep=()), SAVED_SUFFIX: dict(fp8_saved_activations=True),
            RECOMPUTE_SUFFIX: dict(recompute_fp8_weights=True), STATE_SUFFIX: dict(state_dtype=jnp.float16)}
CONFIGS = ("bf16",) + tuple(scalify.recipes.RECIPES) + (
    "fp8" + HEAD_SUFFIX, "fp8-fp16-state" + HEAD_SUFFIX, "fp8-fp16-state" + SAVED_SUFFIX)
# The Scalify paper's Table 3 number of each recipe (Balança et al. 2024).
PAPER = {name: f"#{i}" for i, name in enumerate(scalify.recipes.RECIPES)}


def _base_and_changes(config: str) -> tuple[str, dict]:
    """(recipe name, fields to change) of NAME followed by suffixes of `SUFFIXES`."""
    name, changes = config, {}
    while suffix := next((s for s in SUFFIXES if name.endswith(s)), None):
        name = name.removesuffix(suffix)
        changes.update(SUFFIXES[suffix])
    return name, changes


def recipe_of(config: str) -> scalify.recipes.Recipe:
    """The recipe of a configuration: a recipe's name, followed by any of the suffixes
    ``-head`` (``keep=()``: no module kept in the model's own precision, the head computes
    in the recipe's formats too), ``-fp8act`` (``fp8_saved_activations=True``: the
    inputs of the norms and of SiLU saved for the backward pass in FP8), ``-fp8w``
    (``recompute_fp8_weights=True``: each kernel's FP8 copy for the backward pass cast
    again there) and ``-fp16state`` (``state_dtype=float16``: scaled FP16 Adam moments;
    ``fp8-bf16-fp16state`` is #4 with bfloat16 activations)."""
    if config in scalify.recipes.RECIPES:
        return scalify.recipes.get(config)
    name, changes = _base_and_changes(config)
    if changes and name in scalify.recipes.RECIPES:
        return scalify.recipes.get(name).replace(name=config, **changes)
    raise ValueError(f"Unknown config {config!r}; choose among {CONFIGS}, or a recipe name with suffixes "
                     f"{tuple(SUFFIXES)}.")


def model_dtype(config: str):
    """The ``dtype`` the model is built with: float32 for ``fp32``, else bfloat16."""
    return jnp.float32 if config == "fp32" else jnp.bfloat16


def compute_dtype(config: str):
    """The dtype the layers compute in during the step."""
    if config == "bf16":
        return jnp.dtype(jnp.bfloat16)
    return recipe_of(config).compute_dtype or jnp.dtype(model_dtype(config))


def make_loss_fn(model: M.Llama):
    """``loss_fn(params, (tokens, targets))``: mean cross-entropy of the float32 logits."""

    def loss_fn(params, batch):
        tokens, targets = batch
        logits = model.apply({"params": params}, tokens).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return loss_fn


def plain_train_step(loss_fn, tx: optax.GradientTransformation) -> TrainStep:
    """The plain step as a `scalify.recipes.TrainStep` (``recipe`` None): ``init(params)``
    copies the parameters (the step donates its state); ``step`` is ``value_and_grad``,
    ``tx.update`` and ``optax.apply_updates``, jitted."""

    def init(params, *, batch=None) -> TrainState:
        del batch  # the plain step has no statistics to size
        params = jax.tree.map(jnp.copy, params)
        return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))

    def update(state: TrainState, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(params, opt_state, state.step + 1), {"loss": loss}

    return TrainStep(None, init, jax.jit(update, donate_argnums=(0,)), update, update)


def make_train_step(config: str, loss_fn, tx: optax.GradientTransformation) -> TrainStep:
    """``bf16``: `plain_train_step`; a recipe name: the recipe's `train_step`."""
    if config == "bf16":
        return plain_train_step(loss_fn, tx)
    return recipe_of(config).train_step(loss_fn, tx)


def make_eval_fn(config: str, loss_fn):
    """``eval(params, batch) -> float32 loss``, jitted, in the formats of `config`:
    ``loss_fn`` as is for ``bf16``; for a recipe, under its `precision` and
    `scalify.scalify`, on the parameters of its state (ScaledArrays; an FP8 recipe's
    kernels back in the model's layout, `scalify.recipes.kernel_layout.to_model`)."""
    if config == "bf16":
        return jax.jit(loss_fn)
    recipe = recipe_of(config)

    def evaluate(params, batch):
        with scalify.recipes.precision(recipe):
            return loss_fn(to_model(params), batch)

    scaled = scalify.scalify(evaluate)

    def eval_fn(params, batch):
        loss = scaled(params, batch)
        return loss.to_array(jnp.float32) if isinstance(loss, ScaledArray) else loss.astype(jnp.float32)

    return jax.jit(eval_fn)


def init_params(model: M.Llama, seed: int):
    """The model's float32 parameters from ``PRNGKey(seed)`` (independent of ``dtype``)."""
    tokens = jnp.zeros((1, model.cfg.seq_len), jnp.int32)
    return jax.jit(model.init)(jax.random.PRNGKey(seed), tokens)["params"]


def _recipe_facts(config: str) -> dict | None:
    if config == "bf16":
        return None
    r = recipe_of(config)
    out = {}
    for f in dataclasses.fields(r):
        v = getattr(r, f.name)
        out[f.name] = v if isinstance(v, (bool, int, str)) or v is None else (
            list(v) if isinstance(v, tuple) else str(v))
    return out


def _describe(config: str) -> str:
    if config == "bf16":
        return "plain jitted step, bfloat16 compute, float32 parameters and AdamW state"
    r = recipe_of(config)
    compute = r.compute_dtype.name if r.compute_dtype is not None else "the model's float32"
    name = _base_and_changes(r.name)[0].upper().replace('-', '_')
    keep = ", lm_head included (keep=())" if r.keep == () else ""
    saved = ", norm and SiLU inputs saved in FP8" if r.fp8_saved_activations else ""
    recast = ", FP8 kernel copies cast again in the backward" if r.recompute_fp8_weights else ""
    return (f"scalify.recipes.{name}{keep}{saved}{recast}: {compute} compute"
            + (", FP8 matmuls" if r.fp8 else "") + f", {r.master_dtype.name} masters, "
            f"{r.state_dtype.name} AdamW state")


# ----------------------------------------------------------------------------- training


def train(args: TrainArgs) -> dict:
    """Runs one configuration (``args.config``); returns its summary (also written to
    ``OUT/CONFIG/summary.json``)."""
    xla_flags.configure(args.xla_excess_precision)  # before JAX starts its backend
    t0 = time.time()
    config = args.config
    if config not in CONFIGS:
        raise ValueError(f"Unknown config {config!r}; choose among {CONFIGS}.")
    dataset = load_run_dataset(args, M.get_config(args.model).vocab_size)
    overrides = dict(args.model_overrides, vocab_size=dataset.vocab_size)
    if args.seq_len is not None:
        overrides["seq_len"] = args.seq_len
    cfg = M.get_config(args.model, **overrides)
    model = M.Llama(cfg, dtype=model_dtype(config))
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    opt_cfg = S.OptimConfig(lr=args.lr, warmup_steps=warmup, total_steps=args.steps,
                            weight_decay=args.weight_decay, clip_norm=args.clip_norm)
    loss_fn = make_loss_fn(model)
    train_step = make_train_step(config, loss_fn, S.adamw(opt_cfg))
    eval_fn = make_eval_fn(config, loss_fn)
    run_dir = Path(args.out) / config
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = Path(args.checkpoint_dir) / config if args.checkpoint_dir else run_dir / "checkpoint"

    # The run's first batch: a recipe sizes and measures its delayed statistics on it.
    example = next(dataset.train_batches(args.batch_size, cfg.seq_len, seed=args.seed, start_step=0))
    state, start = train_step.init(init_params(model, args.seed), batch=example), 0
    if args.resume:
        if ckpt.exists(ckpt_dir):
            state, meta = ckpt.restore(ckpt_dir, state)
            start = int(meta["step"])
        else:
            print(f"--resume: no checkpoint in {ckpt_dir}, starting from step 0.", file=sys.stderr)
    schedule = run_schedule(args, start)
    tokens_per_step = args.batch_size * cfg.seq_len
    attention = M.attention_implementation(cfg.attention, compute_dtype(config)) or "xla"
    print(f"[{config}] {_describe(config)}\n  model {args.model}: {M.param_count(state.params):,} params, "
          f"d={cfg.d_model}, layers={cfg.n_layers}, heads={cfg.n_heads}/{cfg.n_kv_heads}, ffn={cfg.ffn_dim}, "
          f"seq={cfg.seq_len}, vocab={cfg.vocab_size}, attention {attention}\n  data: {dataset.description}\n"
          f"  steps {schedule.start}->{schedule.stop} of {args.steps}, batch {args.batch_size} x {cfg.seq_len}, "
          f"lr {args.lr}", file=sys.stderr)

    writer = MetricsWriter(run_dir, resume_step=start if args.resume else None)
    log = StepLog(writer, lambda s: S.learning_rate(opt_cfg, s), tokens_per_step)

    def step(st, tokens, targets):
        st, metrics = train_step.step(st, (tokens, targets))
        return st, metrics["loss"]

    meta = {"config": config, "model": args.model, "seed": args.seed}
    state, steps = loop.run(
        state, step, dataset.train_batches(args.batch_size, cfg.seq_len, seed=args.seed, start_step=start),
        schedule, log,
        evaluate=lambda st: mean_loss(lambda x, y: eval_fn(st.params, (x, y)), dataset, args.batch_size,
                                      cfg.seq_len, args.eval_batches),
        save=lambda st, s: ckpt.save(ckpt_dir, st, dict(meta, step=s)),
        progress=loop.Progress(schedule.stop, start, config, args.progress))
    if log.diverged:
        print(f"[{config}] loss is not finite at step {steps}: stopped.", file=sys.stderr)

    summary = {
        "config": config, "paper": PAPER.get(config), "description": _describe(config),
        "recipe": _recipe_facts(config), "model": args.model, "model_config": dataclasses.asdict(cfg),
        "model_dtype": jnp.dtype(model_dtype(config)).name, "compute_dtype": compute_dtype(config).name,
        "attention": attention, "parameters": M.param_count(state.params), "data": dataset.description,
        "data_info": dataset.info, "steps": steps, "total_steps": args.steps, "batch_size": args.batch_size,
        "seq_len": cfg.seq_len, "tokens": steps * tokens_per_step, "lr": args.lr, "warmup": warmup,
        "seed": args.seed, **loss_facts(log, args.log_every), **timing_facts(log.step_times, tokens_per_step),
        "wall_s": time.time() - t0, **environment("experiments.llama.train"),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if args.plots:
        write_plots(run_dir, Path(args.out), title=f"Llama {args.model}: {Path(args.out).name}")
    return summary


# ----------------------------------------------------------------------------- CLI


def _configs(spec: str) -> list[str]:
    names = []
    for part in (p.strip() for p in spec.split(",")):
        for name in (CONFIGS if part == "all" else (part,)):
            if name not in CONFIGS:
                raise SystemExit(f"Unknown config {name!r}; choose from {', '.join(CONFIGS)}, all.")
            if name not in names:
                names.append(name)
    return names


def parse_args(argv: list[str] | None = None) -> tuple[list[str], TrainArgs]:
    """The command line -> (config names, the options of their runs; `config` = the first)."""
    p = argparse.ArgumentParser(prog="python -m experiments.llama.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = TrainArgs(config="fp8", out="runs/llama")
    g = p.add_argument_group("training")
    g.add_argument("--config", default=d.config,
                   help=f"one or several (comma-separated) of {', '.join(CONFIGS)}; 'all' = every one")
    g.add_argument("--model", default=d.model, choices=list(M.PRESETS))
    g.add_argument("--llama", action="append", metavar="FIELD=VALUE",
                   help="override model fields (LlamaConfig), e.g. --llama n_layers=8")
    g.add_argument("--attention", choices=M.ATTENTIONS, default=None,
                   help="jax.nn.dot_product_attention's implementation; auto (default): cudnn on a GPU "
                        "for 16-bit q/k/v, else xla")
    cli.add_training_options(g, d)
    cli.add_output_options(p.add_argument_group("evaluation and outputs"), d, scales=False)
    p.add_argument("--xla-excess-precision", action="store_true",
                   help="leave XLA's default --xla_allow_excess_precision=true "
                        "(experiments/nanogpt/xla_flags.py)")
    a = p.parse_args(argv)
    names = _configs(a.config)
    overrides = cli.model_overrides(a.llama, attention=a.attention, config_cls=M.LlamaConfig, option="--llama")
    targs = TrainArgs(config=names[0], model=a.model, **cli.shared_fields(a), model_overrides=overrides,
                      scales=False, xla_excess_precision=a.xla_excess_precision)
    return names, targs


def main(argv: list[str] | None = None) -> list[dict]:
    names, targs = parse_args(sys.argv[1:] if argv is None else list(argv))
    summaries = []
    for name in names:
        summary = train(dataclasses.replace(targs, config=name))
        summaries.append(summary)
        valid = summary["final_valid_loss"]
        print(f"[{name}] steps {summary['steps']}: train {summary['final_train_loss']:.4f}, valid "
              f"{valid if valid is None else round(valid, 4)}, "
              f"{summary['tokens_per_s_median'] or 0:,.0f} tokens/s", file=sys.stderr)
    print(summary_table(targs.out))
    return summaries


if __name__ == "__main__":
    main(sys.argv[1:])
