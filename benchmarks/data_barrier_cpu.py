"""Compiled size of scalified programs with and without the data barrier
(`ScalifyConfig.data_barrier`), and with other scale-barrier depths, on CPU.

    python benchmarks/data_barrier_cpu.py --out OUT.md

Rows: the NanoGPT `tiny` fp8 and fp16 training steps (seq 64, batch 8) against their plain
steps, and residual chains `x <- x * w + x` (64 x 64, read at every layer by a tanh sum) of
4 and 8 layers in float16, bfloat16 and E4M3. Counts are
`scalify.inspect.hlo_instruction_count` of the compiled program (fused computations
included). Nothing runs; any backend compiles.
"""
from __future__ import annotations

import argparse
import datetime
import platform

import jax
import jax.numpy as jnp
import numpy as np

import scalify
from experiments.nanogpt import configs as C
from experiments.nanogpt import step as S
from scalify.inspect import hlo_instruction_count


def _step_size(recipe: str, **config) -> tuple[int, int]:
    with scalify.ScalifyConfig(**config):
        pair = S.abstract_step_pair(C.get_recipe(recipe), "tiny", seq_len=64, batch_size=8)
        scaled = hlo_instruction_count(pair.scaled().lower(*pair.args).compile())
    plain = hlo_instruction_count(pair.plain().lower(*pair.plain_args).compile())
    return plain, scaled


def residual_chain(n_layers: int, dtype):
    """A residual stream read at every layer, `x <- x * w + x` and a sum of tanh(x), on 64 x
    64 data of `dtype` at scale 1: (the scalified function, ws, x). A new function per call
    (jax.jit caches its traces per function)."""
    def f(ws, x):
        total = 0.0
        for w in ws:
            x = x * w + x
            total = total + jnp.tanh(x.astype(jnp.float32)).sum()
        return total

    ws = [scalify.scaled_array(np.full((64, 64), 0.5 + i / 8), 1.0, dtype=dtype) for i in range(n_layers)]
    return scalify.scalify(f), ws, scalify.scaled_array(np.ones((64, 64)), 1.0, dtype=dtype)


def _chain_size(n_layers: int, dtype, **config) -> int:
    fn, ws, x = residual_chain(n_layers, dtype)
    with scalify.ScalifyConfig(**config):
        return hlo_instruction_count(jax.jit(fn).lower(ws, x).compile())


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    lines = [
        "# Compiled size with and without the data barrier, CPU", "",
        f"`python benchmarks/data_barrier_cpu.py` on {datetime.date.today()}, {platform.machine()} "
        f"({jax.default_backend()}), jax {jax.__version__}. HLO instructions "
        "(`scalify.inspect.hlo_instruction_count`).", "",
        "| NanoGPT `tiny` step | plain | data barrier (default) | ratio | `data_barrier=False` | ratio "
        "| `scale_barrier=1` | `scale_barrier=2` | `scale_barrier=8` |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for recipe in ("fp8", "fp16"):
        plain, on = _step_size(recipe)
        _, off = _step_size(recipe, data_barrier=False)
        depths = [_step_size(recipe, scale_barrier=b)[1] for b in (1, 2, 8)]
        lines.append(f"| {recipe} | {plain:,} | {on:,} | {on / plain:.2f}x | {off:,} | {off / plain:.2f}x | "
                     + " | ".join(f"{d:,}" for d in depths) + " |")
        print(lines[-1], flush=True)
    lines += ["", "| residual chain | 4 layers: barrier | without | 8 layers: barrier | without |",
              "|---|---|---|---|---|"]
    for dtype in (jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn):
        sizes = [_chain_size(n, dtype, data_barrier=on) for n in (4, 8) for on in (True, False)]
        lines.append(f"| {jnp.dtype(dtype).name} | " + " | ".join(f"{s:,}" for s in sizes) + " |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return text


if __name__ == "__main__":
    print(main())
