"""Tracing cost of one scale-arithmetic op: a jnp operator against the lax primitive that
`scalify.core.lax_utils` binds in its place (the reason those helpers exist).

    python benchmarks/trace_op_cost.py --out benchmarks/results   # CPU is fine: nothing runs

Each case chains N ops inside `jax.make_jaxpr` on a float16 (4, 8) array and a float32
scalar, in a fresh Python process per case and run (JAX's caches would otherwise carry
over from one case to the next); the time per op is the fastest of `--repeats` runs
divided by N. Writes `trace_op_cost.md`.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

CASES = {
    "jnp: x * s.astype(x.dtype)": "x * s.astype(x.dtype)",
    "lax: lax.mul(x, lax.convert_element_type(s, x.dtype))": "lax.mul(x, lax.convert_element_type(s, x.dtype))",
    "lax_utils: mul(x, astype(s, x.dtype))": "L.mul(x, L.astype(s, x.dtype))",
}


def _one_run(expr: str, n: int) -> float:
    """Seconds to trace N chained `expr` (runs in the worker process)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from scalify.core import lax_utils as L

    f = eval(f"lambda x, s: {expr}", {"lax": lax, "L": L})  # noqa: S307 - the fixed CASES

    def chain(x, s):
        for _ in range(n):
            x = f(x, s)
        return x

    t0 = time.perf_counter()
    jax.make_jaxpr(chain)(jnp.ones((4, 8), jnp.float16), jnp.float32(2))
    return time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        print(_one_run(CASES[a.worker], a.n))
        return
    import jax

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]))
    lines = ["# Tracing cost of one scale-arithmetic op", "",
             f"`python benchmarks/trace_op_cost.py --n {a.n} --repeats {a.repeats}` on "
             f"{platform.machine()} ({jax.default_backend()}), jax {jax.__version__}; one fresh "
             "process per case and run, fastest run.", "",
             "| case | us per op (trace) |", "|---|---|"]
    for name in CASES:
        runs = [float(subprocess.run([sys.executable, __file__, "--n", str(a.n), "--worker", name], env=env,
                                     check=True, capture_output=True, text=True).stdout.split()[-1])
                for _ in range(a.repeats)]
        lines.append(f"| `{name}` | {1e6 * min(runs) / a.n:.1f} |")
    text = "\n".join(lines) + "\n"
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "trace_op_cost.md"), "w") as fh:
            fh.write(text)
    print(text)


if __name__ == "__main__":
    main()
