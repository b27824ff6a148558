"""FP8 for an unchanged Flax linen model: a `lax.dot_general` drop-in and a method interceptor.

    nn.Dense(features, dot_general=scalify.nn.fp8_dot_general)      # one layer
    nn.Dense(features, dot_general_cls=scalify.nn.Fp8DotGeneral)    # the same, as a class
    with scalify.nn.fp8_everywhere():                                # every Dense,
        y = model.apply(variables, x)                                # DenseGeneral, Einsum

`Fp8DotGeneral` has `lax.dot_general`'s signature and runs `scalify.ops.fp8.fp8_dot_general`:

    out   = dot(q(lhs), q(rhs))        E4M3 x E4M3, q(x) = saturating_cast(x / s_x) * s_x
    d lhs = dot(q(g), q(rhs)^T)        E5M2 x E4M3
    d rhs = dot(q(lhs)^T, q(g))        E4M3 x E5M2

with per-tensor power-of-two scales `s` from the scaling policy: "jit" (default:
`s = 2^margin / 2^floor(log2(fp8_max / amax(x)))` from the current tensor, the same values
inside and outside `scalify`) or "static" (inside `scalify`, the propagated ScaledArray
scale; outside, 1). `precision` is accepted and ignored: the operands are FP8.

`fp8_everywhere()` is `flax.linen.intercept_methods(fp8_interceptor())`. The interceptor
sees every module call; for a `Dense` or `DenseGeneral` whose `dot_general` and
`dot_general_cls` are unset it runs flax's own `__call__` with `dot_general` set to the FP8
one for the duration of the call (the module is restored afterwards). `Einsum` has no such
field: the interceptor creates the same `kernel` and `bias` parameters as flax (same names,
shapes and initialisers) and computes `jnp.einsum(..., _dot_general=<fp8>)` plus the bias.
Layers that chose their own `dot_general` are left alone, as are all other modules
(attention logits `q.k` and `p.v` stay in the model's dtype). Parameters are unchanged, so
checkpoints of the float model load into the FP8 one and back.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp

from scalify.ops.fp8 import E4M3, E5M2, DelayedScaling, ScalingPolicy, scaling_policy
from scalify.ops.fp8 import fp8_dot_general as _fp8_dot_general

__all__ = ["Fp8DotGeneral", "fp8_dot_general", "fp8_interceptor", "fp8_everywhere", "FP8_LAYERS"]

FP8_LAYERS = (nn.Dense, nn.DenseGeneral, nn.Einsum)


@dataclasses.dataclass(frozen=True)
class Fp8DotGeneral:
    """`lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)` in FP8.

    Usable as `dot_general=Fp8DotGeneral(...)` and, called with no arguments by flax, as
    `dot_general_cls=Fp8DotGeneral`.

    Attributes:
      scaling: "jit" (per-tensor amax of the current step) or "static" (the propagated
        scale inside `scalify`, 1 outside), or a policy instance. Delayed scaling needs
        amax histories kept in the model: use `scalify.nn.Dense(..., scaling="delayed")`.
      lhs_dtype, rhs_dtype, grad_dtype: formats of the input, the kernel and the output
        gradient (E4M3, E4M3, E5M2).
      output_dtype: dtype of the product when the caller gives no `preferred_element_type`
        (None: the promoted dtype of the operands, e.g. float32).
      pattern: data path outside `scalify` (`scalify.ops.fp8.FP8_DOT_PATTERNS`).
      weight_grad_dtype: dtype the GEMM of the kernel's gradient writes (None: the kernel's
        dtype), a dtype of float32's range: `fp8_dot_general`'s `rhs_grad_dtype` (the
        gradient rounded to it, then widened to the kernel's dtype).
      unscaled_activations: `fp8_dot_general`'s: the product and the input's gradient
        leave as plain values (output and input of float32's exponent range).
      recompute_weight: `fp8_dot_general`'s `recompute_rhs`: the kernel's FP8 copy for the
        backward pass is cast again there from the kernel rather than kept from the forward.
    """

    scaling: str | ScalingPolicy = "jit"
    lhs_dtype: Any = E4M3
    rhs_dtype: Any = E4M3
    grad_dtype: Any = E5M2
    output_dtype: Any = None
    pattern: str | None = None
    weight_grad_dtype: Any = None
    unscaled_activations: bool = False
    recompute_weight: bool = False

    def __post_init__(self):
        if isinstance(scaling_policy(self.scaling), DelayedScaling):
            raise ValueError(
                "Fp8DotGeneral keeps no state, so it cannot do delayed scaling: use "
                "scaling='jit' or 'static' here, or scalify.nn.Dense(..., scaling='delayed'), "
                "which keeps the amax histories in the 'fp8_stats' collection."
            )

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                 out_sharding=None):
        """The FP8 product of `lhs` and `rhs`; `precision` is ignored (FP8 operands)."""
        del precision
        if out_sharding is not None:
            raise ValueError(
                "Fp8DotGeneral takes no out_sharding: shard the operands (or constrain the "
                "output with jax.lax.with_sharding_constraint) instead."
            )
        out_dtype = self.output_dtype if preferred_element_type is None else preferred_element_type
        if out_dtype is None:
            out_dtype = jnp.result_type(lhs, rhs)
        return _fp8_dot_general(
            lhs, rhs, dimension_numbers,
            lhs_dtype=self.lhs_dtype, rhs_dtype=self.rhs_dtype, grad_dtype=self.grad_dtype,
            preferred_element_type=out_dtype, scaling=self.scaling, pattern=self.pattern,
            rhs_grad_dtype=self.weight_grad_dtype, unscaled_activations=self.unscaled_activations,
            recompute_rhs=self.recompute_weight,
        )


fp8_dot_general = Fp8DotGeneral()


@contextlib.contextmanager
def field_set(module: nn.Module, name: str, value):
    """`module.name = value` for the duration of the block (flax modules are frozen); the
    block gets the old value."""
    old = getattr(module, name)
    object.__setattr__(module, name, value)
    try:
        yield old
    finally:
        object.__setattr__(module, name, old)


def _einsum_bias_shapes(eqn: str, lhs_ndim: int, kernel_shape: Sequence[int]):
    """(bias shape, its shape broadcast to the output) of flax's `Einsum`: one entry per
    output axis whose letter is a kernel axis, in output order."""
    ins, out = eqn.split("->")
    lhs, rhs = ins.split(",")
    if "..." in rhs:
        raise ValueError(f"Einsum {eqn!r}: the kernel's subscripts must be explicit letters.")
    if "..." in out:
        n = lhs_ndim - len(lhs.replace("...", ""))
        out = out.replace("...", "." * n)  # '.' is no letter: never a kernel axis
    sizes = dict(zip(rhs, kernel_shape))
    bias = [sizes[c] for c in out if c in sizes]
    return bias, [sizes.get(c, 1) for c in out]


def _fp8_einsum(module: nn.Einsum, dot_general: Callable, inputs, einsum_str=None):
    """flax `Einsum.__call__` with the contraction in FP8: same parameters, same result."""
    eqn = nn.merge_param("einsum_str", module.einsum_str, einsum_str).replace(" ", "")
    if "->" not in eqn or eqn.count(",") != 1:
        raise ValueError(f"Einsum {eqn!r}: need an explicit 'lhs,kernel->out' equation.")
    kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
    bias = None
    if module.use_bias:
        shape, out_shape = _einsum_bias_shapes(eqn, jnp.ndim(inputs), module.shape)
        bias = module.param("bias", module.bias_init, tuple(shape), module.param_dtype)
    inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
    y = jnp.einsum(eqn, inputs, kernel, preferred_element_type=module.preferred_element_type,
                   _dot_general=dot_general)
    if bias is not None:
        y = y + jnp.reshape(bias, out_shape)
    return y


def fp8_interceptor(dot_general: Callable = fp8_dot_general,
                    layers: Sequence[type] = FP8_LAYERS) -> Callable:
    """A `flax.linen.intercept_methods` interceptor that runs the `layers` in FP8.

    Args:
      dot_general: the contraction to use (default `fp8_dot_general`; e.g.
        `Fp8DotGeneral(scaling="static")` inside `scalify`).
      layers: which of `nn.Dense`, `nn.DenseGeneral`, `nn.Einsum` (and their subclasses)
        to swap.
    Returns:
      `interceptor(next_fun, args, kwargs, context)`.
    """
    layers = tuple(layers)
    unknown = [t for t in layers if not issubclass(t, FP8_LAYERS)]
    if unknown:
        raise ValueError(f"fp8_interceptor swaps subclasses of {FP8_LAYERS} only, got {unknown}.")

    def interceptor(next_fun, args, kwargs, context):
        m = context.module
        if context.method_name != "__call__" or not isinstance(m, layers):
            return next_fun(*args, **kwargs)
        if hasattr(m, "dot_general"):  # Dense, DenseGeneral
            if m.dot_general is not None or getattr(m, "dot_general_cls", None) is not None:
                return next_fun(*args, **kwargs)  # the layer chose its own contraction
            with field_set(m, "dot_general", dot_general):
                return next_fun(*args, **kwargs)
        return _fp8_einsum(m, dot_general, *args, **kwargs)

    return interceptor


def fp8_everywhere(dot_general: Callable = fp8_dot_general,
                   layers: Sequence[type] = FP8_LAYERS):
    """Context manager: inside it, every `nn.Dense`, `nn.DenseGeneral` and `nn.Einsum`
    call runs its matmul with `dot_general` (FP8 by default). Works under `jax.jit`,
    `jax.grad` and `scalify` as long as `model.apply`/`init` is traced inside the block::

        with scalify.nn.fp8_everywhere():
            loss, grads = step(params, batch)   # traced here: FP8 baked into the jaxpr
    """
    return nn.intercept_methods(fp8_interceptor(dot_general, layers))
