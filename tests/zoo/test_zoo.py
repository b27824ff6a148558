"""A differential model zoo: each architecture, written as its authors write it, trained by
the same step plainly and through `scalify` (tests/zoo/harness.py), under four checks.

Models (tests/zoo/models_linen.py, tests/zoo/models_nnx_eqx.py): Llama, GPT-2, BERT, a T5
encoder, ViT, ResNet (BatchNorm in train mode), ConvNeXt, MLP-Mixer, a top-k mixture of
experts, an LSTM language model and Gemma in Flax linen; Llama and MLP-Mixer in Flax NNX;
GPT-2 and ViT in Equinox. `STEPS` steps of `optax.adamw(LR)` on a fixed batch.

Checks (every threshold is relative to a plain-JAX run of the same model; none is a
number recorded from a previous run):

- `float32`: the scalified step equals the plain one. See `check_float32`.
- `fp16`: float16 compute trains like float32. See `check_fp16`.
- `fp8`: the FP8 swap under scalify is no further from float32 than the same swap run
  plainly. See `check_fp8`. On one model per way the swap reaches a layer (`FP8_MODELS`);
  not for Equinox (its layers have no hook for the FP8 swap).
- `tiny-loss`: float16 gradients of the loss times 2^-20 are float32's times 2^-20. See
  `check_tiny_loss`.

Checks that fail today are listed in `XFAIL` (strict: they must fail, so the list is
updated when the library is fixed).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from . import harness as H
from .models_linen import SPECS as LINEN
from .models_nnx_eqx import EQX_SPECS, NNX_SPECS

MODELS = {**{n: (H.LinenDriver, *s) for n, s in LINEN.items()},
          **{n: (H.NnxDriver, *s) for n, s in NNX_SPECS.items()},
          **{n: (H.EqxDriver, *s) for n, s in EQX_SPECS.items()}}
CHECKS = ("float32", "fp16", "tiny-loss", "fp8")  # fp16 and tiny-loss run one step program
# The FP8 swap replaces the dot_general of linen's Dense, DenseGeneral and Einsum (and
# NNX's hook); the rest of the model runs in float32, which the `float32` check covers on
# every model. So the `fp8` check runs on one model per way the swap reaches a layer: a
# plain Dense (gpt2), the DenseGeneral projections of Flax's attention (bert), DenseGeneral
# with several output or contracted axes (gemma), Einsum experts (moe), a Dense inside a
# scanned recurrent cell (lstm) and NNX's Linear (nnx-llama).
FP8_MODELS = ("gpt2", "bert", "gemma", "moe", "lstm", "nnx-llama")

# (model, check) -> what fails today. Strict xfails: a fixed check fails the suite until
# its entry is removed here.
XFAIL: dict[tuple[str, str], str] = {}


@functools.cache
def driver(name):
    cls, model, task = MODELS[name]
    return cls(model, task)


@functools.cache
def run(name, dtype, fp8=False, scalified=False, steps=H.STEPS, mult=1.0) -> H.Run:
    return driver(name).train(dtype, fp8, scalified, steps, mult)


def _first_nonfinite(losses):
    bad = np.flatnonzero(~np.isfinite(losses))
    return f"non-finite loss from step {bad[0] + 1} of {len(losses)}: {losses}" if bad.size else ""


# ---------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------
PARAM_NOISE_THRESHOLD = 2.0**-20


def check_float32(name):
    """float32: the loss of every step within 1e-5 (relative) of plain JAX's, and the final
    parameters within optimizer noise: |scalified - plain| <= 1e-5 x (the model's largest
    parameter magnitude), on every element whose first float32 gradient is above
    2^-20 of the model's largest gradient.

    Why the parameter bound: scalify's float32 arithmetic differs from plain JAX's only by
    the order of roundings (power-of-two scales are exact), so gradients agree to a few
    float32 ulps of their sums; AdamW's update `m / sqrt(v)` keeps that relative error, so
    each step moves a parameter by lr x (relative gradient error) ~ 3e-3 x 1e-6 apart, far
    inside 1e-5. The excluded elements have mathematically zero gradients computed as
    rounding noise (the bias of a key projection under softmax's shift invariance, the
    pre-BatchNorm biases): Adam turns noise into steps of size lr whose sign is the noise's,
    so they are compared through the loss only. Also: plain float32 learns the task (its
    last loss at least 2% below its first: the LSTM, the slowest learner, gains about 3%)."""
    plain, scaled = run(name, H.F32), run(name, H.F32, scalified=True)
    assert plain.losses[-1] < 0.98 * plain.losses[0], f"the task is not learnt: {plain.losses}"
    assert not _first_nonfinite(scaled.losses), _first_nonfinite(scaled.losses)
    np.testing.assert_allclose(scaled.losses, plain.losses, rtol=1e-5, err_msg="loss per step")
    g32 = plain.first_grads
    gmax = max(np.abs(g).max() for g in g32.values())
    largest = max(np.abs(p).max() for p in plain.params.values())
    assert scaled.params.keys() == plain.params.keys() == g32.keys()
    errors = {k: np.where(np.abs(g) > gmax * PARAM_NOISE_THRESHOLD, np.abs(plain.params[k] - scaled.params[k]), 0).max()
              / largest for k, g in g32.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, f"parameter {worst}: error {errors[worst]:.2e} of the largest parameter"


def check_fp16(name):
    """float16 compute (the model's dtype float16, float32 parameters as ScaledArrays,
    plain optax), scalified: every loss finite, and its mean over the steps within 1% of
    float32's mean loss or no more than 1.01 x plain float16's mean loss, whichever is
    looser (plain float16 sets the bar where float16 itself costs more than 1%)."""
    ref, scaled = run(name, H.F32), run(name, H.F16, scalified=True)
    assert not _first_nonfinite(scaled.losses), _first_nonfinite(scaled.losses)
    m32, ms = ref.losses.mean(), scaled.losses.mean()
    if abs(ms / m32 - 1) <= 0.01:
        return
    m16 = run(name, H.F16).losses.mean()  # plain float16: only needed beyond 1% of float32
    assert ms <= 1.01 * m16, (
        f"mean loss {ms:.5f}: {100 * (ms / m32 - 1):+.2f}% of float32's {m32:.5f}, "
        f"plain float16 {m16:.5f} ({100 * (m16 / m32 - 1):+.2f}%)")


FP8_FACTOR, FP8_FLOOR = 2.0, 2.0**-10


def check_fp8(name):
    """The FP8 swap on the float32 model under scalify: every loss finite, and its
    deviation from float32 (max over the steps of |loss - float32's| / float32's) at most
    `FP8_FACTOR` x the deviation of the same swap run plainly, plus `FP8_FLOOR`.

    The swap's FP8 matmuls scale each operand just in time from its own amax, which gives
    the same numbers inside and outside scalify; the two runs differ only where float32
    rounding elsewhere in the step moves a value across an FP8 rounding boundary, so
    their deviations from float32 are of the same size (the factor 2 allows for that
    spread; the floor, 2^-10, for a plain deviation that happens to be near zero: a
    hundredth of E4M3's half-ulp 2^-4). The plain swap must differ from float32 (the swap
    reached the model's layers)."""
    ref, plain, scaled = run(name, H.F32), run(name, H.F32, fp8=True), run(name, H.F32, fp8=True, scalified=True)
    assert not np.array_equal(plain.losses, ref.losses), "the FP8 swap changed nothing"
    assert np.all(np.isfinite(plain.losses)), f"plain FP8: {plain.losses}"
    assert not _first_nonfinite(scaled.losses), _first_nonfinite(scaled.losses)
    dev_plain = np.max(np.abs(plain.losses - ref.losses) / ref.losses)
    dev = np.max(np.abs(scaled.losses - ref.losses) / ref.losses)
    assert dev <= FP8_FACTOR * dev_plain + FP8_FLOOR, (
        f"deviation from float32 {dev:.2e} (max over steps), plain FP8 {dev_plain:.2e}")


TINY_RTOL = 2.0**-7
NOISE_LEAF = 2.0**-16
ZERO_CHECK = 2.0**-8


def check_tiny_loss(name):
    """The loss times 2^-20 with float16 compute (plain float16 flushes such gradients to
    zero): the first step of the scalified float16 training step, its loss weight (an
    argument of the step) set to 2^-20. Every gradient leaf finite, and on every leaf that
    carries a float32 gradient (its largest element above 2^-16 of the model's largest; the
    others are mathematically zero and computed as rounding noise):
    - non-zero wherever float32's gradient is above 2^-8 of the leaf's largest element
      (nothing flushed to zero), and
    - equal to 2^-20 x float32's gradient within `TINY_RTOL` = 2^-7 in relative L2 norm
      per leaf. float16 keeps 11 significant bits (relative rounding 2^-11 per value); a
      one-layer forward and backward pass chains a few dozen such roundings, partly
      averaging out, partly in sums of cancelling terms (normalisations, softmax), which
      costs up to a few times 2^-11 (plain float16 of the unscaled loss is as far from
      float32); 2^-7 is 16 float16 roundings, while a gradient placed at a wrong scale or
      partly flushed is off by far more."""
    g32 = run(name, H.F32).first_grads
    tiny = run(name, H.F16, scalified=True, steps=1, mult=H.TINY)
    g16 = {k: g / H.TINY for k, g in tiny.first_grads.items()}
    assert g16.keys() == g32.keys()
    gmax = max(np.abs(g).max() for g in g32.values())
    problems = []
    for k, a in g32.items():
        b = g16[k]
        if not np.all(np.isfinite(b)):
            problems.append(f"{k}: {np.sum(~np.isfinite(b))} of {b.size} elements non-finite")
            continue
        amax = np.abs(a).max()
        if amax <= gmax * NOISE_LEAF:
            continue
        lost = (np.abs(a) > amax * ZERO_CHECK) & (b == 0)
        if lost.any():
            problems.append(f"{k}: {lost.sum()} of {lost.size} elements zero")
        rel = np.linalg.norm(b - a) / np.linalg.norm(a)
        if rel > TINY_RTOL:
            problems.append(f"{k}: relative error {rel:.2e}")
    assert not problems, "; ".join(problems)


CHECK_FUNCTIONS = {"float32": check_float32, "fp16": check_fp16, "fp8": check_fp8, "tiny-loss": check_tiny_loss}


def _cases():
    """Model-major order: a pytest-xdist worker gets consecutive tests, so the checks of
    one model mostly share that process's cached reference runs."""
    for name, (cls, _, _) in MODELS.items():
        for check in CHECKS:
            if check == "fp8" and not (cls.fp8_swap and name in FP8_MODELS):
                continue
            marks = [pytest.mark.xfail(strict=True, reason=XFAIL[name, check])] if (name, check) in XFAIL else []
            yield pytest.param(name, check, id=f"{name}-{check}", marks=marks)


@pytest.mark.parametrize("name,check", list(_cases()))
def test_zoo(name, check):
    CHECK_FUNCTIONS[check](name)
