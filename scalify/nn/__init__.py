"""Flax layers for scaled low-precision training: a `Dense` whose precision (FP32, BF16,
FP16, FP8) and scaling policy are configuration, a `LayerNorm` with scaled rules and an
optional backward rescale, activations that keep the input scale, and an FP8
`dot_general` with an interceptor that turns the linear layers of an unchanged
flax.linen model into FP8 (`fp8_everywhere`)."""
from scalify.nn.activations import gelu, relu, silu
from scalify.nn.dense import FP8_STATS, Dense
from scalify.nn.fp8_swap import (
    FP8_LAYERS,
    Fp8DotGeneral,
    fp8_dot_general,
    fp8_everywhere,
    fp8_interceptor,
)
from scalify.nn.normalization import LayerNorm, layer_norm, normalize

__all__ = ["Dense", "FP8_STATS", "FP8_LAYERS", "Fp8DotGeneral", "fp8_dot_general",
           "fp8_everywhere", "fp8_interceptor", "LayerNorm", "layer_norm", "normalize", "gelu", "relu", "silu"]
