"""scale_health on a small Llama-style float16 model: the injected overflow is found at its
line, in its phase, with the rows that led there, in seconds.

The model is written here by hand: RMSNorm (statistics in float32), RoPE, causal attention
with a `finfo(float16).min` additive mask and a float32 softmax, a SwiGLU MLP
(`nn.silu(g) * u`), trained with optax Adam from float32 master weights entered as
ScaledArrays. Each overflow is injected with `exp` of a value near 2^14: a value beyond
every float format, so it overflows whatever scales the rules choose (a product that only
overflows float16 data is absorbed by the scales; scalify's point). The backward one is in
the gradient of a custom_vjp identity: JAX gives the equations of a backward pass the
traceback of the forward call they differentiate, so its line is that call, `[backward]`.
"""
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import nn

import scalify
from scalify.inspect import scale_health

F16 = jnp.float16
VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ, BATCH = 64, 64, 4, 128, 2, 16, 4
# The wall time scale_health may take on this model on a CPU. Measured on two shared cores:
# 11.5 s for the first call in a fresh process (compiling each eager primitive once), 0.9 s
# for later calls, and 41 s for a first call on cores shared with three other test runs;
# the previous implementation, which compiled the whole step with a statistic and a
# callback per equation, took 99 s (192 s under load). 60 s keeps the test failing on that
# implementation with room for a loaded machine.
MAX_SECONDS = 60.0


def init_params(key):
    keys = iter(jax.random.split(key, 4 + 8 * LAYERS))

    def normal(shape, std):
        return jax.random.normal(next(keys), shape, jnp.float32) * std

    layers = [{
        "attn_norm": jnp.ones((DIM,)), "mlp_norm": jnp.ones((DIM,)),
        "wq": normal((DIM, DIM), DIM**-0.5), "wk": normal((DIM, DIM), DIM**-0.5),
        "wv": normal((DIM, DIM), DIM**-0.5), "wo": normal((DIM, DIM), DIM**-0.5),
        "wg": normal((DIM, HIDDEN), DIM**-0.5), "wu": normal((DIM, HIDDEN), DIM**-0.5),
        "wd": normal((HIDDEN, DIM), HIDDEN**-0.5),
    } for _ in range(LAYERS)]
    return {"embed": normal((VOCAB, DIM), 1.0), "layers": layers, "norm": jnp.ones((DIM,)),
            "head": normal((DIM, VOCAB), DIM**-0.5)}


def rms_norm(x, w):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
    return y.astype(F16) * w.astype(F16)


def rope(x):  # [batch, time, heads, head_dim]
    d = x.shape[-1]
    angles = np.arange(x.shape[1])[:, None] / (10000.0 ** (np.arange(0, d, 2) / d))[None, :]
    cos = jnp.asarray(np.cos(angles), F16)[None, :, None]
    sin = jnp.asarray(np.sin(angles), F16)[None, :, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


def attention(x, p):
    b, t, _ = x.shape
    heads = lambda y: y.reshape(b, t, HEADS, DIM // HEADS)  # noqa: E731
    q = rope(heads(x @ p["wq"].astype(F16)))
    k = rope(heads(x @ p["wk"].astype(F16)))
    v = heads(x @ p["wv"].astype(F16))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.float16(np.sqrt(DIM // HEADS))
    causal = jnp.tril(jnp.ones((t, t), bool))
    logits = logits + jnp.where(causal, 0.0, jnp.finfo(F16).min).astype(F16)
    probs = nn.softmax(logits.astype(jnp.float32), axis=-1).astype(F16)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, DIM) @ p["wo"].astype(F16)


@jax.custom_vjp
def overflow_gradient(x):
    return x


def _overflow_gradient_fwd(x):
    return x, None


def _overflow_gradient_bwd(_, g):
    return (jnp.exp(g * 2.0**14),)


overflow_gradient.defvjp(_overflow_gradient_fwd, _overflow_gradient_bwd)


def mlp(x, p, inject):
    g = x @ p["wg"].astype(F16)
    u = x @ p["wu"].astype(F16)
    if inject == "forward":
        u = jnp.exp(u * 2.0**14)  # INJECTED FORWARD OVERFLOW
    if inject == "backward":
        u = overflow_gradient(u)  # INJECTED BACKWARD OVERFLOW (in the gradient of u)
    return (nn.silu(g) * u) @ p["wd"].astype(F16)


def loss_fn(params, tokens, inject):
    x = params["embed"].astype(F16)[tokens[:, :-1]]
    for i, p in enumerate(params["layers"]):
        x = x + attention(rms_norm(x, p["attn_norm"]), p)
        x = x + mlp(rms_norm(x, p["mlp_norm"]), p, inject if i == 1 else None)
    logits = (rms_norm(x, params["norm"]) @ params["head"].astype(F16)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


OPT = optax.adam(1e-3)


def train_step(params, opt_state, tokens, inject=None):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, inject)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _line_of(marker: str) -> str:
    """`file:line` of the line of this file that holds `marker`."""
    with open(__file__) as f:
        line = next(i for i, text in enumerate(f, start=1) if marker in text and "_line_of(" not in text)
    return f"{os.path.abspath(__file__)}:{line}"


@pytest.fixture(scope="module")
def model():
    params = init_params(jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (BATCH, SEQ + 1), 0, VOCAB)
    return scalify.as_scaled_array(params), OPT.init(params), tokens


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_the_injected_overflow_is_found_at_its_line_and_phase_in_seconds(model, phase):
    params, opt_state, tokens = model
    start = time.perf_counter()
    (new_params, _, loss), report = scale_health(train_step, params, opt_state, tokens, phase)
    seconds = time.perf_counter() - start
    text = str(report)
    # The overflow reached the outputs: the loss (forward) or the updated weights (backward).
    assert np.isfinite(float(loss)) == (phase == "backward") and report.outputs_nonfinite
    assert not np.isfinite(new_params["layers"][0]["wg"].to_array()).all()
    first = report.first_out_of_range()
    assert first is not None, text
    line = _line_of(f"INJECTED {phase.upper()} OVERFLOW")
    assert first.source.startswith(line + " "), (line, text)
    assert first.phase == phase and first.primitive == "exp" and "nonfinite" in first.flags, text
    assert f"first data out of range: #{first.index} exp [{phase}] at {line}" in text
    # The rows that led there: the multiply by 2^14 on the same line, whose data are finite
    # and in range (the factor went into the scale), and the matmul before it.
    chain = report.chain(first)
    assert chain and chain[0][1].source.startswith(line + " ") and chain[0][1].primitive == "mul", text
    assert chain[0][1].nonfinite == 0 and chain[0][1].log2_amax < 16, text
    assert all(r.phase == phase for _, r in chain[:2]), text
    assert "how the data got there" in text and f"#{chain[0][1].index} mul [{phase}]" in text
    # Forward, backward and optimizer rows are all there, in that order.
    phases = [r.phase for r in report.rows]
    assert phases.index("backward") > phases.index("forward") and "optimizer" in phases
    assert phases.index("optimizer") > max(i for i, p in enumerate(phases) if p == "backward")
    assert seconds < MAX_SECONDS, f"scale_health took {seconds:.1f} s (limit {MAX_SECONDS} s)"


def test_without_injection_nothing_is_out_of_range(model):
    """The `finfo.min` mask and everything else of the healthy step stay in range."""
    params, opt_state, tokens = model
    (_, _, loss), report = scale_health(train_step, params, opt_state, tokens)
    assert np.isfinite(float(loss)) and not report.outputs_nonfinite
    assert report.first_out_of_range() is None, str(report)
    assert "first data out of range" not in str(report)
    # The user's lines are named, not JAX's: the silu inside jax.nn (a jitted library
    # function) is reported at the model's line that calls it.
    silu = [r for r in report.rows if r.primitive == "logistic"]
    assert silu and all(r.source.startswith(_line_of("return (nn.silu(g) * u)") + " ") for r in silu)
    assert not any("inside a JAX library function" in r.source for r in report.rows)
