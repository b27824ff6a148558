"""A recipe's formats applied to an unchanged Flax linen model, by method interception.

Inside `precision(recipe)`, every linen module call is intercepted
(`flax.linen.intercept_methods`) and, unless the recipe keeps the module (its path matches
`Recipe.keep`) or it is an output head tied to an embedding (`nn.Embed.attend`):

- its `dtype` field is `recipe.compute_dtype` for the duration of the call (so are the
  fields of the submodules it builds from `self.dtype`); a kept module built that way gets
  back the dtype its nearest overridden ancestor had, so a head stays in the model's own
  dtype (the embedding lookup is in `compute_dtype`, so that the residual stream it
  starts stays in it);
- with `recipe.fp8`, an `nn.Dense`, `nn.DenseGeneral` or `nn.Einsum` runs its matmul as
  `scalify.nn.Fp8DotGeneral(scaling="static")`: E4M3 x E4M3 forward, E5M2 output gradient,
  each operand quantised at the scale scalify propagated (no amax reduction). With a
  `compute_dtype`, an `nn.Dense` quantises its kernel from the parameter itself rather
  than from its `compute_dtype` copy (one rounding, and the kernel and its transposed FP8
  copy written in one pass from the master weights, `scalify.ops.cast_transpose`; with
  `recipe.recompute_fp8_weights` the copy the backward reads is cast again there); the
  product is written in `compute_dtype`, the kernel's gradient in `compute_dtype` when
  that has float32's range and in bfloat16 otherwise (float16 compute: the unscaled
  gradient needs float32's range; half the bytes of a float32 one). With a `compute_dtype`
  of float32's range (bfloat16; `unscaled_activations`), the activations carry no scale:
  each matmul's product and input gradient leave its FP8 GEMMs as plain values, and an
  unscaled input or output gradient is quantised at the place its cast's drift guard
  gives it (`scalify.ops.fp8.fp8_dot_general(unscaled_activations=True)`);
- an `nn.LayerNorm` over the last axis is `scalify.nn.layer_norm` with the module's
  parameters (same names, shapes, initialisers, epsilon and `use_fast_variance`): the normalisation's scale
  rules (statistics in float32, output at unit scale) rather than the generic rules of
  its mean, variance and products;
- with a `compute_dtype` or `fp8`, the activations `gelu`, `silu` and `swish` that the model
  reaches through `flax.linen` or `jax.nn` are `scalify.ops`'s (`scaled_activations`):
  the same values and gradients, their bounded gate and derivative computed in float32,
  where the generic rules of the tanh GELU's cube and of the backward products take scales
  from the data;
- with `recipe.norm_grad_rescale`, the input gradient of an `nn.LayerNorm` or `nn.RMSNorm`,
  or of a module whose class name ends with "RMSNorm" or "LayerNorm" (a hand-written
  one), is rescaled to unit RMS (`layer_norm(grad_rescale="l2")`,
  `dynamic_rescale_l2_grad`): a rescale moves a power of two from the data to the scale
  and changes no value;
- with `recipe.fp8_saved_activations`, the input of each such normalisation (a module
  inside the model, called on one array) and of the activations above is kept for the
  backward pass as E4M3 with a scale per 16 elements (`fp8_saved_module_call`,
  `save_in_fp8`); the backward runs the layer's own VJP at the dequantised input.

Parameters are untouched (same names, shapes, float32 storage): a checkpoint of the plain
model loads into the recipe's step and back. Modules of other frameworks (NNX, Equinox)
compute in the dtypes they were built with.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import flax.linen as nn
import flax.linen.activation as linen_activation
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype

from scalify.core.scaled_array import has_float32_range
from scalify.nn.fp8_swap import Fp8DotGeneral, field_set, fp8_interceptor
from scalify.nn.normalization import layer_norm
from scalify.ops.activations import gelu, silu
from scalify.ops.rescale import dynamic_rescale_l2_grad
from scalify.ops.saved_activations import GROUP16, fp8_saved_module_call, save_in_fp8

__all__ = ["precision", "unscaled_activations"]

NORMS = (nn.LayerNorm, nn.RMSNorm)
# Class names of hand-written normalisations (Llama's `RMSNorm`, T5's `T5LayerNorm`, ...).
NORM_NAME_SUFFIXES = ("RMSNorm", "LayerNorm")


def _is_norm(module: nn.Module) -> bool:
    """A Flax `LayerNorm`/`RMSNorm`, or a module whose class name ends with "RMSNorm" or
    "LayerNorm" (how model authors name the ones they write)."""
    return isinstance(module, NORMS) or type(module).__name__.endswith(NORM_NAME_SUFFIXES)


def _has_dtype_field(module: nn.Module) -> bool:
    return any(f.name == "dtype" for f in dataclasses.fields(module))


def _last_axis_layer_norm(m) -> bool:
    """A stock `nn.LayerNorm` over the last axis, on one device's data."""
    return (type(m) is nn.LayerNorm and m.reduction_axes in (-1, (-1,)) and m.feature_axes in (-1, (-1,))
            and m.axis_name is None)


def _layer_norm_call(m: nn.LayerNorm, x, grad_rescale):
    """`m(x)` as `scalify.nn.layer_norm`: flax's parameters, statistics in float32."""
    features = (x.shape[-1],)
    scale = m.param("scale", m.scale_init, features, m.param_dtype) if m.use_scale else None
    bias = m.param("bias", m.bias_init, features, m.param_dtype) if m.use_bias else None
    dtype = m.dtype or jnp.result_type(x, *(p for p in (scale, bias) if p is not None))
    return layer_norm(x, scale, bias, epsilon=m.epsilon, grad_rescale=grad_rescale, dtype=dtype,
                      fast_variance=m.use_fast_variance)


def _promote_all_but_kernel(inputs, kernel, bias, *, dtype=None, **kwargs):
    """flax's `promote_dtype` for `nn.Dense(inputs, kernel, bias)`, the kernel left in
    its own dtype (the FP8 matmul quantises it from there)."""
    inputs, bias = promote_dtype(inputs, bias, dtype=dtype, **kwargs)
    return inputs, kernel, bias


def unscaled_activations(recipe) -> bool:
    """Whether `recipe`'s activations and their gradients travel unscaled: FP8 matmuls with
    a compute dtype of float32's exponent range (bfloat16), which holds every value
    without a scale. Only the FP8 operands are scaled (module doc)."""
    return bool(recipe.fp8) and recipe.compute_dtype is not None and has_float32_range(recipe.compute_dtype)


def _fp8_dense_from_master(recipe, fp8):
    """The interceptor of `fp8` with, for an `nn.Dense` under a compute dtype, the kernel
    quantised from the parameter (module doc), else None. The kernel's gradient is written
    in the compute dtype when that has float32's range, else in bfloat16: unscaled, a
    float16 gradient could overflow or flush; bfloat16 holds it, at half the bytes of the
    float32 gradient that every kernel would otherwise keep until the optimizer."""
    cast = recipe.compute_dtype
    if cast is None:
        return None
    plain = unscaled_activations(recipe)  # `fp8` is on here: a compute dtype of float32's range
    dot = Fp8DotGeneral(
        scaling="static", output_dtype=cast, weight_grad_dtype=cast if plain else jnp.bfloat16,
        unscaled_activations=plain, recompute_weight=recipe.recompute_fp8_weights,
    )

    def intercept(next_fun, args, kwargs, context):
        m = context.module
        if (context.method_name != "__call__" or not isinstance(m, nn.Dense) or m.dot_general is not None
                or m.dot_general_cls is not None or getattr(m, "promote_dtype", None) is not promote_dtype):
            return fp8(next_fun, args, kwargs, context)
        with field_set(m, "dot_general", dot), field_set(m, "promote_dtype", _promote_all_but_kernel):
            return next_fun(*args, **kwargs)

    return intercept


def _interceptor(recipe):
    plain = unscaled_activations(recipe)
    fp8 = fp8_interceptor(Fp8DotGeneral(scaling="static", unscaled_activations=plain)) if recipe.fp8 else None
    if fp8 is not None:
        fp8 = _fp8_dense_from_master(recipe, fp8) or fp8
    cast = recipe.compute_dtype
    model_dtypes = []  # the dtypes the overridden modules had, innermost last
    saving = []  # paths of the normalisations whose input is being saved in FP8, innermost last

    def intercept(next_fun, args, kwargs, context):
        m = context.module
        has_dtype = _has_dtype_field(m)
        tied_head = isinstance(m, nn.Embed) and context.method_name == "attend"
        if tied_head or recipe.keeps("/".join(m.path)):
            if cast is None or not has_dtype or not model_dtypes or m.dtype != cast:
                return next_fun(*args, **kwargs)
            with field_set(m, "dtype", model_dtypes[-1]):
                return next_fun(*args, **kwargs)
        calling = context.method_name == "__call__" and args
        if recipe.norm_grad_rescale and _is_norm(m) and calling and not _last_axis_layer_norm(m):
            args = (dynamic_rescale_l2_grad(args[0]),) + tuple(args[1:])
        if (recipe.fp8_saved_activations and calling and len(args) == 1 and not kwargs and _is_norm(m)
                and m.path and not (saving and saving[-1] == m.path)):
            # The call inside `fp8_saved_module_call` comes back here and runs as below. A
            # module without a path is the detached copy its backward applies: not saved again.
            saving.append(m.path)
            try:
                return fp8_saved_module_call(m, args[0], GROUP16)
            finally:
                saving.pop()
        with contextlib.ExitStack() as stack:
            if cast is not None and has_dtype:
                model_dtypes.append(stack.enter_context(field_set(m, "dtype", cast)))
                stack.callback(model_dtypes.pop)
            if calling and len(args) == 1 and not kwargs and _last_axis_layer_norm(m):
                return _layer_norm_call(m, jnp.asarray(args[0]), "l2" if recipe.norm_grad_rescale else None)
            if fp8 is not None:
                return fp8(next_fun, args, kwargs, context)
            return next_fun(*args, **kwargs)

    return intercept


# Activations a model reaches as module attributes (`nn.gelu`, `jax.nn.silu`), and the
# scalify activations that replace them: the same values and gradients, with the bounded
# gate and derivative computed in float32 under scalify (`scalify.ops.activations`).
ACTIVATIONS = {"gelu": gelu, "silu": silu, "swish": silu}
_ACTIVATION_MODULES = (jax.nn, nn, linen_activation)


def _fp8_saved(fn):
    """`fn(x, ...)` with `x` saved as E4M3 with a scale per 16 elements (`save_in_fp8`);
    keyword arguments (`approximate=...`) pass through."""
    def saved(x, *args, **kwargs):
        return save_in_fp8(functools.partial(fn, **kwargs) if kwargs else fn, GROUP16)(x, *args)

    return saved


@contextlib.contextmanager
def scaled_activations(fp8_saved: bool = False):
    """Context manager: `jax.nn`'s and `flax.linen`'s `gelu`, `silu` and `swish` are
    `scalify.ops`'s (`ACTIVATIONS`) while it is active, with `fp8_saved` their input kept
    for the backward pass as E4M3 with a scale per 16 elements (`save_in_fp8`). A function
    bound before (`from jax.nn import gelu`) is not replaced."""
    saved = [(m, name, getattr(m, name)) for m in _ACTIVATION_MODULES for name in ACTIVATIONS if hasattr(m, name)]
    swap = {name: _fp8_saved(fn) if fp8_saved else fn for name, fn in ACTIVATIONS.items()}
    try:
        for m, name, _ in saved:
            setattr(m, name, swap[name])
        yield
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)


@contextlib.contextmanager
def precision(recipe):
    """Context manager: linen models applied inside it compute in the formats of `recipe`
    (a `scalify.recipes.Recipe`; module doc). The apply must be traced inside the block,
    as in the recipe's step."""
    with contextlib.ExitStack() as stack:
        if recipe.compute_dtype is not None or recipe.fp8 or recipe.fp8_saved_activations:
            stack.enter_context(scaled_activations(recipe.fp8_saved_activations))
        stack.enter_context(nn.intercept_methods(_interceptor(recipe)))
        yield
