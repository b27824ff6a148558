"""Helpers shared by the ops: primitive definition, argument checks, eager ScaledArray calls."""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from scalify.core.config import get_config
from scalify.core.errors import ScaleError
from scalify.core.lax_utils import select
from scalify.core.pow2 import is_pow2, pow2_round
from scalify.core.scaled_array import ScaledArray, broadcasts_to, is_concrete, is_scaled_leaf
from scalify.interpreter import scalify


def define_primitive(name: str, impl: Callable, abstract_eval: Callable, multiple_results=False):
    """A Primitive with `impl` as eager implementation and as lowering (inlined in the HLO)."""
    prim = Primitive(name)
    prim.multiple_results = multiple_results
    prim.def_impl(impl)
    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=multiple_results))
    return prim


def has_scaled(*trees) -> bool:
    """Whether a ScaledArray appears in any of the pytrees."""
    leaves = jax.tree_util.tree_leaves(trees, is_leaf=is_scaled_leaf)
    return any(isinstance(x, ScaledArray) for x in leaves)


def dtype_of(x):
    """The dtype `x` has (or would have as a JAX array)."""
    if isinstance(x, ScaledArray) or hasattr(x, "dtype"):
        return jnp.dtype(x.dtype)
    return jnp.result_type(x)


def check_float(x, op: str) -> None:
    """Raise ScaleError unless `x` is floating point (integers and booleans are never scaled)."""
    dtype = dtype_of(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ScaleError(
            f"scalify.{op} expects a floating-point array, got dtype {dtype}. Integer and boolean "
            "values are never scaled: leave them out of the scaling op, or cast them to a float "
            "dtype first."
        )


def check_pow2(value, what: str, op: str) -> None:
    """Raise ScaleError if a concrete `value` is not (elementwise) a positive power of two."""
    if isinstance(value, ScaledArray):
        value = value.to_array(jnp.float32) if is_concrete(value.data) else None
    if value is None or not is_concrete(value):
        return
    arr = np.asarray(value, dtype=np.float64)
    bad = ~is_pow2(arr)
    if bad.any():
        raise ScaleError(
            f"scalify.{op}: {what} must be a positive power of two, got {arr[bad].ravel()[:4]}. "
            f"Round it first, e.g. `scalify.pow2_round({what})`."
        )


def as_scale_operand(value, op: str, what: str = "scale"):
    """A scale-like operand as a float array of the configured scale dtype."""
    if isinstance(value, ScaledArray):
        return value
    dtype = dtype_of(value)
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise ScaleError(f"scalify.{op}: {what} must be a number or float array, got {dtype}.")
    return jnp.asarray(value).astype(get_config().scale_dtype)


def check_broadcasts(scale_shape, data_shape, op: str, what: str = "scale") -> None:
    """Raise ScaleError if `scale_shape` does not broadcast to `data_shape`."""
    if not broadcasts_to(scale_shape, data_shape):
        raise ScaleError(
            f"scalify.{op}: {what} of shape {tuple(scale_shape)} does not broadcast to the data "
            f"shape {tuple(data_shape)}. Use a scalar or a shape that broadcasts to the data "
            "(e.g. (n, 1) for per-row scales)."
        )


@functools.cache
def scalified(fn: Callable) -> Callable:
    """`scalify(fn)`, cached: ops called eagerly on ScaledArray outside scalify use it."""
    return scalify(fn)


def requested_scale(scale: ScaledArray, fallback) -> jax.Array:
    """The power of two a scaling op is asked for, in the configured scale dtype.

    A power of two is kept exactly. A traced value that is not one is rounded (the represented
    value does not change: data is computed relative to the rounded scale); 0, inf and nan
    keep `fallback` (a scale of 0 or inf would turn every value into nan). No gradient flows
    into the choice of a scale.
    """
    sdtype = get_config().scale_dtype
    s = scale.data.astype(jnp.float32) * jnp.asarray(scale.scale).astype(jnp.float32)
    s = lax.stop_gradient(jnp.abs(s))
    rounded = pow2_round(s.astype(sdtype))
    ok = jnp.isfinite(rounded) & (rounded > 0)
    return select(ok, rounded, jnp.asarray(fallback).astype(sdtype))


def batch_scale_operand(s, bs, x_ndim: int, size: int):
    """A batched scale-like operand reshaped to broadcast against data batched at axis 0."""
    if bs is None:
        return s
    s = jnp.moveaxis(s, bs, 0)
    inner = s.shape[1:]
    return jnp.reshape(s, (size,) + (1,) * (x_ndim - len(inner)) + tuple(inner))

