"""No worse than plain low precision, op by op: float16 and bfloat16 data from 2^-8 to
2^12 (float16's top is 2^16) at scales from 2^-20 to 2^8, through the operations a model is made of. Wherever plain JAX computing the
same values in that dtype gives a finite result, scalify gives a finite one, and its error
against float32 on the same values is at most twice plain's plus two ulps of the dtype
(the rules compute in float32 and round once; plain rounds per op). Where plain overflows
and float32 does not, scalify gives every value, within two ulps of the largest.

One compile per operation and dtype: the data and the scale are run-time arguments.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import scalify

OPS = {
    "add": lambda x, y: x + y,
    "sub": lambda x, y: x - y,
    "mul": lambda x, y: x * y,
    "div": lambda x, y: x / (jnp.abs(y) + y.dtype.type(1) * jnp.abs(y).max()),
    "max": lambda x, y: jnp.maximum(x, y),
    "sum": lambda x, y: jnp.sum(x, axis=-1),
    "cumsum": lambda x, y: jnp.cumsum(x, axis=-1),
    "square": lambda x, y: x * x,
    "cube": lambda x, y: x**3,
    "sqrt": lambda x, y: jnp.sqrt(jnp.abs(x)),
    "dot": lambda x, y: x @ y.T,
    "mean_square": lambda x, y: jnp.mean(x * x, axis=-1),
    "rms_norm": lambda x, y: x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * y,
    "softmax": lambda x, y: jax.nn.softmax(x),
    "masked_softmax": lambda x, y: jax.nn.softmax(jnp.where(y > 0, x, jnp.finfo(x.dtype).min)),
    "logsumexp": lambda x, y: jax.nn.logsumexp(x, axis=-1),
    "silu_gate": lambda x, y: jax.nn.silu(x) * y,
    "gelu_gate": lambda x, y: jax.nn.gelu(x) * y,
    "tanh": lambda x, y: jnp.tanh(x),
}
DATA_EXPONENTS = (-8, 0, 8, 12)
SCALE_EXPONENTS = (-20, -8, 0, 8)


def _as_float32(x):
    if isinstance(x, scalify.ScaledArray):
        x = x.to_array(jnp.float32)
    return np.asarray(x, np.float32)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_no_worse_than_plain_low_precision(name, dtype):
    f = OPS[name]
    scaled = jax.jit(scalify.scalify(f))
    plain, exact = jax.jit(f), jax.jit(lambda x, y: f(x.astype(jnp.float32), y.astype(jnp.float32)))
    rng = np.random.default_rng(0)
    eps = float(jnp.finfo(dtype).eps)
    for ed in DATA_EXPONENTS:
        for es in SCALE_EXPONENTS:
            dx = jnp.asarray(rng.normal(size=(8, 64)) * 2.0**ed, dtype)
            dy = jnp.asarray(rng.normal(size=(8, 64)) * 2.0**ed, dtype)
            s = np.float32(2.0**es)
            # the values in float32 (the reference), and rounded to the dtype as plain JAX
            # holds them
            fx, fy = (jnp.asarray(np.asarray(d, np.float32) * s) for d in (dx, dy))
            vx, vy = fx.astype(dtype), fy.astype(dtype)
            if not (jnp.isfinite(vx).all() and jnp.isfinite(vy).all()):
                continue
            ref = _as_float32(exact(fx, fy))
            low = _as_float32(plain(vx, vy))
            out = _as_float32(scaled(scalify.scaled_array(dx, s), scalify.scaled_array(dy, s)))
            where = f"{name} {jnp.dtype(dtype).name} data 2^{ed} scale 2^{es}"
            live = np.isfinite(ref)
            if (live & ~np.isfinite(low)).any():
                # plain overflowed where float32 did not: scalify must give every value
                # float32 gives, to the dtype's precision relative to the largest (one
                # scale per tensor holds a range of 2^40 in float16 below its maximum)
                assert np.isfinite(out[live]).all(), f"{where}: non-finite where float32 is finite"
                err = np.abs(out[live] - ref[live]).max() / np.abs(ref[live]).max()
                assert err <= 2 * eps, f"{where}: error {err:.2e} of the largest value"
                continue
            ok = np.isfinite(low)
            assert np.isfinite(out[ok]).all(), f"{where}: non-finite where plain is finite"
            top = np.abs(ref[ok]).max() if ok.any() else 0.0
            if top == 0:
                continue
            err_plain = np.abs(low[ok] - ref[ok]).max() / top
            err = np.abs(out[ok] - ref[ok]).max() / top
            assert err <= 2 * err_plain + 2 * eps, f"{where}: error {err:.2e}, plain's {err_plain:.2e}"
