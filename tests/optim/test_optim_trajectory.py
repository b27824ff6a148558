"""Trajectory tests: each low-precision variant trains the small problem (optim_problem.py:
2-layer MLP regression, 300 full-batch AdamW steps, float32 model) within a stated
tolerance of `optax.adamw` in float32.

Tolerances (measured values in docs/optimizers.md, from benchmarks/optim_memory.py):
- FP16 scaled state: final loss within 1% (the accuracy contract).
- FP16 scaled master weights (round-to-nearest or stochastic), FP8-LM, 8-bit block-wise
  and COAT: final loss within 5% and every step within 10% of the reference.
"""
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optim_problem as P
import scalify.optim as so

VARIANTS = {
    # name: (transformation, master dtype, rounding, final tol, per-step tol)
    "fp16_state": (lambda: so.scaled_state(optax.adamw(P.LR)), None, "nearest", 0.01, 0.10),
    "fp16_state_master_rtn": (lambda: so.scaled_state(optax.adamw(P.LR)), jnp.float16, "nearest", 0.05, 0.10),
    "fp16_state_master_sr": (lambda: so.scaled_state(optax.adamw(P.LR)), jnp.float16, "stochastic", 0.05, 0.10),
    "fp8lm": (lambda: so.adamw_fp8lm(P.LR), jnp.float16, "nearest", 0.05, 0.10),
    # min_size=2: quantise every tensor (harsher than the bitsandbytes default of 4096).
    "8bit": (lambda: so.adamw_8bit(P.LR, min_size=2), None, "nearest", 0.05, 0.10),
    "coat": (lambda: so.adamw_coat(P.LR), None, "nearest", 0.05, 0.10),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_trajectory_close_to_float32_adamw(name, reference_losses):
    make, master, rounding, final_tol, step_tol = VARIANTS[name]
    _, losses = P.run(make(), master_dtype=master, rounding=rounding)
    losses = np.asarray(losses)
    ref = reference_losses
    assert np.all(np.isfinite(losses))
    assert ref[-1] < 0.05 * ref[0]  # the problem is actually learnt
    final = abs(losses[-1] / ref[-1] - 1)
    worst = np.max(np.abs(losses / ref - 1))
    assert final <= final_tol, f"{name}: final loss {losses[-1]:.5g} vs {ref[-1]:.5g} ({final:.2%})"
    assert worst <= step_tol, f"{name}: worst per-step deviation {worst:.2%}"
