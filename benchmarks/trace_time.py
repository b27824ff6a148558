"""Trace, lower and compile cost of scalified training steps against the same steps without
scalify.

    python benchmarks/trace_time.py --out benchmarks/results   # CPU is fine: nothing runs
    python benchmarks/trace_time.py --model tiny --seq-len 64 --batch-size 8 --compile \\
        --flax-layers 4 --repeats 1 --file trace_time_cpu.md --out benchmarks/results
    python benchmarks/trace_time.py --model tiny --seq-len 64 --batch-size 8 --compile \
        --configs fp8 --layers 1,2,4,8 --no-floor --repeats 1 --file trace_time_cpu_depth.md \
        --out benchmarks/results                   # how the ratios grow with depth

The goals: scalify trace + lower (+ compile) <= 2x plain `jit`, and a compiled program of
<= 1.5x the plain program's HLO instructions. Tracing, lowering and compiling do not execute
the step, so this runs on abstract values (`jax.eval_shape`) on any backend.

Rows:
- NanoGPT (experiments/nanogpt), per config: the scalified step (`make_train_step`) and the
  same recipe's step with `use_scalify=False` on plain arrays, plus the interpreter's floor:
  the same scalified step given the plain state (no ScaledArray input), so `scalify` traces
  the step to a jaxpr and re-binds every equation as is, with no scale rule to run. No
  choice of scale rules can make the scalified step cheaper than that.
- with `--flax-layers N`: a stock Flax linen GPT (N pre-LayerNorm blocks of
  `nn.SelfAttention` and a GELU MLP, tied embedding head), float32, trained with
  `optax.adam`, scalified as the README says (`params = scalify.as_scaled_array(params)`,
  `jax.jit(scalify.scalify(step))`, plain optax state).

Each step is traced, lowered (and with `--compile` compiled) in a fresh trace cache; the
columns are the times, the number of jaxpr equations (nested ones included) and, with
`--compile`, the number of instructions of the compiled program
(`scalify.inspect.hlo_instruction_count`: fused computations included).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import scalify  # noqa: E402
from experiments.nanogpt import configs as C  # noqa: E402
from experiments.nanogpt import step as S  # noqa: E402
from scalify.inspect import hlo_instruction_count  # noqa: E402


def count_eqns(jaxpr) -> int:
    n = 0
    for e in jaxpr.eqns:
        n += 1
        for v in e.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += count_eqns(inner)
    return n


def timed(make_fn, args, repeats: int = 1, compile: bool = False):
    """(trace s, lower s, compile s, equations, HLO instructions) of `make_fn()` on `args`:
    the fastest of `repeats` runs by total time, each on a fresh function after
    `jax.clear_caches()`; compile time and HLO instructions are None without `compile`."""
    best = None
    for _ in range(repeats):
        jax.clear_caches()
        fn = make_fn()
        t0 = time.perf_counter()
        traced = fn.trace(*args)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        compiled = lowered.compile() if compile else None
        t3 = time.perf_counter()
        if best is None or (t3 - t0) < sum(best[:3]):
            best = (t1 - t0, t2 - t1, t3 - t2, traced, compiled)
    hlo = hlo_instruction_count(best[4].as_text()) if compile else None
    return best[0], best[1], best[2] if compile else None, count_eqns(best[3].jaxpr.jaxpr), hlo


# ----------------------------------------------------------------------------- stock Flax GPT
class Block(nn.Module):
    d_model: int
    n_heads: int

    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm()(x)
        x = x + nn.SelfAttention(num_heads=self.n_heads, deterministic=True)(h, mask=mask)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(self.d_model)(nn.gelu(nn.Dense(4 * self.d_model)(h)))


class FlaxGPT(nn.Module):
    """A stock Flax linen GPT: token + position embeddings, `n_layers` pre-LayerNorm blocks,
    final LayerNorm and the tied embedding as output head."""

    vocab_size: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab_size, self.d_model)
        x = embed(tokens) + nn.Embed(tokens.shape[1], self.d_model)(jnp.arange(tokens.shape[1]))
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.n_layers):
            x = Block(self.d_model, self.n_heads)(x, mask)
        return embed.attend(nn.LayerNorm()(x))


def flax_gpt_step(n_layers: int, seq_len: int, batch_size: int):
    """(step, params, opt_state, tokens) of the stock Flax GPT trained with optax.adam, all
    abstract (`jax.ShapeDtypeStruct`)."""
    model = FlaxGPT(n_layers=n_layers)
    tx = optax.adam(1e-3)
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros(tokens.shape, jnp.int32))["params"])
    opt_state = jax.eval_shape(tx.init, params)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            logits = model.apply({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, params, opt_state, tokens


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="paper", help="NanoGPT preset (experiments/nanogpt/model.py)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--configs", default="fp32,fp16,fp8", help="NanoGPT recipes; empty: none")
    p.add_argument("--layers", default="", help="comma-separated NanoGPT depths (n_layers) to "
                   "measure each config at; empty: the preset's")
    p.add_argument("--flax-layers", type=int, default=0, help="add the stock Flax GPT with this many blocks")
    p.add_argument("--compile", action="store_true", help="also compile: compile time, HLO instructions")
    p.add_argument("--no-floor", action="store_true", help="skip the interpreter's floor column")
    p.add_argument("--repeats", type=int, default=3, help="keep the fastest of this many runs")
    p.add_argument("--file", default="trace_time.md")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    rows = []
    depths = [int(n) for n in a.layers.split(",") if n] or [None]
    for name in filter(None, a.configs.split(",")):
        for n in depths:
            overrides = {} if n is None else {"n_layers": n}
            pair = S.abstract_step_pair(C.get_recipe(name), a.model, a.seq_len, a.batch_size, **overrides)
            scaled = timed(pair.scaled, pair.args, a.repeats, a.compile)
            floor = None if a.no_floor else timed(pair.scaled, pair.plain_args, a.repeats, a.compile)
            plain = timed(pair.plain, pair.plain_args, a.repeats, a.compile)
            depth = "" if n is None else f", {n} layers"
            rows.append((f"NanoGPT {a.model} {name}{depth}", scaled, floor, plain))
            print(rows[-1], flush=True)
    if a.flax_layers:
        step, params, opt_state, tokens = flax_gpt_step(a.flax_layers, a.seq_len, a.batch_size)
        sparams = jax.eval_shape(scalify.as_scaled_array, params)
        args = (params, opt_state, tokens, tokens)
        scaled = timed(lambda: jax.jit(scalify.scalify(step)), (sparams, *args[1:]), a.repeats, a.compile)
        floor = None if a.no_floor else timed(lambda: jax.jit(scalify.scalify(step)), args, a.repeats, a.compile)
        plain = timed(lambda: jax.jit(step), args, a.repeats, a.compile)
        rows.append((f"Flax GPT {a.flax_layers} layers fp32 adam", scaled, floor, plain))
        print(rows[-1], flush=True)
    cmd = " ".join(["python benchmarks/trace_time.py", *(argv if argv is not None else sys.argv[1:])])
    lines = [
        "# Trace, lower" + (" and compile" if a.compile else "") + " cost: scalified steps vs the same steps without scalify",
        "",
        f"`{cmd}` on {datetime.date.today().isoformat()}, {platform.machine()} "
        f"({jax.default_backend()}), jax {jax.__version__}, flax, optax; times are the fastest of "
        f"{a.repeats} run(s), each on a fresh function after `jax.clear_caches()`. Ratios are "
        "scalified / plain.",
        "",
    ]
    if a.compile:
        lines += [
            "| step | plain trace+lower (s) | compile (s) | equations | HLO instructions | "
            "scalify trace+lower (s) | compile (s) | equations | HLO instructions | "
            "trace+lower ratio | compile ratio | total ratio | HLO ratio | floor: total ratio | floor: HLO ratio |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, (st, sl, sc, se, sh), floor, (pt, pl, pc, pe, ph) in rows:
            ftot = f"{sum(floor[:3]) / (pt + pl + pc):.2f}x" if floor else "-"
            fhlo = f"{floor[4] / ph:.2f}x" if floor else "-"
            lines.append(
                f"| {name} | {pt + pl:.2f} | {pc:.2f} | {pe} | {ph} | {st + sl:.2f} | {sc:.2f} | {se} | {sh} | "
                f"{(st + sl) / (pt + pl):.2f}x | {sc / pc:.2f}x | {(st + sl + sc) / (pt + pl + pc):.2f}x | "
                f"{sh / ph:.2f}x | {ftot} | {fhlo} |")
    else:
        lines += [
            "| step | scalify trace (s) | lower (s) | equations | floor: scalify, unscaled "
            "inputs, trace+lower (s) | equations | plain trace (s) | lower (s) | equations | "
            "trace+lower ratio | floor ratio |", "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, (st, sl, _, se, _), floor, (pt, pl, _, pe, _) in rows:
            ft = f"{floor[0] + floor[1]:.2f}" if floor else "-"
            fe = floor[3] if floor else "-"
            fr = f"{(floor[0] + floor[1]) / (pt + pl):.2f}x" if floor else "-"
            lines.append(f"| {name} | {st:.2f} | {sl:.2f} | {se} | {ft} | {fe} | {pt:.2f} | "
                         f"{pl:.2f} | {pe} | {(st + sl) / (pt + pl):.2f}x | {fr} |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, a.file), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
