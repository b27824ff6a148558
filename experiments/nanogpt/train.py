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

import argparse
import csv
import dataclasses
import json
import math
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
from experiments.nanogpt import step as S
from experiments.nanogpt import xla_flags
from experiments.nanogpt.data import load_dataset
from experiments.nanogpt.model import param_count

__all__ = ["TrainArgs", "train", "main", "parse_args", "MetricsWriter", "CSV_FIELDS", "summary_table",
           "read_metrics", "expand_configs"]

CSV_FIELDS = ("step", "split", "loss", "lr", "tokens", "tokens_per_s", "step_time_ms", "elapsed_s")


@dataclasses.dataclass
class TrainArgs:
    """Options of one training run (the CLI flags)."""

    config: str = "fp32"
    model: str = "tiny"
    data: str = "pydoc"
    tokenizer: str | None = None  # None: "byte" for a 256-token vocab, else "bpe"
    vocab_size: int | None = None
    steps: int = 200
    batch_size: int = 16
    seq_len: int | None = None  # None: the preset's seq_len
    lr: float = 1e-3
    warmup: int | None = None  # None: 10% of the steps
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0
    eval_every: int = 50
    eval_batches: int = 20
    log_every: int = 10
    checkpoint_every: int | None = None  # None: at evaluations and at the end; 0: never
    checkpoint_dir: str | None = None  # None: OUT/CONFIG/checkpoint
    out: str = "runs/nanogpt"
    resume: bool = False
    stop_at: int | None = None
    seed: int = 0
    jit: bool = True
    recipe_overrides: dict = dataclasses.field(default_factory=dict)
    model_overrides: dict = dataclasses.field(default_factory=dict)
    scales: bool = True
    plots: bool = True
    progress: bool = True
    cache_dir: str | None = None
    mesh: str = "none"  # none | dp | fsdp | dp:WIRE[:SCALING[:METHOD]] (experiments/nanogpt/parallel.py)
    xla_excess_precision: bool = False  # True: leave XLA its default (xla_flags.py)


# ----------------------------------------------------------------------------- metrics


class MetricsWriter:
    """Appends metric rows to ``metrics.jsonl`` and ``metrics.csv`` (flushed per write)."""

    def __init__(self, run_dir: Path, resume_step: int | None = None):
        self.jsonl = run_dir / "metrics.jsonl"
        self.csv = run_dir / "metrics.csv"
        rows = read_metrics(run_dir) if resume_step is not None else []
        # On resume, drop rows logged after the checkpoint (they will be logged again).
        rows = [r for r in rows if resume_step is not None and r["step"] <= resume_step]
        self.rows = rows
        with open(self.jsonl, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        with open(self.csv, "w", newline="") as f:
            w = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)

    def write(self, row: dict) -> None:
        self.rows.append(row)
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        with open(self.csv, "a", newline="") as f:
            csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore").writerow(row)


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finite(x: float) -> bool:
    return x is not None and math.isfinite(x)


# ----------------------------------------------------------------------------- training


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


def _progress(total: int, initial: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the device machine may lack tqdm
        return None
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=True)


def evaluate(eval_step, state, dataset, batch_size: int, seq_len: int, max_batches: int) -> float:
    """Mean validation loss over the first `max_batches` fixed batches."""
    losses = [eval_step(state.params, state.extra, x, y)
              for x, y in dataset.eval_batches(batch_size, seq_len, max_batches)]
    if not losses:
        raise ValueError(
            f"The validation split has too few tokens ({len(dataset.valid_tokens)}) for one batch "
            f"of {batch_size} x {seq_len}: lower --batch-size or --seq-len.")
    return float(np.mean([float(l) for l in losses]))


def _scale_snapshot(diag, state, batch) -> dict:
    loss, acts, grads = diag(state.params, state.extra, *batch)
    return {
        "weights": S.scale_summary(state.params),
        "activations": S.scale_summary(acts),
        "gradients": S.scale_summary(grads),
        "optimizer_state": S.scale_summary(state.opt_state),
    }


def train(args: TrainArgs) -> dict:
    """Runs one configuration; returns its summary (also written to summary.json)."""
    xla_flags.configure(args.xla_excess_precision)  # before JAX starts its backend
    recipe = C.get_recipe(args.config, **args.recipe_overrides)
    preset_vocab = S.get_config(args.model).vocab_size
    kind, vocab = _tokenizer_for(args, args.model_overrides.get("vocab_size", preset_vocab))
    t0 = time.time()
    dataset = load_dataset(args.data, tokenizer=kind, vocab_size=vocab, cache_dir=args.cache_dir,
                           train_split="auto")
    model_overrides = dict(args.model_overrides)
    model_overrides["vocab_size"] = dataset.vocab_size
    if args.seq_len is not None:
        model_overrides["seq_len"] = args.seq_len
    gpt = S.gpt_config(recipe, args.model, **model_overrides)
    seq_len = gpt.seq_len
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    opt_cfg = S.OptimConfig(lr=args.lr, warmup_steps=warmup, total_steps=args.steps,
                            weight_decay=args.weight_decay, clip_norm=args.clip_norm)
    tx = S.make_optimizer(recipe, opt_cfg)
    schedule_lr = lambda s: float(S.learning_rate(opt_cfg, s))  # noqa: E731

    run_dir = Path(args.out) / recipe.name
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = Path(args.checkpoint_dir) / recipe.name if args.checkpoint_dir else run_dir / "checkpoint"
    state = S.init_state(recipe, gpt, tx, seed=args.seed)
    start = 0
    if args.resume:
        if ckpt.exists(ckpt_dir):
            state, meta = ckpt.restore(ckpt_dir, state)
            start = int(meta["step"])
        else:
            print(f"--resume: no checkpoint in {ckpt_dir}, starting from step 0.", file=sys.stderr)
    writer = MetricsWriter(run_dir, resume_step=start if args.resume else None)

    mesh = None
    if args.mesh != "none":
        from experiments.nanogpt import parallel

        train_step, state, mesh = parallel.setup(recipe, gpt, tx, state, args.mesh, seed=args.seed,
                                                 donate=True, batch_size=args.batch_size)
    else:
        train_step = S.make_train_step(recipe, gpt, tx, seed=args.seed, jit=args.jit, donate=args.jit)
    eval_step = S.make_eval_step(recipe, gpt, jit=args.jit)
    diag = S.make_diagnostics_fn(recipe, gpt, jit=args.jit) if (args.scales and recipe.scalify) else None
    eval_batch = next(dataset.eval_batches(args.batch_size, seq_len, 1), None)

    scales_path = run_dir / "scales.json"
    scales = json.loads(scales_path.read_text()) if (args.resume and scales_path.exists()) else {}
    if diag is not None and eval_batch is not None and start == 0:
        scales[str(start)] = _scale_snapshot(diag, state, eval_batch)

    stop = min(args.steps, args.stop_at) if args.stop_at is not None else args.steps
    tokens_per_step = args.batch_size * seq_len
    print(f"[{recipe.name}] {recipe.description}\n  model {args.model}: {param_count(state.params):,} "
          f"params, d={gpt.d_model}, layers={gpt.n_layers}, heads={gpt.n_heads}, seq={seq_len}, "
          f"vocab={gpt.vocab_size}\n  data: {dataset.description}\n  steps {start}->{stop} of "
          f"{args.steps}, batch {args.batch_size} x {seq_len}, lr {args.lr}, jit={args.jit}"
          + (f", mesh {args.mesh} over {mesh.size} devices" if mesh is not None else ""),
          file=sys.stderr)
    bar = _progress(stop, start, recipe.name, args.progress)
    batches = dataset.train_batches(args.batch_size, seq_len, seed=args.seed, start_step=start)
    step_times: list[float] = []
    pending: list[tuple[int, Any]] = []  # steps dispatched since the last sync: (step, loss)
    last_train, diverged = None, False
    elapsed0, t_sync = time.time(), time.perf_counter()

    def flush():
        """Waits for the pending steps (dispatched back to back, so the host's dispatch of
        one overlaps the device's work on the previous) and logs them, each with the mean
        step time of the interval."""
        nonlocal last_train, diverged
        if not pending:
            return
        jax.block_until_ready(pending[-1][1])
        now = time.perf_counter()
        dt = (now - t_sync) / len(pending)
        for s, loss_arr in pending:
            loss = float(loss_arr)
            last_train = loss
            diverged = diverged or not _finite(loss)
            step_times.append(dt)
            writer.write(dict(step=s, split="train", loss=loss, lr=schedule_lr(s - 1),
                              tokens=s * tokens_per_step, tokens_per_s=tokens_per_step / dt,
                              step_time_ms=1e3 * dt, elapsed_s=time.time() - elapsed0))
        pending.clear()

    s = start
    while s < stop and not diverged:
        x, y = next(batches)
        if not pending:  # the interval starts here: evaluation and checkpoints are not in it
            t_sync = time.perf_counter()
        state, loss = train_step(state, x, y)
        s += 1
        pending.append((s, loss))
        if bar is not None:
            bar.update(1)
        if s == start + 1 or s % args.log_every == 0 or s == stop:  # the first step compiles
            flush()
            if bar is not None:
                bar.set_postfix(loss=f"{last_train:.4f}", tok_s=f"{tokens_per_step / step_times[-1]:,.0f}")
        is_eval = s % args.eval_every == 0 or s == stop
        if is_eval and not diverged:
            flush()
            valid = evaluate(eval_step, state, dataset, args.batch_size, seq_len, args.eval_batches)
            writer.write(dict(step=s, split="valid", loss=valid, lr=schedule_lr(s - 1),
                              tokens=s * tokens_per_step, elapsed_s=time.time() - elapsed0))
            if bar is not None:
                bar.set_postfix(loss=f"{last_train:.4f}", valid=f"{valid:.4f}")
        ckpt_every = args.eval_every if args.checkpoint_every is None else args.checkpoint_every
        if ckpt_every and (s % ckpt_every == 0 or s == stop) and not diverged:
            ckpt.save(ckpt_dir, state, {"step": s, "config": recipe.name,
                                                     "model": args.model, "seed": args.seed})
    flush()
    if bar is not None:
        bar.close()
    if diverged:
        print(f"[{recipe.name}] loss is not finite at step {s}: stopped.", file=sys.stderr)

    if diag is not None and eval_batch is not None and not diverged:
        scales[str(s)] = _scale_snapshot(diag, state, eval_batch)
        scales_path.write_text(json.dumps(scales, indent=1))

    rows = writer.rows
    train_rows = [r for r in rows if r["split"] == "train"]
    valid_rows = [r for r in rows if r["split"] == "valid"]
    timed = step_times[1:] if len(step_times) > 1 else step_times  # the first step compiles
    tail = [r["loss"] for r in train_rows[-max(1, args.log_every):]]
    summary = {
        "config": recipe.name,
        "paper": recipe.paper,
        "description": recipe.description,
        "recipe": recipe.to_dict(),
        "model": args.model,
        "model_config": {k: getattr(gpt, k) for k in ("vocab_size", "seq_len", "d_model", "n_heads",
                                                     "n_layers", "mlp_ratio", "padded_vocab_size")},
        "parameters": param_count(state.params),
        "data": dataset.description,
        "data_info": dataset.info,
        "steps": s,
        "total_steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": seq_len,
        "tokens": s * tokens_per_step,
        "lr": args.lr,
        "warmup": warmup,
        "seed": args.seed,
        "jit": args.jit,
        "mesh": args.mesh,
        "devices": 1 if mesh is None else mesh.size,
        "final_train_loss": last_train,
        "final_train_loss_mean": float(np.mean(tail)) if tail else None,
        "final_valid_loss": valid_rows[-1]["loss"] if valid_rows else None,
        "best_valid_loss": min((r["loss"] for r in valid_rows), default=None),
        "diverged": diverged,
        "step_time_ms_median": 1e3 * float(np.median(timed)) if timed else None,
        "tokens_per_s_median": tokens_per_step / float(np.median(timed)) if timed else None,
        "first_step_s": step_times[0] if step_times else None,
        "wall_s": time.time() - t0,
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "command": " ".join([Path(sys.executable).name, "-m", "experiments.nanogpt.train", *sys.argv[1:]]),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if args.plots:
        _plots(run_dir, Path(args.out))
    return summary


def _plots(run_dir: Path, out: Path) -> None:
    try:
        from experiments.nanogpt import plots
    except ImportError as e:  # matplotlib missing (e.g. on the device machine)
        print(f"plots skipped: {e}", file=sys.stderr)
        return
    plots.plot_losses(out, out / "loss.png")
    if (run_dir / "scales.json").exists():
        plots.plot_scales(run_dir / "scales.json", run_dir / "scales.png", title=run_dir.name)


# ----------------------------------------------------------------------------- CLI


def _kv(items: list[str] | None) -> dict:
    out = {}
    for item in items or []:
        for part in item.split(","):
            if not part:
                continue
            if "=" not in part:
                raise SystemExit(f"Expected KEY=VALUE, got {part!r}.")
            k, v = part.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def _model_overrides(items) -> dict:
    fields = {f.name: f for f in dataclasses.fields(S.GPTConfig)}
    out = {}
    for k, v in _kv(items).items():
        if k not in fields:
            raise SystemExit(f"Unknown model field {k!r} in --gpt.")
        default = getattr(S.GPTConfig(), k)
        if isinstance(default, bool):
            out[k] = v.lower() in ("1", "true", "yes")
        elif isinstance(default, int):
            out[k] = int(v)
        elif isinstance(default, float):
            out[k] = float(v)
        else:
            out[k] = v
    return out


def parse_args(argv: list[str] | None = None) -> tuple[list[str], TrainArgs]:
    p = argparse.ArgumentParser(
        prog="python -m experiments.nanogpt.train", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=C.__doc__)
    d = TrainArgs()
    p.add_argument("--config", default=d.config,
                   help=f"one or several (comma-separated) of {', '.join(C.RECIPES)}; 'paper' = "
                        f"the five paper configs, 'all' = those and the baselines")
    p.add_argument("--model", default=d.model, choices=sorted(S.PRESETS))
    p.add_argument("--data", "--data-dir", dest="data", default=d.data,
                   help="'pydoc' (embedded corpus) or a WikiText directory")
    p.add_argument("--tokenizer", choices=["byte", "bpe"], default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 10%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--clip-norm", type=float, default=d.clip_norm, help="0 disables clipping")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="default: at each evaluation and at the end; 0: no checkpoints")
    p.add_argument("--checkpoint-dir", default=None,
                   help="checkpoints go to DIR/CONFIG (default OUT/CONFIG/checkpoint)")
    p.add_argument("--out", default=d.out)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--stop-at", type=int, default=None, help="stop at this step (schedule of --steps kept)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-jit", dest="jit", action="store_false",
                   help="run the step op by op (fast start on CPU for tiny smoke runs)")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="override a recipe field, e.g. --set head_matmul=true")
    p.add_argument("--gpt", action="append", metavar="FIELD=VALUE",
                   help="override model fields, e.g. --gpt n_layers=1,d_model=32")
    p.add_argument("--no-scales", dest="scales", action="store_false")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--cache-dir", default=None, help="tokenizer/token cache")
    p.add_argument("--mesh", default=d.mesh,
                   help="none (one device), dp (data parallel), fsdp (parameters and optimizer state "
                        "sharded too) over all devices, or dp:WIRE[:SCALING[:METHOD]] for an explicit "
                        "scaled gradient all-reduce in WIRE (e5m2, e4m3, float16, bfloat16, float32); "
                        "see experiments/nanogpt/parallel.py")
    p.add_argument("--xla-excess-precision", action="store_true",
                   help="leave XLA's default --xla_allow_excess_precision=true (by default the "
                        "example turns it off: experiments/nanogpt/xla_flags.py)")
    a = p.parse_args(argv)
    names = expand_configs(a.config)
    targs = TrainArgs(
        config=names[0], model=a.model, data=a.data, tokenizer=a.tokenizer, vocab_size=a.vocab_size,
        steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr, warmup=a.warmup,
        weight_decay=a.weight_decay, clip_norm=a.clip_norm or None, eval_every=a.eval_every,
        eval_batches=a.eval_batches, log_every=a.log_every, checkpoint_every=a.checkpoint_every,
        checkpoint_dir=a.checkpoint_dir,
        out=a.out, resume=a.resume, stop_at=a.stop_at, seed=a.seed, jit=a.jit,
        recipe_overrides=C.parse_overrides(a.set), model_overrides=_model_overrides(a.gpt),
        scales=a.scales, plots=a.plots, progress=a.progress, cache_dir=a.cache_dir, mesh=a.mesh,
        xla_excess_precision=a.xla_excess_precision)
    return names, targs


def expand_configs(spec: str) -> list[str]:
    """'fp32,fp8' -> ['fp32', 'fp8']; 'paper' and 'all' expand to the named groups."""
    names: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        group = {"paper": C.PAPER_CONFIGS, "all": C.ALL_CONFIGS}.get(part, (part,))
        for n in group:
            if n not in C.RECIPES:
                raise SystemExit(f"Unknown config {n!r}; choose from {', '.join(C.RECIPES)}, paper, all.")
            if n not in names:
                names.append(n)
    return names


def summary_table(out: str | Path) -> str:
    """A markdown table of every ``OUT/*/summary.json``: final losses and the relative
    difference of the validation loss to ``fp32`` (written to ``OUT/summary.md``)."""
    out = Path(out)
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("*/summary.json"))]
    order = {n: i for i, n in enumerate(list(C.RECIPES))}
    rows.sort(key=lambda r: order.get(r["config"], len(order)))
    ref = next((r["final_valid_loss"] for r in rows if r["config"] == "fp32"), None)

    def fmt(x, spec=".4f"):
        return "-" if x is None else format(x, spec)

    lines = ["| config | paper | steps | tokens | final train loss | final valid loss | vs fp32 | "
             "tokens/s | step (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        v = r["final_valid_loss"]
        rel = "-" if (ref is None or v is None) else f"{100 * (v - ref) / ref:+.2f}%"
        lines.append(
            f"| {r['config']} | {r['paper'] or '-'} | {r['steps']} | {r['tokens']:,} | "
            f"{fmt(r['final_train_loss_mean'])} | {fmt(v)} | {rel} | {fmt(r['tokens_per_s_median'], ',.0f')} | "
            f"{fmt(r['step_time_ms_median'], '.2f')} |")
    if rows:
        r0 = rows[0]
        lines.append(f"\nModel `{r0['model']}` ({r0['parameters']:,} parameters), batch {r0['batch_size']} x "
                     f"seq {r0['seq_len']}, {r0['device']} ({r0['backend']}), jax {r0['jax']}.  \n"
                     f"Data: {r0['data']}.  \nFinal train loss: mean of the last logged steps; "
                     f"valid loss: mean over the first evaluation batches of the validation split.")
    table = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(table)
    return table


def main(argv: list[str] | None = None) -> list[dict]:
    names, targs = parse_args(argv)
    summaries = []
    for name in names:
        summary = train(dataclasses.replace(targs, config=name))
        summaries.append(summary)
        print(f"[{name}] steps {summary['steps']}: train {summary['final_train_loss']:.4f}, valid "
              f"{summary['final_valid_loss'] if summary['final_valid_loss'] is None else round(summary['final_valid_loss'], 4)}, "
              f"{summary['tokens_per_s_median'] or 0:,.0f} tokens/s", file=sys.stderr)
    print(summary_table(targs.out))
    return summaries


if __name__ == "__main__":
    main(sys.argv[1:])
