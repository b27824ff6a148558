"""Differential property test: random programs, scalified against plain JAX.

Each program is a short chain of elementwise / select / reduction / dot operations on an
input with a power-of-two scale from 2^-40 to 2^40, with constants drawn across the whole
range of the dtype (smallest subnormal to finfo.max, finfo.min masks, tiny epsilons). The
reference is the same program evaluated in float64 by NumPy.

- Always: no NaN where plain JAX has none.
- float32: the scalified result equals plain JAX (1e-5 relative) wherever plain JAX gets
  the float64 answer, for every program whose intermediate values plain float32 holds as
  normal numbers (a program that under- or overflows in plain float32 is outside the
  contract: scalify may keep values there that plain JAX loses, or lose the ones placed
  next to them).
- float16 / bfloat16: on the same programs, no element is grossly wrong (relative error
  > 2^-3: a flushed, saturated or NaN value) where plain JAX in the same dtype is right.
  The threshold sits far above the rounding noise of a few operations (2^-11 and 2^-8 per
  rounding), which differs between two correct evaluation orders, so only real failures
  count.

Examples are derandomized: the suite is deterministic.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scalify

SHAPE = (4, 8)
_W = np.random.RandomState(1).randn(8, 8).astype(np.float32) / np.float32(3.0)
_OPS = ["mul", "div", "add", "sub", "rsub", "where", "maximum", "minimum", "clip", "abs",
        "square", "sqrt", "dot", "softmax", "tanh", "mean_var_norm"]  # fmt: skip
_FINAL = ["none", "sum", "mean", "max", "logsumexp"]


def _constants(dtype):
    fi = ml_dtypes.finfo(dtype)
    special = [float(fi.smallest_subnormal), float(fi.tiny), float(fi.eps), 1e-7, 1e-5, 1e-3,
               0.5, 1.0, 3.0, 1e4, float(fi.max), float(fi.min), -float(fi.tiny)]  # fmt: skip
    lo, hi = np.log2(float(fi.smallest_subnormal)), np.log2(float(fi.max))
    log_uniform = st.tuples(st.floats(lo, hi), st.sampled_from([-1.0, 1.0])).map(
        lambda t: t[1] * float(2.0 ** t[0])
    )
    return st.one_of(st.sampled_from(special), log_uniform).map(lambda c: float(np.asarray(c, dtype)))


def _program(dtype):
    op = st.tuples(st.sampled_from(_OPS), _constants(dtype))
    return st.tuples(st.lists(op, min_size=1, max_size=4), st.sampled_from(_FINAL))


def _apply(xp, ops, final, x, dtype, trail=None):
    """The program on x with `xp` = jnp (plain JAX, in `dtype`) or np (float64 reference);
    `trail` (a list) collects the value after each operation."""
    def const(c):
        return c if xp is np else jnp.asarray(c, dtype)

    w = _W.astype(np.float64) if xp is np else jnp.asarray(_W, dtype)
    for name, c in ops:
        c = const(c)
        if name == "mul":
            x = x * c
        elif name == "div":
            x = x / c
        elif name == "add":
            x = x + c
        elif name == "sub":
            x = x - c
        elif name == "rsub":
            x = c - x
        elif name == "where":
            x = xp.where(x > 0, x, c)
        elif name == "maximum":
            x = xp.maximum(x, c)
        elif name == "minimum":
            x = xp.minimum(x, c)
        elif name == "clip":
            x = xp.clip(x, -xp.abs(c), xp.abs(c))
        elif name == "abs":
            x = xp.abs(x)
        elif name == "square":
            x = x * x
        elif name == "sqrt":
            x = xp.sqrt(xp.abs(x))
        elif name == "dot":
            x = x @ w
        elif name == "softmax":
            m = xp.max(x, axis=-1, keepdims=True)
            e = xp.exp(x - m)
            x = e / xp.sum(e, axis=-1, keepdims=True)
        elif name == "tanh":
            x = xp.tanh(x)
        elif name == "mean_var_norm":  # a hand-written LayerNorm with a small epsilon
            m = xp.mean(x, axis=-1, keepdims=True)
            v = xp.mean((x - m) ** 2, axis=-1, keepdims=True)
            x = (x - m) / xp.sqrt(v + const(1e-5))
        if trail is not None:
            trail.append(x)
    if final == "sum":
        x = xp.sum(x, axis=-1)
    elif final == "mean":
        x = xp.mean(x, axis=-1)
    elif final == "max":
        x = xp.max(x, axis=-1)
    elif final == "logsumexp":
        m = xp.max(x, axis=-1, keepdims=True)
        m = xp.where(xp.isfinite(m), m, 0)
        x = xp.log(xp.sum(xp.exp(x - m), axis=-1)) + m[..., 0]
    return x


def _errors(out, ref):
    """Relative error per element against the float64 reference (inf where the output is
    not finite but the reference is, 0 where both are the same non-finite value)."""
    out = np.asarray(out, np.float64)
    with np.errstate(all="ignore"):
        err = np.abs(out - ref) / np.maximum(np.abs(ref), np.finfo(np.float64).tiny)
    same_special = ~np.isfinite(ref) & ((out == ref) | (np.isnan(out) & np.isnan(ref)))
    err = np.where(same_special, 0.0, err)
    return np.where(np.isnan(err), np.inf, err)


def _run(ops, final, log2_scale, seed, dtype, jit):
    rng = np.random.RandomState(seed)
    data = rng.randn(*SHAPE).astype(np.float32)
    scale = np.float32(2.0**log2_scale)
    xs = scalify.scaled_array(data.astype(dtype), scale)
    fn = lambda x: _apply(jnp, ops, final, x, dtype)  # noqa: E731
    sfn = scalify.scalify(fn)
    out = (jax.jit(sfn) if jit else sfn)(xs)
    out = np.asarray(scalify.asarray(out), np.float64) if isinstance(out, scalify.ScaledArray) \
        else np.asarray(out, np.float64)
    x_plain = xs.to_array(dtype)
    plain = np.asarray((jax.jit(fn) if jit else fn)(x_plain), np.float64)
    x64 = data.astype(dtype).astype(np.float64) * np.float64(scale)
    trail = [x64]
    with np.errstate(all="ignore"):
        ref = np.asarray(_apply(np, ops, final, x64, dtype, trail), np.float64)
    fi = ml_dtypes.finfo(dtype)
    # Two correct summation orders of the final reduction differ by up to n * eps * sum|x|:
    # where the terms cancel (a sum of normalised values) that is the whole answer.
    order_noise = 0.0
    if final in ("sum", "mean", "logsumexp"):
        terms = np.abs(trail[-1]) if final != "logsumexp" else np.ones_like(trail[-1])
        with np.errstate(all="ignore"):
            order_noise = SHAPE[-1] * float(fi.eps) * np.max(np.where(np.isfinite(terms), terms, 0))
    in_range = all(
        np.all((t == 0) | ((np.abs(t) >= float(fi.tiny)) & (np.abs(t) <= float(fi.max)))) for t in trail
    )
    return out, plain, ref, in_range, order_noise


_SETTINGS = dict(
    derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)


def _new_nans(out, plain):
    return np.isnan(out) & ~np.isnan(plain)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@settings(max_examples=40, **_SETTINGS)
@given(program=_program(np.float32), log2_scale=st.integers(-40, 40), seed=st.integers(0, 3))
def test_float32_equals_plain(program, log2_scale, seed, jit):
    ops, final = program
    out, plain, ref, in_range, order_noise = _run(ops, final, log2_scale, seed, np.float32, jit)
    where = f"{ops} {final} scale=2^{log2_scale}"
    assert out.shape == plain.shape
    assert not _new_nans(out, plain).any(), f"NaN where plain has none: {where}"
    if not in_range:
        return  # plain float32 itself under- or overflowed on the way: outside the contract
    plain_ok = _errors(plain, ref) <= 1e-4  # plain float32 got the float64 answer here
    with np.errstate(all="ignore"):
        close = np.abs(out - plain) <= 1e-5 * np.abs(plain) + order_noise
    same = (out == plain) | (np.isnan(out) & np.isnan(plain))
    bad = plain_ok & ~(close | same)
    assert not bad.any(), (
        f"scalified != plain where plain is right: {where}\n"
        f"out={out[bad][:4]} plain={plain[bad][:4]} ref={ref[bad][:4]}"
    )


@pytest.mark.parametrize("dtype", [np.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
@settings(max_examples=30, **_SETTINGS)
@given(data=st.data(), log2_scale=st.integers(-40, 40), seed=st.integers(0, 3))
def test_low_precision_no_worse_than_plain(dtype, data, log2_scale, seed):
    ops, final = data.draw(_program(dtype))
    out, plain, ref, in_range, _ = _run(ops, final, log2_scale, seed, dtype, jit=True)
    where = f"{ops} {final} scale=2^{log2_scale} {np.dtype(dtype).name}"
    assert not _new_nans(out, plain).any(), f"NaN where plain has none: {where}"
    if not in_range:
        return
    gross = 2.0**-3
    bad = (_errors(out, ref) > gross) & (_errors(plain, ref) <= gross)
    assert not bad.any(), (
        f"scalified grossly wrong where plain is right: {where}\n"
        f"out={out[bad][:4]} plain={plain[bad][:4]} ref={ref[bad][:4]}"
    )
