"""Does the backend's float32 -> FP8 conversion round like ml_dtypes (round-to-nearest-even)?

    python tools/fp8_convert_probe.py

Prints, per FP8 format, how many of 2^20 random float32 values (and of the exact midpoints
between FP8 neighbours) come back differently from a jitted `astype(f8).astype(f32)` on
the default backend than from ml_dtypes on the host, and the same for the round trip
through `scalify.quant.widen`. A maintenance aid: XLA's GPU compiler folds the plain
convert pair away (no rounding at all); `widen` must not.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from scalify.quant import widen

rng = np.random.default_rng(0)
x = (rng.standard_normal(1 << 20) * rng.choice([1e-3, 1.0, 30.0], 1 << 20)).astype(np.float32)
for name in ("float8_e4m3fn", "float8_e5m2"):
    dt, jdt = getattr(ml_dtypes, name), getattr(jnp, name)
    grid = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)))
    grid = grid[np.isfinite(grid)]
    mids = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    cases = (("random", x, False), ("midpoints", mids, False),
             ("midpoints+1ulp", np.nextafter(mids, np.inf), False), ("random via widen", x, True))
    for label, v, via_widen in cases:
        host = v.astype(dt).astype(np.float32)
        up = (lambda q: widen(q, jnp.float32)) if via_widen else (lambda q: q.astype(jnp.float32))
        dev = np.asarray(jax.jit(lambda a, up=up: up(a.astype(jdt)))(v))
        bad = ~((host == dev) | (np.isnan(host) & np.isnan(dev)))
        print(f"{jax.default_backend()} {name} {label}: {int(bad.sum())} / {v.size} differ"
              + (f", e.g. {v[bad][:3]} -> device {dev[bad][:3]} host {host[bad][:3]}" if bad.any() else ""))
