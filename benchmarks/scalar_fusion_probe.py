"""Does XLA fuse a chain of scalar ops into the kernel that reads its result? The kernels
of small compiled programs where a max-reduction over a (8192, 1024) array feeds a scalar
chain that an elementwise kernel over another such array reads:

- `divide_only`: one division; `float_chain`: a square root and a division;
- `bits_chain`: the same values from the float bits (exponent halving, 1/s);
- `clear_mantissa_chain`: the power of two below the max (3 bit ops) times a scalar;
- `long_float_chain`: a dozen float ops (clamps, selects, compares; no division);
- `two_reductions_float`: a short float chain over two reductions;
- `two_consumers_*`: `float_chain` / `bits_chain` read by two kernels.

    PYTHONPATH=$PWD python benchmarks/scalar_fusion_probe.py [-v]

Prints per variant the number of kernels (fusions and custom calls of the ENTRY
computation) and how many of them write only scalars; `-v` prints the compiled HLO.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from kernel_classes import entry_lines, is_scalar_shape


def _kernels(compiled) -> tuple[int, int]:
    entry = "\n".join(entry_lines(compiled.as_text()))
    shapes = re.findall(r"^\s+(?:ROOT )?%\S+ = (\S+|\([^=]*?\)) (?:fusion|custom-call)\(", entry, re.M)
    return len(shapes), sum(is_scalar_shape(s) for s in shapes)


def _exp2_floor_half_log2(y):
    """2^floor(log2(sqrt(y))) for a positive normal float32 y, from the bits."""
    e = lax.shift_right_logical(lax.bitcast_convert_type(y, jnp.int32), np.int32(23)) - np.int32(127)
    h = lax.shift_right_arithmetic(e, np.int32(1))
    return lax.bitcast_convert_type(lax.shift_left(h + np.int32(127), np.int32(23)), jnp.float32)


def _recip_pow2(s):
    """1/s for a float32 power of two s in [2^-126, 2^126], from the bits."""
    return lax.bitcast_convert_type(np.int32(254 << 23) - lax.bitcast_convert_type(s, jnp.int32), jnp.float32)


def variants():
    def float_chain(x, y, s):
        m = jnp.max(jnp.square(x.astype(jnp.float32)))
        f = jnp.sqrt(m) / s
        return (y.astype(jnp.float32) * f).astype(jnp.float16)

    def bits_chain(x, y, s):
        m = jnp.max(jnp.square(x.astype(jnp.float32)))
        f = _exp2_floor_half_log2(m) * _recip_pow2(s)
        return (y.astype(jnp.float32) * f).astype(jnp.float16)

    def divide_only(x, y, s):
        m = jnp.max(jnp.abs(x.astype(jnp.float32)))
        f = m / s
        return (y.astype(jnp.float32) * f).astype(jnp.float16)

    def two_consumers_bits(x, y, s):
        m = jnp.max(jnp.square(x.astype(jnp.float32)))
        f = _exp2_floor_half_log2(m) * _recip_pow2(s)
        a = (y.astype(jnp.float32) * f).astype(jnp.float16)
        b = jnp.sum(y.astype(jnp.float32) * f, axis=0)
        return a, b

    def two_consumers_float(x, y, s):
        m = jnp.max(jnp.square(x.astype(jnp.float32)))
        f = jnp.sqrt(m) / s
        a = (y.astype(jnp.float32) * f).astype(jnp.float16)
        b = jnp.sum(y.astype(jnp.float32) * f, axis=0)
        return a, b

    def clear_mantissa_chain(x, y, s):
        m = jnp.max(jnp.abs(x.astype(jnp.float32)))
        bits = lax.bitcast_convert_type(m, jnp.uint32) & np.uint32(0xFF800000)
        f = lax.bitcast_convert_type(bits, jnp.float32) * s
        return (y.astype(jnp.float32) * f).astype(jnp.float16)

    def long_float_chain(x, y, s):
        m = jnp.max(jnp.abs(x.astype(jnp.float32)))
        ok = jnp.isfinite(m) & (m > 0)
        f = jnp.where(ok, m, 1.0)
        for k in range(6):
            f = jnp.clip(f * s + np.float32(k), 2.0**-126, 2.0**126)
            f = jnp.where(f > 2.0**k, f * 0.5, f)
        return (y.astype(jnp.float32) * f).astype(jnp.float16)

    def two_reductions_float(x, y, s):
        m1 = jnp.max(jnp.abs(x.astype(jnp.float32)))
        m2 = jnp.max(jnp.abs(y.astype(jnp.float32)), axis=1)
        m2 = jnp.max(m2)
        f = jnp.clip(m1 * m2 * s, 2.0**-126, 2.0**126)
        f = jnp.where(jnp.isfinite(f) & (f > 0), f, 1.0)
        return (y.astype(jnp.float32) * f).astype(jnp.float16)

    return dict(clear_mantissa_chain=clear_mantissa_chain, long_float_chain=long_float_chain,
                two_reductions_float=two_reductions_float, float_chain=float_chain, bits_chain=bits_chain, divide_only=divide_only,
                two_consumers_float=two_consumers_float, two_consumers_bits=two_consumers_bits)


def main(verbose: bool = False) -> None:
    x = jnp.ones((8192, 1024), jnp.float16)
    y = jnp.ones((8192, 1024), jnp.float16)
    s = jnp.float32(4.0)
    import os
    print(jax.devices()[0].device_kind, "jax", jax.__version__, "XLA_FLAGS:", os.environ.get("XLA_FLAGS", ""))
    for name, fn in variants().items():
        compiled = jax.jit(fn).lower(x, y, s).compile()
        n, k = _kernels(compiled)
        print(f"{name}: {n} kernels, {k} with scalar outputs")
        if verbose:
            text = compiled.as_text()
            print(re.sub(r", metadata=\{[^}]*\}", "", text))


if __name__ == "__main__":
    import sys
    main("-v" in sys.argv)
