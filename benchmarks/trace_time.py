"""Trace, lower and compile time of a scalified Flax GPT train step against the plain one.

A stock Flax GPT, written as a user would (pre-LN blocks, `nn.SelfAttention` with a causal
mask, GELU MLP, head tied to the embedding with `Embed.attend`), trained with
value_and_grad + optax adamw + `optax.apply_updates`. Per variant the plain step
`jax.jit(step)` and the scalified step `jax.jit(scalify.scalify(step))` (parameters and
optimizer state as `scalify.as_scaled_array`) are traced, lowered and compiled separately
(`jit(...).trace(...)`, `.lower()`, `.compile()`), and the compiled module's instructions
counted (`scalify.inspect.hlo_instruction_count`). Variants:

- fp32: float32 model;
- fp16: float16 compute (`dtype=jnp.float16` in every layer), float32 parameters;
- fp8: the float16 model with `scalify.nn.fp8_everywhere()` around its apply (the plain
  column is the fp16 plain step: FP8 exists only under scalify);
- recipe-NAME (README's way in; recipe-fp16, recipe-fp8, recipe-fp8-bf16, ...): the
  bfloat16 model, unchanged, through `scalify.recipes.get(NAME).train_step(loss_fn, opt)`
  (its jitted `step`, float32 parameters given to `init`), against the plain jitted step
  of the same bfloat16 model.

    python -m benchmarks.trace_time [--layers 2] [--d-model 128] [--seq 64] [--repeat 1]
        [--variants fp32,fp16,fp8] [--by-op]

`--by-op` also prints, for the scalified fp32 step, the instructions per HLO opcode and
the jaxpr equations per primitive, plain vs scalified.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import re
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import scalify
from scalify.inspect import hlo_instruction_count


class Block(nn.Module):
    d_model: int
    n_heads: int
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm(dtype=self.dtype)(x)
        x = x + nn.SelfAttention(num_heads=self.n_heads, dtype=self.dtype, deterministic=True)(h, mask=mask)
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.Dense(4 * self.d_model, dtype=self.dtype)(h)
        return x + nn.Dense(self.d_model, dtype=self.dtype)(nn.gelu(h))


class GPT(nn.Module):
    vocab: int = 256
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    seq_len: int = 64
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.d_model, dtype=self.dtype)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.seq_len, self.d_model))
        x = embed(tokens) + pos[: tokens.shape[1]].astype(self.dtype)
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.n_layers):
            x = Block(self.d_model, self.n_heads, self.dtype)(x, mask)
        x = nn.LayerNorm(dtype=self.dtype)(x)
        return embed.attend(x).astype(jnp.float32)


def make_step(model, opt, fp8: bool = False):
    """The train step: next-token cross entropy, its gradient, an optax update."""

    def loss_fn(params, tokens):
        ctx = scalify.nn.fp8_everywhere() if fp8 else contextlib.nullcontext()
        with ctx:
            logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def setup(n_layers=2, d_model=128, seq_len=64, batch=4, dtype=jnp.float32):
    """(model, params, opt, opt_state, tokens) of a GPT of the given sizes."""
    model = GPT(d_model=d_model, n_heads=max(d_model // 32, 1), n_layers=n_layers, seq_len=seq_len, dtype=dtype)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq_len + 1), 0, model.vocab)
    params = model.init(jax.random.PRNGKey(0), tokens[:, :-1])["params"]
    opt = optax.adamw(1e-3)
    return model, params, opt, opt.init(params), tokens


def timings(fn, *args, clock=time.perf_counter) -> dict:
    """Seconds to trace, lower and compile `jax.jit(fn)` on `args`, and the compiled HLO.
    `clock`: wall time by default; `time.process_time` counts this process's CPU time only,
    which other processes sharing the cores do not inflate."""
    jitted = jax.jit(fn)
    t0 = clock()
    traced = jitted.trace(*args)
    t1 = clock()
    lowered = traced.lower()
    t2 = clock()
    compiled = lowered.compile()
    t3 = clock()
    text = compiled.as_text()
    return dict(trace=t1 - t0, lower=t2 - t1, compile=t3 - t2, hlo=hlo_instruction_count(text),
                text=text, jaxpr=traced.jaxpr)


def _best(fn, args, repeat):
    runs = []
    for _ in range(repeat):
        jax.clear_caches()
        runs.append(timings(fn, *args))
    out = dict(runs[-1])
    for k in ("trace", "lower", "compile"):
        out[k] = min(r[k] for r in runs)
    return out


VARIANTS = {"fp32": (jnp.float32, False), "fp16": (jnp.float16, False), "fp8": (jnp.float16, True)}
RECIPE_PREFIX = "recipe-"  # "recipe-NAME": scalify.recipes.get(NAME)


def recipe_step(name: str, model, opt):
    """(step, init) of the recipe `name` on `model`'s loss, the step unjitted (`timings`
    jits it). Trace it on `step.sized(init(params), tokens)`: its delayed statistics an
    argument of the step, as in training (from `init` alone, the step would size them
    inside the trace, as constants)."""

    def loss_fn(p, t):
        logits = model.apply({"params": p}, t[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()

    train = scalify.recipes.get(name).train_step(loss_fn, opt, jit=False)
    return train.step, train.init


def measure(variant="fp32", repeat=1, **sizes) -> tuple[dict, dict]:
    """(plain, scalified) timings of one variant (see `timings`)."""
    if variant.startswith(RECIPE_PREFIX):
        model, params, opt, opt_state, tokens = setup(dtype=jnp.bfloat16, **sizes)
        plain = _best(make_step(model, opt), (params, opt_state, tokens), repeat)
        step, init = recipe_step(variant.removeprefix(RECIPE_PREFIX), model, opt)
        return plain, _best(step, (step.sized(init(params), tokens), tokens), repeat)
    dtype, fp8 = VARIANTS[variant]
    model, params, opt, opt_state, tokens = setup(dtype=dtype, **sizes)
    plain = _best(make_step(model, opt), (params, opt_state, tokens), repeat)
    sparams, sstate = scalify.as_scaled_array((params, opt_state))
    scaled = _best(scalify.scalify(make_step(model, opt, fp8)), (sparams, sstate, tokens), repeat)
    return plain, scaled


def hlo_opcodes(text: str) -> collections.Counter:
    """Instructions per HLO opcode, fused computations included."""
    ops = re.findall(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?:\([^=]*?\)|\S+)\s+([\w\-]+)\(", text, re.M)
    return collections.Counter(ops)


def jaxpr_primitives(jaxpr) -> collections.Counter:
    """Equations per primitive, sub-jaxprs included."""
    from jax.extend import core as jex

    counts = collections.Counter()

    def walk(j):
        for e in j.eqns:
            counts[e.primitive.name] += 1
            for sub in jex.jaxprs_in_params(e.params):
                walk(getattr(sub, "jaxpr", sub))

    walk(getattr(jaxpr, "jaxpr", jaxpr))
    return counts


def _diff_table(a: collections.Counter, b: collections.Counter, top=25) -> str:
    keys = sorted(set(a) | set(b), key=lambda k: b[k] - a[k], reverse=True)[:top]
    return "\n".join(f"  {k:28s} {a[k]:6d} {b[k]:6d} {b[k] - a[k]:+6d}" for k in keys)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--variants", default="fp32,fp16,fp8,recipe-fp16,recipe-fp8")
    p.add_argument("--by-op", action="store_true")
    a = p.parse_args(argv)
    sizes = dict(n_layers=a.layers, d_model=a.d_model, seq_len=a.seq, batch=a.batch)
    print(f"GPT {sizes}, adamw, CPU; seconds (best of {a.repeat}), HLO instructions")
    print(f"{'variant':8s} {'':10s} {'trace':>7s} {'lower':>7s} {'compile':>8s} {'total':>7s} {'hlo':>7s}")
    for v in a.variants.split(","):
        plain, scaled = measure(v, a.repeat, **sizes)
        rows = [("plain", plain), ("scalified", scaled)]
        for name, r in rows:
            total = r["trace"] + r["lower"] + r["compile"]
            print(f"{v:8s} {name:10s} {r['trace']:7.2f} {r['lower']:7.2f} {r['compile']:8.2f} {total:7.2f} {r['hlo']:7d}")
        tot = lambda r: r["trace"] + r["lower"] + r["compile"]  # noqa: E731
        ratio = [scaled[k] / plain[k] for k in ("trace", "lower", "compile")]
        print(f"{v:8s} {'ratio':10s} {ratio[0]:7.2f} {ratio[1]:7.2f} {ratio[2]:8.2f} "
              f"{tot(scaled) / tot(plain):7.2f} {scaled['hlo'] / plain['hlo']:7.2f}")
        if a.by_op:
            print("HLO opcodes (plain, scalified, difference):")
            print(_diff_table(hlo_opcodes(plain["text"]), hlo_opcodes(scaled["text"])))
            print("jaxpr primitives (plain, scalified, difference):")
            print(_diff_table(jaxpr_primitives(plain["jaxpr"]), jaxpr_primitives(scaled["jaxpr"])))


if __name__ == "__main__":
    main()
