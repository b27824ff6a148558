"""Options of a NanoGPT training run: `TrainArgs`, the command line of ``train.py`` that
fills it, and the ``FIELD=VALUE`` model overrides (``--gpt``) that ``bench.py``,
``fp8_inference.py``, ``activation_memory.py`` and ``scaling_bench.py`` share. The data,
optimizer and output options (`add_training_options`, `add_output_options`, `shared_fields`)
and the overrides of any config dataclass (`model_overrides`) serve
``experiments/llama/train.py`` too.
"""
from __future__ import annotations

import argparse
import dataclasses

from experiments.nanogpt import configs as C
from experiments.nanogpt import step as S
from experiments.nanogpt.model import ATTENTIONS

__all__ = ["TrainArgs", "parse_args", "expand_configs", "model_overrides", "add_training_options",
           "add_output_options", "shared_fields"]

DESCRIPTION = "Train the NanoGPT example in one of the precision configurations of `configs.py`."


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
    processes: int = 1  # > 1: one process per device on this host (parallel.launch)
    process_id: int | None = None  # set by parallel.launch for each of its processes
    coordinator: str | None = None


def _kv(items: list[str] | None) -> dict:
    """``["a=1,b=2", "c=3"]`` -> ``{"a": "1", "b": "2", "c": "3"}`` (values as strings)."""
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


def model_overrides(items: list[str] | None, attention: str | None = None, config_cls=None,
                    option: str = "--gpt") -> dict:
    """``--gpt`` values -> field overrides of `config_cls` (a dataclass whose fields all have
    defaults; default `GPTConfig`), each parsed as its field's type; ``--attention`` (when
    given) is the field ``attention``."""
    config_cls = config_cls or S.GPTConfig
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    out = {}
    for k, v in _kv(items).items():
        if k not in fields:
            raise SystemExit(f"Unknown model field {k!r} in {option}.")
        default = getattr(config_cls(), k)
        if isinstance(default, bool):
            out[k] = v.lower() in ("1", "true", "yes")
        elif isinstance(default, int):
            out[k] = int(v)
        elif isinstance(default, float):
            out[k] = float(v)
        else:
            out[k] = v
    if attention is not None:
        out["attention"] = attention
    return out


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


def _add_run_options(p, d: TrainArgs) -> None:
    """What is trained (`p`: a parser or an argument group); on what and how long:
    `add_training_options`."""
    p.add_argument("--config", default=d.config,
                   help=f"one or several (comma-separated) of {', '.join(C.RECIPES)}; 'paper' = "
                        f"the five paper configs, 'all' = those and the baselines")
    p.add_argument("--model", default=d.model, choices=sorted(S.PRESETS))
    add_training_options(p, d)
    p.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="override a recipe field, e.g. --set head_matmul=true")
    p.add_argument("--gpt", action="append", metavar="FIELD=VALUE",
                   help="override model fields, e.g. --gpt n_layers=1,d_model=32")
    p.add_argument("--attention", choices=ATTENTIONS, default=None,
                   help="softmax (masked softmax, T x T probabilities), xla or cudnn "
                        "(jax.nn.dot_product_attention; cudnn: flash attention, GPU, 16-bit "
                        "models). Default: the recipe's, else auto = cudnn on a GPU for a "
                        "bfloat16/float16 model, else softmax")


def add_training_options(p, d: TrainArgs) -> None:
    """The data, the tokenizer, the length of the run and the optimizer's settings (shared
    with the other examples' command lines; `shared_fields` reads them back)."""
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
    p.add_argument("--seed", type=int, default=d.seed)


def add_output_options(p, d: TrainArgs, scales: bool = True) -> None:
    """Evaluation, logging, checkpoints and output files (``--no-scales`` with `scales`)."""
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
    if scales:
        p.add_argument("--no-scales", dest="scales", action="store_false")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--cache-dir", default=None, help="tokenizer/token cache")


def _add_execution_options(p, d: TrainArgs) -> None:
    """How the step runs: jit, devices, XLA flags."""
    p.add_argument("--no-jit", dest="jit", action="store_false",
                   help="run the step op by op (fast start on CPU for tiny smoke runs)")
    p.add_argument("--mesh", default=d.mesh,
                   help="none (one device), dp (data parallel), fsdp (parameters and optimizer state "
                        "sharded too) over all devices, or dp:WIRE[:SCALING[:METHOD]] for an explicit "
                        "scaled gradient all-reduce in WIRE (e5m2, e4m3, float16, bfloat16, float32), "
                        "or fsdp:WIRE to all-gather the kernels in the matmuls' format (e4m3 for fp8), "
                        "or fsdp:WIRE:GRAD_WIRE to run the passes per device and average the gradients "
                        "in GRAD_WIRE; for the scalify recipes dp:bfloat16 and fsdp:e4m3:bfloat16 have "
                        "the plain step's collectives; see experiments/nanogpt/parallel.py")
    p.add_argument("--xla-excess-precision", action="store_true",
                   help="leave XLA's default --xla_allow_excess_precision=true (by default the "
                        "example turns it off: experiments/nanogpt/xla_flags.py)")
    p.add_argument("--processes", type=int, default=d.processes,
                   help="run --mesh with one process per device on this host, as a multi-host job "
                        "runs (jax.distributed; process i on GPU i; process 0 writes the outputs)")
    p.add_argument("--process-id", type=int, default=None,
                   help="with --processes N and --coordinator: this process's index in a job that "
                        "another launcher starts (one process per device on each host: SLURM, mpirun)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0 (jax.distributed.initialize)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.nanogpt.train", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=C.__doc__)
    d = TrainArgs()
    _add_run_options(p.add_argument_group("training"), d)
    add_output_options(p.add_argument_group("evaluation and outputs"), d)
    _add_execution_options(p.add_argument_group("execution"), d)
    return p


def shared_fields(a: argparse.Namespace) -> dict:
    """The `TrainArgs` fields of the options of `add_training_options` and
    `add_output_options` in parsed arguments."""
    return dict(
        data=a.data, tokenizer=a.tokenizer, vocab_size=a.vocab_size, steps=a.steps, batch_size=a.batch_size,
        seq_len=a.seq_len, lr=a.lr, warmup=a.warmup, weight_decay=a.weight_decay, clip_norm=a.clip_norm or None,
        eval_every=a.eval_every, eval_batches=a.eval_batches, log_every=a.log_every,
        checkpoint_every=a.checkpoint_every, checkpoint_dir=a.checkpoint_dir, out=a.out, resume=a.resume,
        stop_at=a.stop_at, seed=a.seed, plots=a.plots, progress=a.progress, cache_dir=a.cache_dir)


def parse_args(argv: list[str] | None = None) -> tuple[list[str], TrainArgs]:
    """The command line -> (config names, the options of their runs; `config` = the first name)."""
    a = _parser().parse_args(argv)
    names = expand_configs(a.config)
    targs = TrainArgs(
        config=names[0], model=a.model, **shared_fields(a), jit=a.jit,
        recipe_overrides=C.parse_overrides(a.set),
        model_overrides=model_overrides(a.gpt, attention=a.attention),
        scales=a.scales, mesh=a.mesh, xla_excess_precision=a.xla_excess_precision, processes=a.processes,
        process_id=a.process_id, coordinator=a.coordinator)
    if targs.processes > 1 and targs.mesh == "none":
        raise SystemExit("--processes needs a --mesh (dp, fsdp, dp:bfloat16, ...): the step runs over "
                         "every process's device.")
    return names, targs
