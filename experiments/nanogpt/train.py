"""Train the NanoGPT example in one of the precision configurations of `configs.py`.

    python -m experiments.nanogpt.train --config fp8                      # pydoc corpus, tiny
    python -m experiments.nanogpt.train --config fp32,fp16,fp8 --model small --steps 2000 \\
        --data path/to/wikitext-103 --out runs/small

Data: ``--data pydoc`` (default: the standard library's help topics, no download) or a
WikiText directory (``wiki.{train,valid,test}.tokens``; without a train split the test
split is used for training, which the summary states). Tokenizer: bytes for a model with a
256-token vocabulary (``tiny``), otherwise a byte-level BPE of the model's vocabulary size
trained on the training split (cached).

Outputs, under ``--out`` (default ``runs/nanogpt``), one folder per config::

    OUT/CONFIG/metrics.jsonl   one JSON object per logged train step and per evaluation
    OUT/CONFIG/metrics.csv     the same rows as CSV
    OUT/CONFIG/summary.json    final train/valid loss, tokens/s, step time, config, data
    OUT/CONFIG/scales.json     log2 of the per-tensor scales (weights, activations,
                               gradients, optimizer state) before and after training
    OUT/CONFIG/scales.png      their histograms (scalify configs)
    OUT/CONFIG/checkpoint/     state.npz + state.json (every --checkpoint-every and at the end)
    OUT/loss.png               train and validation loss of every config found under OUT
    OUT/summary.md             a table of the final losses of every config under OUT

``--resume`` restarts from ``OUT/CONFIG/checkpoint``: the batch stream continues at the
saved step (batches are a function of (seed, step)), so the loss sequence is the one an
uninterrupted run gives. ``--stop-at S`` ends a run early at step S while keeping the
schedule of ``--steps``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from experiments.nanogpt import checkpoint as ckpt
from experiments.nanogpt import configs as C
from experiments.nanogpt import loop
from experiments.nanogpt import parallel
from experiments.nanogpt import step as S
from experiments.nanogpt import xla_flags
from experiments.nanogpt.cli import TrainArgs, parse_args
from experiments.nanogpt.data import load_dataset
from experiments.nanogpt.evaluation import ScaleSnapshots, evaluate
from experiments.nanogpt.metrics import MetricsWriter, StepLog, summary_table
from experiments.nanogpt.model import param_count

__all__ = ["TrainArgs", "train", "main", "parse_args", "load_run_dataset", "loss_facts", "timing_facts",
           "environment", "write_plots", "run_schedule"]


@dataclasses.dataclass
class _Run:
    """One configured run: what `train` builds from its options before the first step."""

    args: TrainArgs
    recipe: C.Recipe
    dataset: Any
    gpt: S.GPTConfig
    opt_cfg: S.OptimConfig
    tx: Any
    run_dir: Path
    ckpt_dir: Path

    @property
    def tokens_per_step(self) -> int:
        return self.args.batch_size * self.gpt.seq_len


# ----------------------------------------------------------------------------- set-up


def _tokenizer_for(args: TrainArgs, vocab: int) -> tuple[str, int | None]:
    if args.tokenizer is not None:
        kind = args.tokenizer
    else:
        kind = "byte" if vocab == 256 else "bpe"
        if kind == "bpe":
            try:
                import tokenizers  # noqa: F401
            except ImportError:
                print("The `tokenizers` package is missing: using the byte tokenizer (vocab 256); "
                      "install it (pip install tokenizers) for the BPE.", file=sys.stderr)
                kind = "byte"
    return kind, (None if kind == "byte" else (args.vocab_size or vocab))


def load_run_dataset(args: TrainArgs, preset_vocab: int):
    """The run's data (``--data``) tokenised for a model of `preset_vocab` tokens (or the
    ``vocab_size`` of ``args.model_overrides``): bytes for 256, else a BPE (`_tokenizer_for`)."""
    kind, vocab = _tokenizer_for(args, args.model_overrides.get("vocab_size", preset_vocab))
    return load_dataset(args.data, tokenizer=kind, vocab_size=vocab, cache_dir=args.cache_dir,
                        train_split="auto")


def _setup(args: TrainArgs) -> _Run:
    """Recipe, data, model config, optimizer and output folders of the run."""
    recipe = C.get_recipe(args.config, **args.recipe_overrides)
    dataset = load_run_dataset(args, S.get_config(args.model).vocab_size)
    model_overrides = dict(args.model_overrides, vocab_size=dataset.vocab_size)
    if args.seq_len is not None:
        model_overrides["seq_len"] = args.seq_len
    gpt = S.gpt_config(recipe, args.model, **model_overrides)
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    opt_cfg = S.OptimConfig(lr=args.lr, warmup_steps=warmup, total_steps=args.steps,
                            weight_decay=args.weight_decay, clip_norm=args.clip_norm)
    run_dir = Path(args.out) / recipe.name
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = Path(args.checkpoint_dir) / recipe.name if args.checkpoint_dir else run_dir / "checkpoint"
    return _Run(args, recipe, dataset, gpt, opt_cfg, S.make_optimizer(recipe, opt_cfg), run_dir, ckpt_dir)


def _initial_state(run: _Run) -> tuple[Any, int]:
    """The initial state and its step: step 0, or the checkpoint's with ``--resume``."""
    state = S.init_state(run.recipe, run.gpt, run.tx, seed=run.args.seed)
    if not run.args.resume:
        return state, 0
    if not ckpt.exists(run.ckpt_dir):
        print(f"--resume: no checkpoint in {run.ckpt_dir}, starting from step 0.", file=sys.stderr)
        return state, 0
    state, meta = ckpt.restore(run.ckpt_dir, state)
    return state, int(meta["step"])


def _train_step(run: _Run, state) -> tuple[Any, Any, Any]:
    """(train step, state, mesh): one device, or the state placed on ``--mesh``."""
    args = run.args
    if args.mesh == "none":
        step = S.make_train_step(run.recipe, run.gpt, run.tx, seed=args.seed, jit=args.jit, donate=args.jit)
        return step, state, None
    return parallel.setup(run.recipe, run.gpt, run.tx, state, args.mesh, seed=args.seed, donate=True,
                          batch_size=args.batch_size)


def _scale_snapshots(run: _Run) -> ScaleSnapshots:
    args = run.args
    diag = (S.make_diagnostics_fn(run.recipe, run.gpt, jit=args.jit)
            if (args.scales and run.recipe.scalify) else None)
    batch = next(run.dataset.eval_batches(args.batch_size, run.gpt.seq_len, 1), None)
    return ScaleSnapshots(run.run_dir / "scales.json", diag, batch, resume=args.resume)


def run_schedule(args: TrainArgs, start: int) -> loop.Schedule:
    """Steps ``start + 1`` to ``--steps`` (or ``--stop-at``); checkpoints at each
    evaluation unless ``--checkpoint-every`` says otherwise."""
    stop = min(args.steps, args.stop_at) if args.stop_at is not None else args.steps
    ckpt_every = args.eval_every if args.checkpoint_every is None else args.checkpoint_every
    return loop.Schedule(start=start, stop=stop, log_every=args.log_every, eval_every=args.eval_every,
                         checkpoint_every=ckpt_every)


def _print_header(run: _Run, state, schedule: loop.Schedule, mesh) -> None:
    args, gpt, recipe = run.args, run.gpt, run.recipe
    print(f"[{recipe.name}] {recipe.description}\n  model {args.model}: {param_count(state.params):,} "
          f"params, d={gpt.d_model}, layers={gpt.n_layers}, heads={gpt.n_heads}, seq={gpt.seq_len}, "
          f"vocab={gpt.vocab_size}\n  data: {run.dataset.description}\n  steps {schedule.start}->"
          f"{schedule.stop} of {args.steps}, batch {args.batch_size} x {gpt.seq_len}, lr {args.lr}, "
          f"jit={args.jit}, attention {gpt.attention_name()}"
          + (f", mesh {args.mesh} over {mesh.size} devices" if mesh is not None else ""),
          file=sys.stderr)


# ----------------------------------------------------------------------------- training


def train(args: TrainArgs) -> dict:
    """Runs one configuration; returns its summary (also written to summary.json)."""
    xla_flags.configure(args.xla_excess_precision)  # before JAX starts its backend
    t0 = time.time()
    run = _setup(args)
    state, start = _initial_state(run)
    # With several processes (--processes) each runs this loop on its device and process 0
    # writes the outputs.
    writes = jax.process_index() == 0
    writer = MetricsWriter(run.run_dir, resume_step=start if args.resume else None, files=writes)
    train_step, state, mesh = _train_step(run, state)
    eval_step = S.make_eval_step(run.recipe, run.gpt, jit=args.jit)
    scales = _scale_snapshots(run)
    if start == 0:
        scales.take(0, state)
    schedule = run_schedule(args, start)
    if writes:
        _print_header(run, state, schedule, mesh)

    log = StepLog(writer, lambda s: float(S.learning_rate(run.opt_cfg, s)), run.tokens_per_step)
    batches = run.dataset.train_batches(args.batch_size, run.gpt.seq_len, seed=args.seed, start_step=start)
    if mesh is not None:
        batches = (parallel.place_batch(b, mesh) for b in batches)
    state, step = loop.run(
        state, train_step, batches, schedule, log,
        evaluate=lambda st: evaluate(eval_step, st, run.dataset, args.batch_size, run.gpt.seq_len,
                                     args.eval_batches),
        save=lambda st, s: ckpt.save(run.ckpt_dir, st, {"step": s, "config": run.recipe.name,
                                                        "model": args.model, "seed": args.seed}, write=writes),
        progress=loop.Progress(schedule.stop, start, run.recipe.name, args.progress and writes))
    if log.diverged:
        if writes:
            print(f"[{run.recipe.name}] loss is not finite at step {step}: stopped.", file=sys.stderr)
    else:
        scales.take(step, state)
        if writes:
            scales.save()

    summary = _summary(run, state, step, log, mesh, wall_s=time.time() - t0)
    if writes:
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        if args.plots:
            write_plots(run.run_dir, Path(args.out))
    return summary


# ----------------------------------------------------------------------------- summary


def _run_facts(run: _Run, state, steps: int, mesh) -> dict:
    args, recipe, gpt = run.args, run.recipe, run.gpt
    return {
        "config": recipe.name,
        "paper": recipe.paper,
        "description": recipe.description,
        "recipe": recipe.to_dict(),
        "model": args.model,
        "model_config": {k: getattr(gpt, k) for k in ("vocab_size", "seq_len", "d_model", "n_heads",
                                                     "n_layers", "mlp_ratio", "padded_vocab_size")},
        "attention": gpt.attention_name(),
        "parameters": param_count(state.params),
        "data": run.dataset.description,
        "data_info": run.dataset.info,
        "steps": steps,
        "total_steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": gpt.seq_len,
        "tokens": steps * run.tokens_per_step,
        "lr": args.lr,
        "warmup": run.opt_cfg.warmup_steps,
        "seed": args.seed,
        "jit": args.jit,
        "mesh": args.mesh,
        "devices": 1 if mesh is None else mesh.size,
        "processes": jax.process_count(),
    }


def loss_facts(log: StepLog, log_every: int) -> dict:
    """Final losses; the train loss's mean is over the last `log_every` logged steps."""
    train_rows = [r for r in log.writer.rows if r["split"] == "train"]
    valid_rows = [r for r in log.writer.rows if r["split"] == "valid"]
    tail = [r["loss"] for r in train_rows[-max(1, log_every):]]
    return {
        "final_train_loss": log.last_train,
        "final_train_loss_mean": float(np.mean(tail)) if tail else None,
        "final_valid_loss": valid_rows[-1]["loss"] if valid_rows else None,
        "best_valid_loss": min((r["loss"] for r in valid_rows), default=None),
        "diverged": log.diverged,
    }


def timing_facts(step_times: list[float], tokens_per_step: int) -> dict:
    """Medians over the steps after the first (which compiles)."""
    timed = step_times[1:] if len(step_times) > 1 else step_times
    return {
        "step_time_ms_median": 1e3 * float(np.median(timed)) if timed else None,
        "tokens_per_s_median": tokens_per_step / float(np.median(timed)) if timed else None,
        "first_step_s": step_times[0] if step_times else None,
    }


def environment(module: str = "experiments.nanogpt.train") -> dict:
    """The device, versions, XLA flags and the command line (``python -m module ...``)."""
    return {
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "command": " ".join([Path(sys.executable).name, "-m", module,
                             *parallel.user_args(sys.argv[1:])]),
    }


def _summary(run: _Run, state, steps: int, log: StepLog, mesh, wall_s: float) -> dict:
    return {**_run_facts(run, state, steps, mesh), **loss_facts(log, run.args.log_every),
            **timing_facts(log.step_times, run.tokens_per_step), "wall_s": wall_s, **environment()}


def write_plots(run_dir: Path, out: Path, title: str | None = None) -> None:
    """OUT/loss.png of every run under `out` (`title`: the plot's), and the scale histograms
    of `run_dir` when it has a ``scales.json``; skipped without matplotlib."""
    try:
        from experiments.nanogpt import plots
    except ImportError as e:  # matplotlib missing (e.g. on the device machine)
        print(f"plots skipped: {e}", file=sys.stderr)
        return
    plots.plot_losses(out, out / "loss.png", title=title)
    if (run_dir / "scales.json").exists():
        plots.plot_scales(run_dir / "scales.json", run_dir / "scales.png", title=run_dir.name)


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    names, targs = parse_args(argv)
    if targs.processes > 1:
        if targs.process_id is None:  # start one process per device and wait for them
            codes = parallel.launch("experiments.nanogpt.train", argv, targs.processes)
            if any(codes):
                raise SystemExit(f"--processes {targs.processes}: exit codes {codes}.")
            print(summary_table(targs.out))
            return [json.loads((Path(targs.out) / C.get_recipe(n).name / "summary.json").read_text())
                    for n in names]
        xla_flags.configure(targs.xla_excess_precision)  # before jax.distributed starts the backend
        parallel.init_process(targs.coordinator, targs.processes, targs.process_id)
    summaries = []
    for name in names:
        summary = train(dataclasses.replace(targs, config=name))
        summaries.append(summary)
        if jax.process_index() != 0:
            continue
        valid = summary["final_valid_loss"]
        print(f"[{name}] steps {summary['steps']}: train {summary['final_train_loss']:.4f}, valid "
              f"{valid if valid is None else round(valid, 4)}, "
              f"{summary['tokens_per_s_median'] or 0:,.0f} tokens/s", file=sys.stderr)
    if jax.process_index() == 0:
        print(summary_table(targs.out))
    return summaries


if __name__ == "__main__":
    main(sys.argv[1:])
