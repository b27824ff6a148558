"""`FP8_BF16` (FP8 matmuls, unscaled bfloat16 activations) on models of the zoo that the
recipe tests do not train otherwise: a ViT, BERT (Flax's MultiHeadDotProductAttention,
post-LayerNorm, exact GELU), a T5 encoder (relative position bias, T5's RMSNorm, gated
GELU) and a mixture of experts (einsum routing)."""
from __future__ import annotations

import numpy as np
import pytest

from scalify import recipes
from tests.recipes.test_recipes import zoo_losses

# FP8's rounding of the forward pass at initialisation moves these tiny models' first
# losses by up to ~2% either way (ViT: 3.04 against float32's 2.97), and over STEPS
# steps the mean loss by up to 2.5% (BERT: 2.5% below float32's); a model that does not
# train, or trains on flushed gradients, is off by far more.
RTOL = 0.03


@pytest.mark.parametrize("name", ["vit", "bert", "t5-encoder", "moe"])
def test_fp8_bf16_trains_like_float32(name):
    """Every loss finite, the mean within 3% of plain float32's, one compile."""
    got, ref, train = zoo_losses(recipes.FP8_BF16, name)
    assert np.isfinite(got).all(), got
    np.testing.assert_allclose(np.mean(got), np.mean(ref), rtol=RTOL)
    assert train.step._cache_size() == 1


def test_fp8_bf16_with_fp16_moments_trains_like_float32():
    """`FP8_BF16` with scaled FP16 Adam moments (#4 with bfloat16 activations) on the Llama:
    the moments of unscaled gradients encoded in FP16, every loss finite, the mean within 3%
    of plain float32's, one compile."""
    got, ref, train = zoo_losses(recipes.FP8_BF16.replace(state_dtype="float16"), "llama")
    assert np.isfinite(got).all(), got
    np.testing.assert_allclose(np.mean(got), np.mean(ref), rtol=RTOL)
    assert train.step._cache_size() == 1
