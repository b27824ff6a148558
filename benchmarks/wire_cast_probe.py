"""Which form of "FP8 weight-gradient GEMM, then its value in bfloat16 for the wire" does
XLA compile to the GEMM alone? The kernels and time of small compiled programs that
quantise x (T, K) to E4M3 and g (T, N) to E5M2 with run-time power-of-two scales, lay them
out contracting-minor as scalify does (`fp8_operands_tn`), and return the (K, N) product
`x^T g` times run-time scalars, in bfloat16 (what a bfloat16 gradient all-reduce sends):

- `f32_two_scalars`: the f32 GEMM times 1/r (constant), times a range factor f and the
  output scale s (two run-time scalars), cast to bfloat16 (scalify's dot data, then the
  materialisation before the wire);
- `f32_one_scalar`: the f32 GEMM times the product f*s/r, cast to bfloat16;
- `f32_cast_then_scale`: the f32 GEMM times 1/r cast to bfloat16, then times f*s in bfloat16;
- `bf16_gemm_scale`: the GEMM written in bfloat16, times f*s/r in bfloat16;
- `bf16_gemm_f32_scale`: the GEMM written in bfloat16, times f*s in float32, cast back;
- `bf16_gemm_round_trip`: the GEMM written in bfloat16 and widened to float32 (a float32
  master weight's cotangent), cast back to bfloat16, then times f*s in bfloat16;
- `bf16_gemm_two_scalars`: the GEMM written in bfloat16, times f, widened to float32 and
  cast back, times s (f and s in bfloat16, one multiply each);
- `bf16_gemm_chain`: the GEMM written in bfloat16, times f then (after the round trip
  through float32) s, each a power of two applied in bfloat16 in two exact steps (scalify's
  dot data of a bfloat16 weight gradient, then its materialisation in bfloat16);
- `bf16_gemm_chain_f32_factor`: the same with f applied in float32 and cast back;
- `bf16_reference`: the bfloat16 GEMM of the unquantised operands (the plain step's dW).

    PYTHONPATH=$PWD python benchmarks/wire_cast_probe.py [--tokens 8192] [-v]

Prints per variant the ENTRY kernels (custom calls and fusions, with the shape each
writes), the number of them that write the (K, N) output or an array of its size, and the
median time of the compiled program (on the accelerator). `-v` prints the compiled HLO.
"""
from __future__ import annotations

import argparse
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify.ops.fp8 import E4M3, E5M2
from scalify.rules.linalg import fp8_operands_tn

F32, BF16 = jnp.float32, jnp.bfloat16
# dW = x^T g: contract the token dim of both.
DN = (((0,), (0,)), ((), ()))


def _quantize(v, s, dtype):
    m = float(jnp.finfo(dtype).max)
    return jnp.clip(v.astype(F32) / s, -m, m).astype(dtype)


def _fp8_gemm(x, g, sx, sg, out_dtype):
    qx, qg = _quantize(x, sx, E4M3), _quantize(g, sg, E5M2)
    a, b, dn = fp8_operands_tn(qx, qg, DN, mode="barrier")
    return lax.dot_general(a, b, dn, preferred_element_type=out_dtype)


def variants(r: float):
    inv_r = np.float32(1.0 / r)

    def f32_two_scalars(x, g, sx, sg, f, s):
        d = _fp8_gemm(x, g, sx, sg, F32) * inv_r * f
        return (d * s).astype(BF16)

    def f32_one_scalar(x, g, sx, sg, f, s):
        return (_fp8_gemm(x, g, sx, sg, F32) * (f * s * inv_r)).astype(BF16)

    def f32_cast_then_scale(x, g, sx, sg, f, s):
        return (_fp8_gemm(x, g, sx, sg, F32) * inv_r).astype(BF16) * (f * s).astype(BF16)

    def bf16_gemm_scale(x, g, sx, sg, f, s):
        return _fp8_gemm(x, g, sx, sg, BF16) * (f * s * inv_r).astype(BF16)

    def bf16_gemm_f32_scale(x, g, sx, sg, f, s):
        d = (_fp8_gemm(x, g, sx, sg, BF16) * inv_r.astype(BF16)).astype(F32)
        return (d * (f * s)).astype(BF16)

    def bf16_gemm_round_trip(x, g, sx, sg, f, s):
        d = (_fp8_gemm(x, g, sx, sg, BF16) * inv_r.astype(BF16)).astype(F32)
        return d.astype(BF16) * (f * s).astype(BF16)

    def _times_pow2(d, v):
        """d times the power of two v in d's dtype, in two exact steps (v = lo * hi with
        hi = max(v, 2^-126) and lo = v / hi representable in bfloat16)."""
        hi = jnp.maximum(v, np.float32(2.0**-126))
        return (d * (v / hi).astype(d.dtype)) * hi.astype(d.dtype)

    def bf16_gemm_two_scalars(x, g, sx, sg, f, s):
        d = _fp8_gemm(x, g, sx, sg, BF16) * inv_r.astype(BF16) * f.astype(BF16)
        return d.astype(F32).astype(BF16) * s.astype(BF16)

    def bf16_gemm_chain(x, g, sx, sg, f, s):
        d = _times_pow2(_fp8_gemm(x, g, sx, sg, BF16) * inv_r.astype(BF16), f)
        return _times_pow2(d.astype(F32).astype(BF16), s)

    def bf16_gemm_chain_f32_factor(x, g, sx, sg, f, s):
        d = ((_fp8_gemm(x, g, sx, sg, BF16) * inv_r.astype(BF16)).astype(F32) * f).astype(BF16)
        return _times_pow2(d.astype(F32).astype(BF16), s)

    def bf16_reference(x, g, sx, sg, f, s):
        return lax.dot_general(x, g, DN, preferred_element_type=BF16)

    return {fn.__name__: fn for fn in (f32_two_scalars, f32_one_scalar, f32_cast_then_scale, bf16_gemm_scale,
                                       bf16_gemm_f32_scale, bf16_gemm_round_trip, bf16_gemm_two_scalars, bf16_gemm_chain,
                                       bf16_gemm_chain_f32_factor, bf16_reference)}


_KERNEL = re.compile(r"^\s+(?:ROOT )?%(\S+) = (\S+|\([^=]*?\)) (fusion|custom-call)\((.*)$")


def kernels(text: str):
    """[(name, written shape, custom-call target or fusion kind)] of the ENTRY computation."""
    entry = re.search(r"\nENTRY [^\n]*\{\n(.*?)\n\}", text, re.S).group(1)
    out = []
    for line in entry.splitlines():
        m = _KERNEL.match(line)
        if m is None:
            continue
        target = re.search(r'custom_call_target="([^"]+)"', line)
        kind = re.search(r"kind=(k\w+)", line)
        out.append((m.group(1), m.group(2), target.group(1) if target else kind.group(1) if kind else "?"))
    return out


def _writes_output(shape: str, k: int, n: int) -> bool:
    dims = re.findall(r"[a-z0-9]+\[([0-9,]*)\]", shape)
    return any(d and int(np.prod([int(v) for v in d.split(",")])) == k * n for d in dims)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--n", type=int, default=3072)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--batches", type=int, default=7)
    p.add_argument("-v", action="store_true")
    a = p.parse_args(argv)
    t, k, n = a.tokens, a.k, a.n
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((t, k)), BF16)
    g = jnp.asarray(rng.standard_normal((t, n)) * 1e-3, BF16)
    sx, sg = jnp.float32(2.0**-7), jnp.float32(2.0**-20)
    f, s = jnp.float32(1.0), jnp.float32(2.0**-27)
    r = float(2 ** round(np.log2(np.sqrt(t))))
    args = (x, g, sx, sg, f, s)
    dev = jax.devices()[0]
    print(f"# {dev.device_kind} jax {jax.__version__}: x ({t}, {k}) E4M3, g ({t}, {n}) E5M2 -> ({k}, {n}) bfloat16")
    ref = None
    for name, fn in variants(r).items():
        compiled = jax.jit(fn).lower(*args).compile()
        text = compiled.as_text()
        ks = kernels(text)
        big = [kk for kk in ks if _writes_output(kk[1], k, n)]
        out = compiled(*args)
        out.block_until_ready()
        times = []
        for _ in range(a.batches):
            t0 = time.perf_counter()
            for _ in range(a.iters):
                out = compiled(*args)
            out.block_until_ready()
            times.append((time.perf_counter() - t0) / a.iters)
        if name == "f32_two_scalars":
            ref = np.asarray(out, np.float32)
        diff = float(np.max(np.abs(np.asarray(out, np.float32) - ref))) if name != "bf16_reference" else float("nan")
        print(f"{name}: {len(ks)} kernels, {len(big)} write a ({k}, {n})-sized array, "
              f"{statistics.median(times) * 1e6:.1f} us, max |diff| vs f32_two_scalars {diff:.3g}")
        for kk in ks:
            print(f"    {kk[0]}: {kk[1]} {kk[2]}")
        if a.v:
            print(text)


if __name__ == "__main__":
    main()
