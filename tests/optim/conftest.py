"""Shared fixtures of the optimizer tests: the float32 AdamW reference trajectory."""
import numpy as np
import optax
import pytest

import optim_problem as P


@pytest.fixture(scope="session")
def reference_losses():
    """Losses of `optax.adamw` in float32 on the small problem (300 steps)."""
    _, losses = P.run(optax.adamw(P.LR))
    return np.asarray(losses)
