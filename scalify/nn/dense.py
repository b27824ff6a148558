"""`Dense`: a Flax linear layer whose precision is configuration.

    Dense(features)                                                  # = flax.linen.Dense
    Dense(features, dtype=jnp.float16, input_dtype=jnp.float16,
          kernel_dtype=jnp.float16, grad_dtype=jnp.float16)          # FP16 matmuls
    Dense(features, input_dtype=E4M3, kernel_dtype=E4M3, grad_dtype=E5M2,
          output_dtype=jnp.bfloat16, scaling="jit")                  # FP8 matmuls

The call signature is flax.linen.Dense's (`features, use_bias, dtype, param_dtype,
precision, kernel_init, bias_init, name`), so a model that takes its linear layer as a
class (e.g. `experiments/nanogpt`'s `dense_cls`) uses it unchanged, typically through
`functools.partial(Dense, input_dtype=..., ...)`.

With no low-precision role set (all `*_dtype` None and static scaling) the layer is
exactly `flax.linen.Dense`. Otherwise the matmul is `scalify.ops.fp8.fp8_dot_general`:
input and kernel quantised to `input_dtype` / `kernel_dtype` (the kernel directly from its
`param_dtype` master copy), the output gradient to `grad_dtype` for the two backward matmuls,
and the product returned in `output_dtype`. Scaling policies (per layer): "static" (inside
scalify, the propagated scale; outside, a plain saturating cast), "jit" (per-tensor amax
each step) and "delayed" (amax histories in the `stats_collection` variable collection).

Delayed scaling: the histories are variables of `stats_collection` ("fp8_stats" by
default). Pass them to the loss as a differentiable input; their *gradient is their
updated value*, to be written back after the step (Flax's `OVERWRITE_WITH_GRADIENT`
convention; setting `stats_collection=flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT` makes
`flax.training.train_state.TrainState.apply_gradients` do it)::

    def loss(params, stats, x):
        y = model.apply({"params": params, "fp8_stats": stats}, x)
        ...
    grads, stats = jax.grad(loss, argnums=(0, 1))(params, stats, x)

A layer applied several times in one step sums its history updates: give each use its
own layer (or use "jit" scaling) there.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype
from jax import lax

from scalify.ops.fp8 import (
    DelayedScaling,
    ScalingPolicy,
    StaticScaling,
    fp8_dot_general,
    init_amax_history,
    scaling_policy,
)

__all__ = ["Dense", "FP8_STATS", "KERNEL_LAYOUTS", "dense"]

FP8_STATS = "fp8_stats"
KERNEL_LAYOUTS = ("in_out", "out_in")
Dtype = Any


class Dense(nn.Module):
    """A linear layer over the last axis with per-role dtypes and a per-layer scaling policy.

    Attributes:
      features: number of output features.
      use_bias: add a bias (kept in `param_dtype`, added in the output dtype).
      dtype: computation dtype, as in flax (inputs and bias are promoted to it).
      param_dtype: dtype of the kernel and bias (the master weights).
      precision: `lax.Precision` of the plain (non low-precision) matmul.
      kernel_init, bias_init: initialisers, as in flax.
      input_dtype: format of the input in the matmul (e.g. E4M3); None: `dtype`.
      kernel_dtype: format of the kernel in the matmul (e.g. E4M3); None: `dtype`.
      grad_dtype: format of the output gradient in the backward matmuls (e.g. E5M2);
        None: the output dtype.
      output_dtype: dtype of the matmul output; None: `dtype`, else the inputs' type.
      scaling: "static", "jit", "delayed" or a `scalify.ops.fp8` policy instance.
      stats_collection: variable collection of the delayed-scaling amax histories.
      pattern: data path of the FP8 matmul outside scalify: None (`scalify.ops.fp8.dot_scaled_tn`)
        or a function `fn(a, b, sa, sb, dimension_numbers, out_dtype)`.
      kernel_layout: shape of the kernel parameter: "in_out" (flax's `(in, features)`, the
        default) or "out_in" (`(features, in)`, PyTorch's and TransformerEngine's). Same
        math; "out_in" is faster for FP8 on Hopper: XLA's cuBLASLt FP8 GEMM writes the
        weight gradient features-major, so with "in_out" the optimizer update of every
        kernel runs through transposes (docs/fp8.md, "Kernel layout").
      weight_grad_dtype: dtype of the kernel gradient's values (None: `param_dtype`). With
        bfloat16, an FP8 layer's weight-gradient GEMM writes them in bfloat16, its scales
        applied in the GEMM, widened to `param_dtype`: for gradients averaged over devices
        in bfloat16 the same values, and no pass that scales and casts them before the
        all-reduce (`scalify.ops.fp8.fp8_dot_general`'s `rhs_grad_dtype`; a 16-bit layer
        rounds its float32 gradient instead). Low-precision layers only.
    """

    features: int
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: Any = None
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()
    input_dtype: Dtype | None = None
    kernel_dtype: Dtype | None = None
    grad_dtype: Dtype | None = None
    output_dtype: Dtype | None = None
    scaling: str | ScalingPolicy = "static"
    stats_collection: str = FP8_STATS
    pattern: Any = None
    kernel_layout: str = "in_out"
    weight_grad_dtype: Dtype | None = None

    @nn.compact
    def __call__(self, inputs):
        """Apply `inputs @ kernel (+ bias)` over the last axis of `inputs`."""
        if self.kernel_layout not in KERNEL_LAYOUTS:
            raise ValueError(
                f"Dense.kernel_layout must be one of {KERNEL_LAYOUTS}, got {self.kernel_layout!r}."
            )
        d_in = jnp.shape(inputs)[-1]
        out_in = self.kernel_layout == "out_in"
        init = self.kernel_init
        if out_in:  # drawn as (in, features) then transposed: fan-in aware initialisers and
            # a given seed give the same layer in both layouts
            init = lambda key, shape, dtype: self.kernel_init(key, shape[::-1], dtype).T  # noqa: E731
        shape = (self.features, d_in) if out_in else (d_in, self.features)
        kernel = self.param("kernel", init, shape, self.param_dtype)
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias
            else None
        )
        policy = scaling_policy(self.scaling)
        history = None
        if isinstance(policy, DelayedScaling):
            history = tuple(
                self.variable(
                    self.stats_collection, name, init_amax_history, policy.history_length
                ).value
                for name in ("input_amax_history", "kernel_amax_history", "grad_amax_history")
            )
        return dense(
            inputs, kernel, bias, dtype=self.dtype, precision=self.precision,
            input_dtype=self.input_dtype, kernel_dtype=self.kernel_dtype,
            grad_dtype=self.grad_dtype, output_dtype=self.output_dtype, scaling=policy,
            amax_history=history, pattern=self.pattern, kernel_layout=self.kernel_layout,
            weight_grad_dtype=self.weight_grad_dtype,
        )


def dense(inputs, kernel, bias=None, *, dtype=None, precision=None, input_dtype=None,
          kernel_dtype=None, grad_dtype=None, output_dtype=None, scaling="static",
          amax_history=None, pattern=None, kernel_layout="in_out", weight_grad_dtype=None):
    """`inputs @ kernel (+ bias)` over the last axis of `inputs`, the math of `Dense` (see its
    attributes). `kernel` is `(in, features)` ("in_out") or `(features, in)` ("out_in");
    `amax_history` is the (input, kernel, grad) histories of delayed scaling."""
    policy = scaling_policy(scaling)
    out_in = kernel_layout == "out_in"
    dn = (((inputs.ndim - 1,), (1 if out_in else 0,)), ((), ()))
    roles = (input_dtype, kernel_dtype, grad_dtype)
    if all(d is None for d in roles) and isinstance(policy, StaticScaling):
        if weight_grad_dtype is not None:
            raise ValueError(
                "Dense.weight_grad_dtype applies to low-precision layers (set input_dtype, "
                "kernel_dtype or grad_dtype, or a scaling policy); a plain layer's kernel "
                "gradient has the dtype its matmul runs in (`dtype`)."
            )
        inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=dtype)
        y = lax.dot_general(
            inputs, kernel, dn, precision=precision, preferred_element_type=output_dtype
        )
    else:
        # The kernel is quantised straight from its master copy (no detour via `dtype`).
        inputs, bias = promote_dtype(inputs, bias, dtype=dtype)
        out_dtype = output_dtype or dtype or jnp.result_type(inputs, kernel)
        y = fp8_dot_general(
            inputs,
            kernel,
            dn,
            lhs_dtype=input_dtype or inputs.dtype,
            rhs_dtype=kernel_dtype or dtype or kernel.dtype,
            grad_dtype=grad_dtype or out_dtype,
            preferred_element_type=out_dtype,
            scaling=policy,
            amax_history=amax_history,
            pattern=pattern,
            rhs_grad_dtype=weight_grad_dtype,
        )
    if bias is not None:
        y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,)).astype(y.dtype)
    return y
