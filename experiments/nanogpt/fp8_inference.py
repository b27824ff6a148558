"""FP8 post-training inference of a NanoGPT checkpoint (Perez et al. 2023, "Training and
inference of large language models using 8-bit floating point").

A model trained in higher precision is evaluated with FP8 matmuls:

- weights: quantised once at load to E4M3 with a per-tensor power-of-two scale from their
  amax (`s_w = 2^margin / 2^floor(log2(448 / amax(W)))`, i.e. the scaling bias
  `b_w = floor(log2(448 / amax(W))) - margin`), and stored in FP8 (the float kernels are
  dropped);
- activations: scaled just in time per tensor (the same formula on the current input);
- matmuls: E4M3 x E4M3 with the two scales (`scalify.ops.fp8.scaled_matmul`; on Hopper one
  cuBLASLt FP8 GEMM; elsewhere the same values through an up-cast);
- everything else (LayerNorm, attention, softmax, GELU, the tied output head) in the
  evaluation dtype (float32 by default, `fp8-fp16`: float16).

The constant-bias variant uses one scaling bias `b` for every weight and every activation
(`s = 2^-b`); sweeping `b` shows the window where it works and where it breaks (values
beyond `448 * 2^-b` saturate, values below E4M3's subnormals `2^-9 * 2^-b` flush to zero).

Validation loss / perplexity of each mode is compared with the float32 evaluation of the
same parameters on the same batches. The number of cuBLASLt FP8 GEMM calls in each
compiled evaluation is reported (0 on CPU, where the FP8 matmul runs through an up-cast).

    # a checkpoint written by experiments.nanogpt.train (any config; the params are read)
    python -m experiments.nanogpt.fp8_inference --checkpoint runs/small/fp32/checkpoint \\
        --model small --data path/to/wikitext --out OUT
    # or train one first (plain float32 Flax by default), then evaluate it
    python -m experiments.nanogpt.fp8_inference --train-steps 300 --model tiny --out /tmp/fp8inf

Writes `OUT/fp8_inference.json` and `OUT/fp8_inference.md`.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from scalify.inspect import count_fp8_gemms

from experiments.nanogpt import checkpoint as ckpt
from experiments.nanogpt import configs as C
from experiments.nanogpt import step as S
from experiments.nanogpt.model import GPT, cross_entropy_loss, get_config, param_count

__all__ = ["FP8Dense", "quantize_weights", "load_params", "param_template", "evaluate",
           "run", "main", "MODES", "markdown"]

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
FP8 = "fp8_weights"  # variable collection of the FP8 weights and their scales
TOLERANCE = 0.005  # the goal: FP8 validation loss within 0.5% of float32

# mode -> (compute dtype, fp8 matmuls)
MODES: dict[str, tuple[Any, bool]] = {
    "fp32": (jnp.float32, False),
    "fp16": (jnp.float16, False),
    "bf16": (jnp.bfloat16, False),
    "fp8": (jnp.float32, True),
    "fp8-fp16": (jnp.float16, True),
}


# ----------------------------------------------------------------------------- FP8 layers
def _input_scale(x, const_scale, margin: int):
    """Per-tensor just-in-time scale of x (const_scale None) or the constant one."""
    from scalify.ops.fp8 import amax, fp8_scale

    if const_scale is not None:
        return const_scale
    return fp8_scale(amax(x), E4M3, margin)


def _fp8_matmul(x, w8, sw, dn, out_dtype, const_scale, margin):
    from scalify.ops.fp8 import quantize, scaled_matmul

    sx = _input_scale(x, const_scale, margin)
    return scaled_matmul(quantize(x, sx, E4M3), w8, sx, sw, dn, out_dtype)


class FP8Dense(nn.Module):
    """Inference-only linear layer: FP8 kernel and scale from the `fp8_weights` collection,
    input quantised per tensor (just in time, or the collection's `input_scale` when
    `constant_bias`). Same call signature as `flax.linen.Dense` (kernel_init unused)."""

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = None
    bias_init: Any = nn.initializers.zeros_init()
    margin: int = 0
    constant_bias: bool = False

    @nn.compact
    def __call__(self, x):
        dtype = self.dtype or x.dtype
        x = jnp.asarray(x, dtype)
        w8 = self.variable(FP8, "kernel", jnp.zeros, (x.shape[-1], self.features), E4M3).value
        sw = self.variable(FP8, "kernel_scale", jnp.ones, (), jnp.float32).value
        const = self.variable(FP8, "input_scale", jnp.ones, (), jnp.float32).value if self.constant_bias else None
        y = _fp8_matmul(x, w8, sw, (((x.ndim - 1,), (0,)), ((), ())), dtype, const, self.margin)
        if self.use_bias:
            y = y + self.param("bias", self.bias_init, (self.features,), self.param_dtype).astype(dtype)
        return y


# ----------------------------------------------------------------------------- weights
def _weight_scale(w, margin: int, bias: int | None):
    from scalify.ops.fp8 import amax, fp8_scale

    if bias is not None:
        return jnp.float32(2.0 ** -bias)
    return fp8_scale(amax(w), E4M3, margin)


def quantize_weights(params, *, margin: int = 0, bias: int | None = None):
    """Split float params into (params without the dense kernels, the `fp8_weights` tree).

    Every 2-D `kernel` becomes `{"kernel": E4M3, "kernel_scale": s_w}` (per-tensor
    power-of-two scale from its amax, or `2^-bias` for the constant-bias variant; then also
    `input_scale = 2^-bias` for the activations).
    """
    from scalify.ops.fp8 import quantize

    def split(tree):
        keep, fp8 = {}, {}
        for k, v in tree.items():
            if isinstance(v, dict):
                kk, ff = split(v)
                keep[k] = kk
                if ff:
                    fp8[k] = ff
            elif k == "kernel" and jnp.ndim(v) == 2:
                s = _weight_scale(v, margin, bias)
                fp8.update(kernel=quantize(v, s, E4M3), kernel_scale=jnp.asarray(s, jnp.float32))
                if bias is not None:
                    fp8["input_scale"] = jnp.float32(2.0 ** -bias)
            else:
                keep[k] = v
        return keep, fp8

    return split(params)


def weight_biases(params, margin: int = 0) -> dict[str, int]:
    """{path: per-tensor scaling bias `floor(log2(448 / amax))`} of every dense kernel."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [getattr(k, "key", str(k)) for k in path]
        if names[-1] == "kernel" and np.ndim(leaf) == 2:
            s = float(_weight_scale(jnp.asarray(leaf), margin, None))
            out["/".join(names[:-1])] = int(round(-math.log2(s)))
    return out


# ----------------------------------------------------------------------------- checkpoint
def load_params(directory, template_params):
    """The `params` of a checkpoint written by `experiments.nanogpt.checkpoint.save` (a
    TrainState), read with the structure of `template_params` (the optimizer state is not
    needed). ScaledArray leaves are rebuilt as in the template."""
    d = Path(directory)
    doc = json.loads((d / "state.json").read_text())
    info = {li["path"]: (i, li) for i, li in enumerate(doc["leaves"])}
    wrapped = S.TrainState(template_params, (), {}, 0)
    flat, treedef = jax.tree_util.tree_flatten_with_path(wrapped)
    out = []
    with np.load(d / "state.npz") as z:
        for path, leaf in flat:
            key = jax.tree_util.keystr(path)
            if key not in info:
                raise ValueError(
                    f"Checkpoint {d} has no leaf {key}: it was written by another model or config "
                    "(check --model, --gpt and --config).")
            i, li = info[key]
            a = z[f"leaf_{i}"]
            dtype = jnp.dtype(li["dtype"])
            if a.dtype != dtype:
                a = a.view(dtype)
            if tuple(a.shape) != tuple(np.shape(leaf)):
                raise ValueError(f"Checkpoint leaf {key} has shape {a.shape}, the model expects "
                                 f"{np.shape(leaf)} (check --model, --gpt, --vocab-size).")
            out.append(jnp.asarray(a))
    return jax.tree_util.tree_unflatten(treedef, out).params, doc.get("meta", {})


def param_template(recipe, gpt):
    """The parameter tree of `recipe`'s TrainState (shapes and leaf types; nothing computed)."""
    tx = S.make_optimizer(recipe, S.OptimConfig())
    return jax.eval_shape(lambda: S.init_state(recipe, gpt, tx).params)


def float32_params(params):
    """Plain float32 parameters (ScaledArray leaves materialised)."""
    import scalify

    params = scalify.asarray(params, jnp.float32)
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)


# ----------------------------------------------------------------------------- evaluation
def eval_config(model: str, vocab_size: int, mode: str, *, margin: int = 0, constant_bias: bool = False,
                **overrides):
    """The `GPTConfig` of an evaluation mode (plain Flax layers; FP8Dense for FP8 modes)."""
    dtype, fp8 = MODES[mode]
    layers = {}
    if fp8:
        import functools

        layers["dense_cls"] = functools.partial(FP8Dense, margin=margin, constant_bias=constant_bias)
    return get_config(model, vocab_size=vocab_size, dtype=dtype, **layers, **overrides)


def make_eval_fn(gpt):
    model = GPT(gpt)

    @jax.jit
    def loss(variables, x, y):
        return cross_entropy_loss(model.apply(variables, x), y)

    return loss


def evaluate(loss_fn, variables, batches) -> float:
    """Mean loss over `batches` (a list of (tokens, targets))."""
    return float(np.mean([float(loss_fn(variables, x, y)) for x, y in batches]))


def _tokenizer(vocab: int, tokenizer: str | None):
    if tokenizer is not None:
        return tokenizer, (None if tokenizer == "byte" else vocab)
    if vocab == 256:
        return "byte", None
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        print("`tokenizers` is missing: byte tokenizer (vocab 256).", file=sys.stderr)
        return "byte", None
    return "bpe", vocab


def _train(args, out: Path) -> Path:
    from experiments.nanogpt import train as T

    targs = T.TrainArgs(
        config=args.train_config, model=args.model, data=args.data, tokenizer=args.tokenizer,
        vocab_size=args.vocab_size, steps=args.train_steps, batch_size=args.batch_size,
        seq_len=args.seq_len, lr=args.lr, eval_every=max(args.train_steps, 1), eval_batches=args.eval_batches,
        log_every=max(1, args.train_steps // 10), out=str(out / "train"), seed=args.seed,
        model_overrides=dict(args.model_overrides), scales=False, plots=False, progress=False,
        cache_dir=args.cache_dir, jit=True)
    summary = T.train(targs)
    print(f"[fp8_inference] trained {args.train_config} for {summary['steps']} steps: valid "
          f"{summary['final_valid_loss']}", file=sys.stderr)
    return out / "train" / args.train_config / "checkpoint"


def run(args) -> dict:
    """Loads (or trains) the checkpoint, evaluates every mode and the constant-bias sweep."""
    from experiments.nanogpt.data import load_dataset

    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    preset_vocab = args.model_overrides.get("vocab_size", get_config(args.model).vocab_size)
    kind, vocab = _tokenizer(args.vocab_size or preset_vocab, args.tokenizer)
    if args.tokenizer is None:
        args.tokenizer = kind
    data = load_dataset(args.data, tokenizer=kind, vocab_size=vocab, cache_dir=args.cache_dir,
                        train_split="auto")
    ckpt_dir = Path(args.checkpoint) if args.checkpoint else _train(args, out)
    if not ckpt.exists(ckpt_dir):
        raise SystemExit(f"No checkpoint (state.npz + state.json) in {ckpt_dir}.")
    meta = json.loads((ckpt_dir / "state.json").read_text()).get("meta", {})
    config = args.config or meta.get("config") or "fp32-plain"
    model_over = dict(args.model_overrides)
    model_over["vocab_size"] = data.vocab_size
    if args.seq_len:
        model_over["seq_len"] = args.seq_len
    recipe = C.get_recipe(config)
    gpt_train = S.gpt_config(recipe, args.model, **model_over)
    template = param_template(recipe, gpt_train)
    params, meta = load_params(ckpt_dir, template)
    params = float32_params(params)
    seq = gpt_train.seq_len
    batches = list(data.eval_batches(args.batch_size, seq, args.eval_batches))
    if not batches:
        raise SystemExit(f"The validation split is too short for one batch of {args.batch_size} x {seq}.")
    over = {k: v for k, v in model_over.items() if k != "vocab_size"}

    results, fns = [], {}

    gemms: dict[str, int] = {}

    def variables(mode, bias=None):
        if not MODES[mode][1]:
            return {"params": params}
        keep, fp8 = quantize_weights(params, margin=args.margin, bias=bias)
        return {"params": keep, FP8: fp8}

    def fn_for(mode, const=False):
        key = (mode, const)
        if key not in fns:
            gpt = eval_config(args.model, data.vocab_size, mode, margin=args.margin, constant_bias=const, **over)
            # Compiled once for the batch shape; its HLO tells whether the matmuls are FP8 GEMMs.
            compiled = make_eval_fn(gpt).lower(variables(mode, 0 if const else None), *batches[0]).compile()
            gemms[mode + ("-constant-bias" if const else "")] = count_fp8_gemms(compiled.as_text())
            fns[key] = compiled
        return fns[key]

    ref = None
    for mode in args.modes:
        t = time.time()
        loss = evaluate(fn_for(mode), variables(mode), batches)
        ref = loss if mode == "fp32" else ref
        results.append({"mode": mode, "loss": loss, "seconds": time.time() - t, "fp8_gemms": gemms[mode]})
        print(f"[fp8_inference] {mode}: valid loss {loss:.5f}", file=sys.stderr)
    if ref is None:
        ref = evaluate(fn_for("fp32"), variables("fp32"), batches)
    for r in results:
        r["perplexity"] = _ppl(r["loss"])
        r["rel_to_fp32"] = (r["loss"] - ref) / ref
    sweep = []
    for b in args.biases:
        loss = evaluate(fn_for("fp8", True), variables("fp8", b), batches)
        sweep.append({"bias": b, "loss": loss, "perplexity": _ppl(loss), "rel_to_fp32": (loss - ref) / ref})
        print(f"[fp8_inference] constant bias {b}: valid loss {loss:.5f}", file=sys.stderr)
    doc = {
        "meta": {
            "command": "python -m experiments.nanogpt.fp8_inference " + " ".join(args.argv),
            "checkpoint": str(ckpt_dir), "checkpoint_meta": meta, "config": config,
            "model": args.model, "model_overrides": over, "parameters": param_count(params),
            "data": data.description, "batch_size": args.batch_size, "seq_len": seq,
            "eval_batches": len(batches), "eval_tokens": len(batches) * args.batch_size * seq,
            "margin": args.margin, "tolerance": TOLERANCE,
            "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
            "jax": jax.__version__, "python": platform.python_version(), "wall_s": time.time() - t0,
        },
        "fp32_loss": ref,
        "modes": results,
        "constant_bias_sweep": sweep,
        "weight_biases": weight_biases(params, args.margin),
        "fp8_gemms": gemms,
    }
    (out / "fp8_inference.json").write_text(json.dumps(doc, indent=1, default=str))
    table = markdown(doc)
    (out / "fp8_inference.md").write_text(table)
    print(table)
    return doc


def _ppl(loss: float) -> float:
    return float(math.exp(loss)) if loss < 700 else float("inf")


def markdown(doc: dict) -> str:
    """The results as markdown: the modes, then the constant-bias sweep."""
    m = doc["meta"]
    tol = 100 * m["tolerance"]
    lines = [
        "# FP8 post-training inference (NanoGPT)", "", f"`{m['command']}`", "",
        f"Checkpoint `{m['checkpoint']}` (config `{m['config']}`), model `{m['model']}` "
        f"({m['parameters']:,} parameters), {m['eval_batches']} validation batches of "
        f"{m['batch_size']} x {m['seq_len']} ({m['eval_tokens']:,} tokens); {m['device']} "
        f"({m['backend']}), jax {m['jax']}.  ", f"Data: {m['data']}.", "",
        "FP8: E4M3 weights (per-tensor power-of-two scale from amax, once at load) and E4M3 "
        f"activations (per-tensor, just in time), margin {m['margin']}; the output head is "
        "in the evaluation dtype.", "",
        f"| mode | valid loss | perplexity | vs fp32 | within {tol:g}% | FP8 GEMMs in the HLO |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["modes"]:
        ok = "yes" if abs(r["rel_to_fp32"]) <= m["tolerance"] else "no"
        lines.append(f"| {r['mode']} | {r['loss']:.5f} | {r['perplexity']:.3f} | "
                     f"{100 * r['rel_to_fp32']:+.3f}% | {ok} | {r.get('fp8_gemms', '-')} |")
    if doc["constant_bias_sweep"]:
        wb = list(doc["weight_biases"].values())
        lines += [
            "", "## Constant scaling bias (one bias b for every weight and activation, scale 2^-b)", "",
            f"Per-tensor biases the just-in-time recipe picks for the weights: {min(wb)} to {max(wb)}.", "",
            f"| bias | valid loss | perplexity | vs fp32 | within {tol:g}% |", "|---|---|---|---|---|",
        ]
        for r in doc["constant_bias_sweep"]:
            fin = math.isfinite(r["loss"])
            ok = "yes" if fin and abs(r["rel_to_fp32"]) <= m["tolerance"] else "no"
            rel = f"{100 * r['rel_to_fp32']:+.3f}%" if fin else "nan"
            lines.append(f"| {r['bias']} | {r['loss']:.5f} | {r['perplexity']:.3f} | {rel} | {ok} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- CLI
def _range(text: str) -> list[int]:
    """'-4:12' (inclusive, step 1), '-4:12:2', or a comma list '0,4,8'."""
    if not text:
        return []
    if ":" in text:
        parts = [int(p) for p in text.split(":")]
        lo, hi, step = (parts + [1])[:3]
        return list(range(lo, hi + 1, step))
    return [int(p) for p in text.split(",")]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.nanogpt.fp8_inference",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory (state.npz, state.json)")
    p.add_argument("--config", default=None, help="recipe of the checkpoint (default: its metadata)")
    p.add_argument("--model", default="tiny", choices=sorted(S.PRESETS))
    p.add_argument("--gpt", action="append", metavar="FIELD=VALUE", help="model overrides (as in train)")
    p.add_argument("--data", default="pydoc")
    p.add_argument("--tokenizer", choices=["byte", "bpe"], default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--modes", default="fp32,fp16,bf16,fp8,fp8-fp16",
                   help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--margin", type=int, default=0, help="per-tensor scaling margin (binades)")
    p.add_argument("--biases", default="-4:16", help="constant-bias sweep: 'lo:hi[:step]' or a list; '' skips")
    p.add_argument("--train-steps", type=int, default=300, help="without --checkpoint: train this long first")
    p.add_argument("--train-config", default="fp32-plain", help="recipe of that training run")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/fp8_inference")
    a = p.parse_args(argv)
    from experiments.nanogpt.cli import model_overrides

    a.model_overrides = model_overrides(a.gpt)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in a.modes if m not in MODES]
    if bad:
        raise SystemExit(f"Unknown mode(s) {bad}; choose from {', '.join(MODES)}.")
    a.biases = _range(a.biases)
    a.argv = list(argv)
    return a


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
