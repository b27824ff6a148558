"""Activations with scale rules that keep the input scale, re-exported from
`scalify.ops.activations` (valid with or without scalify; `f(x) = x * g(x)` with a bounded
gate `g`)."""
from scalify.ops.activations import gelu, relu, silu

__all__ = ["gelu", "relu", "silu"]
