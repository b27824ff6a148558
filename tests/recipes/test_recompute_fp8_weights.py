"""`Recipe.recompute_fp8_weights`: each `nn.Dense` kernel's FP8 copy for the backward pass
is cast again there instead of kept from the forward. The step is the same step: the same
losses, parameters, optimizer state and scale statistics, bit for bit, on a model written
the way its authors write it (a Llama with a hand-written RMSNorm and SwiGLU)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from scalify import recipes
from tests.recipes.test_recipes import recipe_losses, shared_recipe_run
from tests.zoo.models_linen import Llama


def _leaves(state):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]


@pytest.mark.parametrize("name", ["fp8-fp16-state", "fp8-bf16"])
def test_same_step_bit_for_bit(name):
    losses, _, state = shared_recipe_run(name, Llama)
    on_losses, _, on_state = recipe_losses(recipes.get(name).replace(recompute_fp8_weights=True), Llama)
    np.testing.assert_array_equal(on_losses, losses)
    # No new scale statistics (the backward cast reuses the forward's drift guard).
    assert jax.tree_util.tree_structure(on_state) == jax.tree_util.tree_structure(state)
    for a, b in zip(_leaves(on_state), _leaves(state)):
        np.testing.assert_array_equal(a, b)


def test_recompute_fp8_weights_must_be_a_bool():
    with pytest.raises(TypeError, match="recompute_fp8_weights must be True or False"):
        recipes.FP8.replace(recompute_fp8_weights="yes")


def test_fp8_kernel_copies_leave_the_saved_residuals():
    """The loss VJP's FP8 residuals shrink by one byte per element of every FP8 Dense
    kernel (all 2-D kernels but the kept head's); the kernels it keeps instead are the
    parameters themselves."""
    from tests.recipes.test_fp8_saved_activations import _residual_bytes
    from tests.recipes.test_recipes import initial_params

    recipe = recipes.FP8_FP16_STATE
    _, fp8_kept = _residual_bytes(recipe, Llama)
    _, fp8_recomputed = _residual_bytes(recipe.replace(recompute_fp8_weights=True), Llama)
    paths = jax.tree_util.tree_flatten_with_path(initial_params(Llama))[0]
    kernels = sum(leaf.size for path, leaf in paths
                  if leaf.ndim == 2 and "kernel" in jax.tree_util.keystr(path)
                  and not recipe.keeps("/".join(str(getattr(k, "key", k)) for k in path)))
    assert kernels > 0
    assert fp8_kept - fp8_recomputed == kernels
