"""Does the backend's float32 -> FP8 conversion round like ml_dtypes (round-to-nearest-even)?

    python tools/fp8_convert_probe.py

Prints, per FP8 format, how many of 2^20 random float32 values (and of the exact midpoints
between FP8 neighbours) convert differently on the default backend than with ml_dtypes on
the host. A maintenance aid: GPU backends may convert through float16 (double rounding).
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

rng = np.random.default_rng(0)
x = (rng.standard_normal(1 << 20) * rng.choice([1e-3, 1.0, 30.0], 1 << 20)).astype(np.float32)
for name in ("float8_e4m3fn", "float8_e5m2"):
    dt = getattr(ml_dtypes, name)
    grid = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)))
    grid = grid[np.isfinite(grid)]
    mids = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    for label, v in (("random", x), ("midpoints", mids), ("midpoints+1ulp", np.nextafter(mids, np.inf))):
        host = v.astype(dt).astype(np.float32)
        dev = np.asarray(jax.jit(lambda a: a.astype(getattr(jnp, name)).astype(jnp.float32))(v))
        bad = ~((host == dev) | (np.isnan(host) & np.isnan(dev)))
        print(f"{jax.default_backend()} {name} {label}: {int(bad.sum())} / {v.size} differ"
              + (f", e.g. {v[bad][:3]} -> device {dev[bad][:3]} host {host[bad][:3]}" if bad.any() else ""))

# The same round trip through scalify.quant.widen (an optimization_barrier between the two
# converts) must round like the host.
from scalify.quant import widen  # noqa: E402

for name in ("float8_e4m3fn", "float8_e5m2"):
    dt = getattr(ml_dtypes, name)
    host = x.astype(dt).astype(np.float32)
    dev = np.asarray(jax.jit(lambda a: widen(a.astype(getattr(jnp, name)), jnp.float32))(x))
    print(f"{jax.default_backend()} {name} random via widen: {int((host != dev).sum())} / {x.size} differ")
