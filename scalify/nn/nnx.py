"""Flax NNX versions of the `scalify.nn` layers.

    from scalify.nn import nnx as snnx
    snnx.Dense(32, 16, rngs=nnx.Rngs(0))                               # = nnx.Linear
    snnx.Dense(32, 16, input_dtype=E4M3, kernel_dtype=E4M3, grad_dtype=E5M2,
               output_dtype=jnp.bfloat16, scaling="jit", rngs=nnx.Rngs(0))  # FP8 matmuls

`Dense` computes what the linen `scalify.nn.Dense` computes (`scalify.nn.dense.dense`, the
same per-role dtypes and scaling policies) with NNX parameters `kernel` and `bias`. Delayed
scaling is linen-only: its amax histories travel as gradients (Flax's
OVERWRITE_WITH_GRADIENT convention), which an `nnx.Optimizer` would treat as parameters.
`LayerNorm` is `scalify.nn.layer_norm` (scaled normalisation, optional gradient rescale)
with NNX parameters `scale` and `bias` over the last axis, as `nnx.LayerNorm`.
`import scalify` does not import this module (nor Flax NNX).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from scalify.nn.dense import KERNEL_LAYOUTS, dense
from scalify.nn.normalization import layer_norm
from scalify.ops.fp8 import DelayedScaling, ScalingPolicy, scaling_policy

__all__ = ["Dense", "LayerNorm"]

Dtype = Any


class Dense(nnx.Module):
    """A linear layer over the last axis with per-role dtypes and a per-layer scaling policy.

    Args are those of `nnx.Linear` (`in_features, out_features, use_bias, dtype, param_dtype,
    precision, kernel_init, bias_init, rngs`) plus the roles of the linen
    `scalify.nn.Dense`: `input_dtype`, `kernel_dtype`, `grad_dtype`, `output_dtype`,
    `scaling` ("static" or "jit", or a policy instance), `pattern` and `kernel_layout`
    ("in_out": kernel `(in, out)`; "out_in": `(out, in)`). With no role set it is
    `nnx.Linear`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: Any = None,
        kernel_init: Any = nnx.initializers.lecun_normal(),
        bias_init: Any = nnx.initializers.zeros_init(),
        input_dtype: Dtype | None = None,
        kernel_dtype: Dtype | None = None,
        grad_dtype: Dtype | None = None,
        output_dtype: Dtype | None = None,
        scaling: str | ScalingPolicy = "static",
        pattern: str | None = None,
        kernel_layout: str = "in_out",
        rngs: nnx.Rngs,
    ):
        if kernel_layout not in KERNEL_LAYOUTS:
            raise ValueError(f"Dense.kernel_layout must be one of {KERNEL_LAYOUTS}, got {kernel_layout!r}.")
        policy = scaling_policy(scaling)
        if isinstance(policy, DelayedScaling):
            raise ValueError(
                "scalify.nn.nnx.Dense does not support delayed scaling: its amax histories "
                "are updated through gradients (linen's OVERWRITE_WITH_GRADIENT convention), "
                "which an nnx.Optimizer would treat as parameters. Use scaling='jit' (amax of "
                "each step) or the linen scalify.nn.Dense."
            )
        kernel = kernel_init(rngs.params(), (in_features, out_features), param_dtype)
        # drawn as (in, out) and transposed for "out_in": a seed gives the same layer in both
        self.kernel = nnx.Param(kernel.T if kernel_layout == "out_in" else kernel)
        self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype)) if use_bias else None
        self.in_features, self.out_features = in_features, out_features
        self.dtype, self.precision = dtype, precision
        self.input_dtype, self.kernel_dtype = input_dtype, kernel_dtype
        self.grad_dtype, self.output_dtype = grad_dtype, output_dtype
        self.scaling, self.pattern, self.kernel_layout = policy, pattern, kernel_layout

    def __call__(self, inputs):
        """`inputs @ kernel (+ bias)` over the last axis of `inputs`."""
        return dense(
            inputs, self.kernel[...], None if self.bias is None else self.bias[...],
            dtype=self.dtype, precision=self.precision, input_dtype=self.input_dtype,
            kernel_dtype=self.kernel_dtype, grad_dtype=self.grad_dtype,
            output_dtype=self.output_dtype, scaling=self.scaling, pattern=self.pattern,
            kernel_layout=self.kernel_layout,
        )


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis with scaled rules (`scalify.nn.layer_norm`).

    Args are `nnx.LayerNorm`'s common ones (`num_features, epsilon, dtype, param_dtype,
    use_bias, use_scale, bias_init, scale_init, rngs`) plus `grad_rescale`: dynamic
    rescale of the input gradient inside scalify (None, True, "l2", "max", "l1").
    """

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: Any = nnx.initializers.zeros_init(),
        scale_init: Any = nnx.initializers.ones_init(),
        grad_rescale: Any = None,
        rngs: nnx.Rngs,
    ):
        shape = (num_features,)
        self.scale = nnx.Param(scale_init(rngs.params(), shape, param_dtype)) if use_scale else None
        self.bias = nnx.Param(bias_init(rngs.params(), shape, param_dtype)) if use_bias else None
        self.num_features, self.epsilon, self.dtype = num_features, epsilon, dtype
        self.grad_rescale = grad_rescale

    def __call__(self, x):
        """Normalise `x` over its last axis, then scale and shift."""
        scale = None if self.scale is None else self.scale[...]
        bias = None if self.bias is None else self.bias[...]
        dtype = self.dtype or jnp.result_type(x, *(p for p in (scale, bias) if p is not None))
        return layer_norm(x, scale, bias, axes=-1, epsilon=self.epsilon,
                          grad_rescale=self.grad_rescale, dtype=dtype)
