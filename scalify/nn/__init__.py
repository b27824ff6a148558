"""Flax layers for scaled low-precision training: a `Dense` whose precision (FP32, BF16,
FP16, FP8) and scaling policy are configuration, a `LayerNorm` with scaled rules and an
optional backward rescale, and activations that keep the input scale."""
from scalify.nn.activations import gelu, relu, silu
from scalify.nn.dense import FP8_STATS, Dense
from scalify.nn.normalization import LayerNorm, layer_norm, normalize

__all__ = ["Dense", "FP8_STATS", "LayerNorm", "layer_norm", "normalize", "gelu", "relu", "silu"]
