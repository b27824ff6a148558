"""Activation memory of the NanoGPT train step with and without FP8-saved activations (COAT).

For each residual policy (`scalify.ops.saved_activations.POLICIES`, or "none") the same
recipe's step is measured in its own subprocess (JAX cannot reset the device's peak
memory statistic):

- ``peak_bytes``: the device's ``peak_bytes_in_use`` over a few steps, and
  ``activation_bytes = peak - bytes_in_use before the first step`` (state and batch
  excluded: what the step itself allocates: activations, gradients, temporaries);
- XLA's ``memory_analysis()`` of the compiled step (``temp_size_in_bytes``);
- the step time (median over ``--steps`` after ``--warmup``) and the losses;
- ``residual_bytes``: what autodiff saves for the backward pass (traced, no device
  needed), in bytes and in units U = batch x seq x hidden x 2 bytes, per layer type (each
  layer traced alone) and per transformer block / head (whole model with 1 and 2 layers).

On the GPU (the reference measurement; one run of < 10 minutes per policy when the
compilations are slow)::

    PYTHONPATH=$PWD python -m experiments.nanogpt.activation_memory --model paper \\
        --seq-len 512 --batch-size 16 --config fp8 --policies none,coat-attention \\
        --out OUT

CPU smoke test (seconds; memory statistics are absent on CPU, XLA's analysis is not)::

    python -m experiments.nanogpt.activation_memory --model tiny --gpt n_layers=1,d_model=32,n_heads=2 \\
        --seq-len 16 --batch-size 2 --steps 2 --warmup 1 --out /tmp/actmem

Only the accounting (trace only, any machine, the paper model in seconds)::

    python -m experiments.nanogpt.activation_memory --model paper --seq-len 512 --batch-size 16 \\
        --residuals-only --policies none,coat-nonlinear,coat-attention --out /tmp/actmem

Writes ``OUT/activation_memory.json`` and ``OUT/activation_memory.md``; each run also writes
``OUT/runs/<config>+<policy>.json``, and ``--report-only`` rebuilds the tables from all the
run files found under OUT (to merge measurements from several runs).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from scalify.inspect.hlo import XLA_MEMORY_FIELDS, xla_memory

from experiments.nanogpt import configs as C
from experiments.nanogpt import step as S
from experiments.nanogpt.model import GPT, cross_entropy_loss

__all__ = ["layer_residuals", "model_residuals", "measure", "main", "markdown"]

LAYERS = ("ln", "qkv", "attention", "out", "fc", "activation", "proj")


def _mib(n) -> float | None:
    return None if n is None else round(n / 2**20, 1)


def _policy_name(p: str | None) -> str:
    return "none" if p in (None, "", "none") else p


def _gpt(config: str, model: str, policy: str | None, overrides: dict):
    recipe = C.get_recipe(config)
    pol = None if _policy_name(policy) == "none" else policy
    return recipe, S.gpt_config(recipe, model, saved_activations=pol, **overrides)


def _saved_bytes(f, *args) -> int:
    """Bytes of what autodiff keeps for the backward of f (arguments and constants excluded)."""
    from jax._src.ad_checkpoint import saved_residuals

    res = saved_residuals(f, *args)
    return int(sum(a.size * a.dtype.itemsize for a, d in res
                   if "argument" not in d and "constant" not in d))


def _abstract(tree, dtype=None):
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, dtype if dtype and jnp.issubdtype(x.dtype, jnp.floating)
                                       else x.dtype), tree)


def _param_dtype(recipe):
    # The loss is differentiated with respect to float32 views of 16-bit masters
    # (step.py's param_grads_f32), so params enter the model as float32.
    return jnp.float32


# ----------------------------------------------------------------------------- accounting
class _Layer(nn.Module):
    """One layer of the model alone, its input computed (not an argument), policy applied."""

    cfg: object
    kind: str

    @nn.compact
    def __call__(self, x):
        from experiments.nanogpt.model import _dense, _layernorm

        cfg = self.cfg
        x = x * jnp.asarray(2, x.dtype)  # a computed input: saved like in the model
        d = cfg.d_model
        if self.kind == "ln":
            return cfg.saved("norm", _layernorm(cfg, "ln"), x)
        if self.kind in ("qkv", "out", "fc", "proj"):
            feats = {"qkv": 3 * d, "out": d, "fc": cfg.d_mlp, "proj": d}[self.kind]
            return cfg.saved("linear", _dense(cfg, feats, "dense", 0.02), x)
        if self.kind == "activation":
            return cfg.saved_activation()(x)
        if self.kind == "attention":
            b, t, _ = x.shape
            q, k, v = (x.reshape(b, t, cfg.n_heads, cfg.d_head) * jnp.asarray(i + 1, x.dtype) for i in range(3))
            pos = jnp.arange(t)
            return cfg.get_attention_fn()(q, k, v, pos[:, None] >= pos[None, :])
        raise ValueError(self.kind)


def layer_residuals(config: str, model: str, policy: str | None, seq_len: int,
                    overrides: dict | None = None) -> dict[str, float]:
    """Saved bytes per batch element of each layer type, traced alone, in units
    U = seq x hidden x 2 bytes (per batch element)."""
    recipe, gpt = _gpt(config, model, policy, dict(overrides or {}, seq_len=seq_len))
    dt = gpt.dtype
    unit = seq_len * gpt.d_model * 2
    out = {}
    for kind in LAYERS:
        width = gpt.d_mlp if kind in ("activation", "proj") else gpt.d_model
        layer = _Layer(gpt, kind)

        def saved(b):
            x = jax.ShapeDtypeStruct((b, seq_len, width), dt)
            params = jax.eval_shape(lambda x: layer.init(jax.random.PRNGKey(0), x), x)
            params = _abstract(params, _param_dtype(recipe))
            return _saved_bytes(lambda p, x: jnp.sum(layer.apply(p, x).astype(jnp.float32)), params, x)

        out[kind] = (saved(2) - saved(1)) / unit
    return out


def model_residuals(config: str, model: str, policy: str | None, seq_len: int, batch_size: int,
                    overrides: dict | None = None, full_only: bool = False) -> dict:
    """Saved bytes of the whole loss (1 and 2 layers, batch 1 and 2 -> per block and head
    per batch element, in U) and of the real model at `batch_size` (bytes)."""
    overrides = dict(overrides or {}, seq_len=seq_len)
    unit = seq_len * S.get_config(model, **{k: v for k, v in overrides.items()}).d_model * 2

    def saved(n_layers, b):
        over = dict(overrides)
        if n_layers is not None:
            over["n_layers"] = n_layers
        recipe, gpt = _gpt(config, model, policy, over)
        loss = S.make_loss_fn(gpt)
        x = jax.ShapeDtypeStruct((b, seq_len), jnp.int32)
        params = jax.eval_shape(lambda x: GPT(gpt).init(jax.random.PRNGKey(0), x)["params"], x)
        params = _abstract(params, _param_dtype(recipe))
        return _saved_bytes(lambda p, x: loss(p, {}, x, x), params, x)

    full = saved(None, batch_size)
    if full_only:
        return {"model_bytes": full}
    one = saved(1, 2) - saved(1, 1)
    two = saved(2, 2) - saved(2, 1)
    return {"per_block_U": (two - one) / unit, "head_and_embeddings_U": (2 * one - two) / unit,
            "model_bytes": full}


# ----------------------------------------------------------------------------- measurement
def _memory_stats() -> dict:
    try:
        return dict(jax.devices()[0].memory_stats() or {})
    except Exception:  # noqa: BLE001 - backends without statistics
        return {}


def measure(config: str, policy: str | None, args) -> dict:
    """One (config, policy): compile, run, memory statistics (run it in a fresh process)."""
    overrides = dict(args.model_overrides)
    if args.seq_len:
        overrides["seq_len"] = args.seq_len
    recipe, gpt = _gpt(config, args.model, policy, overrides)
    tx = S.make_optimizer(recipe, S.OptimConfig(lr=1e-4, warmup_steps=10, total_steps=1000))
    b, t = args.batch_size, gpt.seq_len
    tok = np.random.default_rng(args.seed).integers(0, gpt.vocab_size, (b, t + 1)).astype(np.int32)
    x, y = jnp.asarray(tok[:, :-1]), jnp.asarray(tok[:, 1:])
    out = {"config": config, "policy": _policy_name(policy), "model": args.model, "batch_size": b,
           "seq_len": t, "d_model": gpt.d_model, "n_layers": gpt.n_layers}
    t0 = time.perf_counter()
    state = S.init_state(recipe, gpt, tx, seed=args.seed)
    jax.block_until_ready(state)
    out["state_bytes"] = int(sum(np.prod(v.shape) * v.dtype.itemsize for v in jax.tree_util.tree_leaves(state)))
    step = jax.jit(S.make_train_step(recipe, gpt, tx, jit=False), donate_argnums=(0,),
                   compiler_options=S.compiler_options(recipe))
    lowered = step.lower(state, x, y)
    out["trace_lower_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    compiled = lowered.compile()
    out["compile_s"] = time.perf_counter() - t1
    m = xla_memory(compiled)
    out["xla_memory"] = ({k: m[k] for k in XLA_MEMORY_FIELDS} if "unavailable" not in m
                         else f"unavailable: {m['unavailable']}")
    try:
        from scalify.inspect import count_fp8_gemms

        out["fp8_gemms"] = count_fp8_gemms(compiled.as_text())
    except Exception:  # noqa: BLE001
        pass
    del lowered
    before = _memory_stats().get("bytes_in_use")
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        t2 = time.perf_counter()
        state, loss = compiled(state, x, y)
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - t2)
        losses.append(float(loss))
    timed = times[args.warmup:] or times
    out["step_ms"] = 1e3 * float(np.median(timed))
    out["step_ms_min"] = 1e3 * float(np.min(timed))
    out["step_ms_all"] = [round(1e3 * s, 3) for s in timed]
    out["losses"] = losses
    out["loss_finite"] = bool(np.all(np.isfinite(losses)))
    stats = _memory_stats()
    if stats:
        out["peak_bytes"] = int(stats.get("peak_bytes_in_use", 0))
        out["bytes_in_use_before_step"] = before
        if before is not None:
            out["activation_bytes"] = out["peak_bytes"] - int(before)
    out["residual_bytes"] = model_residuals(config, args.model, policy, t, b, args.model_overrides,
                                            full_only=True)["model_bytes"]
    out["device"] = str(jax.devices()[0].device_kind)
    out["backend"] = jax.default_backend()
    out["jax"] = jax.__version__
    return out


# ----------------------------------------------------------------------------- report
def _ratio(a, b):
    return None if not a or not b else a / b


def markdown(doc: dict) -> str:
    """Tables: the measured runs (ratios vs policy none), then the accounting."""
    m = doc["meta"]
    lines = ["# Activation memory: FP8-saved activations (COAT) in the NanoGPT step", "",
             f"`{m['command']}`", ""]
    runs = doc.get("runs", [])
    if runs:
        base = {r["config"]: r for r in runs if r.get("policy") == "none" and "error" not in r}
        lines += ["| config | saved activations | step (ms) | vs none | peak (MiB) | activation "
                  "memory (MiB) | none / this | XLA temp (MiB) | none / this | autodiff residuals "
                  "(MiB) | none / this | loss finite |", "|" + "---|" * 12]
        for r in runs:
            if "error" in r:
                lines.append(f"| {r['config']} | {r['policy']} | error: see the JSON |" + " |" * 9)
                continue
            b = base.get(r["config"], {})
            temp = r["xla_memory"].get("temp_size_in_bytes") if isinstance(r.get("xla_memory"), dict) else None
            btemp = b.get("xla_memory", {}).get("temp_size_in_bytes") if isinstance(b.get("xla_memory"), dict) else None

            def fmt_ratio(x, y):
                q = _ratio(x, y)
                return "-" if q is None else f"{q:.2f}x"

            speed = _ratio(r["step_ms"], b.get("step_ms"))
            lines.append(
                f"| {r['config']} | {r['policy']} | {r['step_ms']:.2f} | "
                f"{'-' if speed is None else f'{speed:.3f}'} | {_mib(r.get('peak_bytes')) or '-'} | "
                f"{_mib(r.get('activation_bytes')) or '-'} | "
                f"{fmt_ratio(b.get('activation_bytes'), r.get('activation_bytes'))} | {_mib(temp) or '-'} | "
                f"{fmt_ratio(btemp, temp)} | {_mib(r['residual_bytes'])} | "
                f"{fmt_ratio(b.get('residual_bytes'), r['residual_bytes'])} | {r['loss_finite']} |")
        r0 = next((r for r in runs if "error" not in r), {})
        if r0:
            lines += ["", f"{r0['device']} ({r0['backend']}), jax {r0['jax']}, model `{r0['model']}` "
                      f"(d={r0['d_model']}, {r0['n_layers']} layers), batch {r0['batch_size']} x seq "
                      f"{r0['seq_len']}; step time: median of {m.get('steps')} steps after "
                      f"{m.get('warmup')} warm-up steps. Activation memory = peak bytes in use - "
                      "bytes in use before the first step (state and batch): what the step itself "
                      "allocates (activations, gradients, temporaries). Each row ran in its own "
                      "process.", ""]
    acc = doc.get("accounting")
    if acc:
        pols = list(acc)
        lines += ["## Saved for the backward pass, per layer (units U = batch x seq x hidden x 2 bytes)",
                  "", f"Traced (`jax` autodiff residuals, no device), config `{m['config']}`, model "
                  f"`{m['model']}`, seq {m['seq_len']}; each layer alone, its input computed in the "
                  "layer's dtype. FP8 data is 0.5 U per hidden-sized tensor; per-group scales add "
                  "1/G byte per element (E8M0).", "",
                  "| layer | " + " | ".join(pols) + " |", "|---|" + "---|" * len(pols)]
        names = {"ln": "LayerNorm (x2 per block)", "qkv": "QKV linear", "attention": "attention (QK^T, softmax, PV)",
                 "out": "attention output linear", "fc": "MLP up linear", "activation": "GELU",
                 "proj": "MLP down linear"}
        for kind in LAYERS:
            lines.append(f"| {names[kind]} | " + " | ".join(f"{acc[p]['layers'][kind]:.2f}" for p in pols) + " |")
        lines.append("| **sum per block** (LayerNorm twice) | " + " | ".join(
            f"**{sum(acc[p]['layers'].values()) + acc[p]['layers']['ln']:.2f}**" for p in pols) + " |")
        lines.append("| whole block, traced in the model | " + " | ".join(
            f"{acc[p]['per_block_U']:.2f}" for p in pols) + " |")
        lines.append("| embeddings + final LayerNorm + head + loss | " + " | ".join(
            f"{acc[p]['head_and_embeddings_U']:.2f}" for p in pols) + " |")
        lines.append(f"| whole model at batch {m['batch_size']} (MiB) | " + " | ".join(
            f"{_mib(acc[p]['model_bytes'])}" for p in pols) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- CLI
def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.nanogpt.activation_memory",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="paper", choices=sorted(S.PRESETS))
    p.add_argument("--config", default="fp8", help="the recipe (configs.py); fp8 = the scalify FP8 step")
    p.add_argument("--policies", default="none,coat-attention",
                   help="comma-separated residual policies (none, a preset of "
                        "scalify.ops.saved_activations.POLICIES, or layer=spec,...; use ';' "
                        "between policies that contain commas)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpt", action="append", metavar="FIELD=VALUE", help="model overrides")
    p.add_argument("--out", default="runs/activation_memory")
    p.add_argument("--residuals-only", action="store_true", help="only the traced accounting")
    p.add_argument("--no-accounting", dest="accounting", action="store_false")
    p.add_argument("--report-only", action="store_true", help="rebuild the tables from OUT/runs/*.json")
    p.add_argument("--in-process", action="store_true", help="no subprocesses (peak memory is then a running max)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    from experiments.nanogpt.cli import model_overrides

    a.model_overrides = model_overrides(a.gpt)
    sep = ";" if ";" in a.policies else ","
    a.policy_list = [s.strip() for s in a.policies.split(sep) if s.strip()]
    return a


def _run_file(out: Path, config: str, policy: str) -> Path:
    safe = policy.replace("/", "_").replace(",", "+").replace("=", "-").replace(":", "-")
    return out / "runs" / f"{config}+{safe}.json"


def _worker(args, argv) -> dict:
    res = measure(args.config, args.worker, args)
    path = _run_file(Path(args.out), args.config, _policy_name(args.worker))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    return res


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    if a.worker is not None:
        return _worker(a, argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    seq = a.seq_len or S.get_config(a.model, **a.model_overrides).seq_len
    if not (a.residuals_only or a.report_only):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(Path(__file__).resolve().parents[2]),
                                                          env.get("PYTHONPATH", "")] if p)
        rest = [t for t in argv if not t.startswith("--policies")]
        if "--policies" in argv:  # drop its value too
            i = argv.index("--policies")
            rest = argv[:i] + argv[i + 2:]
        for policy in a.policy_list:
            t1 = time.time()
            if a.in_process:
                try:
                    a.worker = policy
                    _worker(a, argv)
                except Exception as e:  # noqa: BLE001 - one failing run must not lose the others
                    _run_file(out, a.config, _policy_name(policy)).parent.mkdir(parents=True, exist_ok=True)
                    _run_file(out, a.config, _policy_name(policy)).write_text(json.dumps(
                        {"config": a.config, "policy": _policy_name(policy), "error": repr(e)}))
                finally:
                    a.worker = None
            else:
                proc = subprocess.run([sys.executable, "-m", "experiments.nanogpt.activation_memory", *rest,
                                       "--worker", policy], env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    path = _run_file(out, a.config, _policy_name(policy))
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps({"config": a.config, "policy": _policy_name(policy),
                                                "error": (proc.stderr or proc.stdout)[-3000:]}))
            print(f"[activation_memory] {a.config} + {policy}: {time.time() - t1:.0f} s", file=sys.stderr,
                  flush=True)
    runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))] if (out / "runs").is_dir() else []
    order = {p: i for i, p in enumerate(map(_policy_name, a.policy_list))}
    runs.sort(key=lambda r: (r.get("config", ""), order.get(r.get("policy"), len(order)), r.get("policy", "")))
    accounting = {}
    if a.accounting and not a.report_only:
        for policy in a.policy_list:
            acc = model_residuals(a.config, a.model, policy, seq, a.batch_size, a.model_overrides)
            acc["layers"] = layer_residuals(a.config, a.model, policy, seq, a.model_overrides)
            accounting[_policy_name(policy)] = acc
    elif (out / "activation_memory.json").exists():
        accounting = json.loads((out / "activation_memory.json").read_text()).get("accounting", {})
    meta = {"command": "python -m experiments.nanogpt.activation_memory " + " ".join(argv),
            "config": a.config, "model": a.model, "seq_len": seq, "batch_size": a.batch_size,
            "steps": a.steps, "warmup": a.warmup, "model_overrides": a.model_overrides,
            "python": platform.python_version(), "wall_s": time.time() - t0}
    doc = {"meta": meta, "runs": runs, "accounting": accounting}
    (out / "activation_memory.json").write_text(json.dumps(doc, indent=1, default=str))
    table = markdown(doc)
    (out / "activation_memory.md").write_text(table)
    print(table)
    return doc


if __name__ == "__main__":
    main()
