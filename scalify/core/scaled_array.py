"""ScaledArray: a tensor represented as `data * scale`.

`data` keeps the shape and a (possibly 8- or 16-bit) float dtype; `scale` is a power of
two (float32 by default), a scalar or any shape that broadcasts to `data`.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scalify.core.config import get_config
from scalify.core.errors import ScaleError
from scalify.core.lax_utils import widen
from scalify.core.pow2 import is_pow2, split_pow2

_GENERIC_SCALARS = (int, float, np.floating, np.integer)


@jax.tree_util.register_pytree_node_class
class ScaledArray:
    """A tensor `x = data * scale`, a JAX pytree with children (data, scale).

    `shape`, `dtype`, `ndim` and `size` are those of `data`. Build one with
    `scaled_array(data, scale)` (checked) or `as_scaled_array(x)`; the plain constructor
    checks the same things when both children are concrete arrays.
    """

    __slots__ = ("data", "scale")
    __array_priority__ = 1000  # so that NumPy defers to us in mixed expressions

    def __init__(self, data, scale):
        self.data = data
        self.scale = scale
        _check(data, scale)

    # -- pytree -------------------------------------------------------------------
    def tree_flatten(self):
        return (self.data, self.scale), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        # No checks here: JAX unflattens with placeholders (None, shardings, tracers).
        obj = object.__new__(cls)
        obj.data, obj.scale = children
        return obj

    # -- array-like metadata --------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.data.shape))

    @property
    def aval(self):
        return jax.core.ShapedArray(self.shape, self.dtype)

    def to_array(self, dtype=None):
        """Materialise `data * scale` in `dtype` (default: data's dtype).

        The product is computed in the wider of the data and scale dtypes (float32 for FP8 or
        FP16 data) and cast once at the end, so no intermediate overflows.
        """
        dtype = self.dtype if dtype is None else jnp.dtype(dtype)
        compute = compute_dtype(self.dtype, dtype)
        # widen: FP8 data keeps its rounding on GPU (see scalify.core.lax_utils.widen).
        out = widen(self.data, compute) * jnp.asarray(self.scale).astype(compute)
        return out.astype(dtype)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.to_array(), dtype=dtype)

    def astype(self, dtype) -> "ScaledArray":
        """Same value with data cast to `dtype` (scale unchanged)."""
        return ScaledArray(jnp.asarray(self.data).astype(dtype), self.scale)

    def __repr__(self) -> str:
        return f"ScaledArray(data={self.data!r}, scale={self.scale!r})"

    def __len__(self) -> int:
        return self.shape[0]

    def __jax_array__(self):
        raise TypeError(
            "A ScaledArray was passed to a JAX function that expects a plain array. Call it "
            "inside a function transformed with `scalify.scalify`, or convert explicitly with "
            "`x.to_array()` / `scalify.asarray(x)`."
        )


def compute_dtype(*dtypes):
    """The dtype in which scale arithmetic on `dtypes` is done: float64 if any is float64,
    else float32 (FP8, FP16 and BF16 data are up-cast; no implicit FP8 promotion in JAX)."""
    wide = any(jnp.dtype(d) == jnp.float64 for d in dtypes)
    return jnp.dtype(jnp.float64 if wide else jnp.float32)


def is_concrete(x) -> bool:
    """Whether x is a concrete (non-traced) array or number."""
    return isinstance(x, (np.ndarray, np.generic, *_GENERIC_SCALARS)) or (
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    )


def _check(data, scale) -> None:
    """Construction checks, on what is known statically (and values when concrete)."""
    if not (hasattr(data, "dtype") and hasattr(scale, "dtype") or is_concrete(scale)):
        return  # placeholders from pytree machinery
    if not hasattr(data, "dtype"):
        return
    if not jnp.issubdtype(data.dtype, jnp.floating):
        raise ScaleError(
            f"ScaledArray data must be a floating-point array, got dtype {data.dtype}. Integer "
            "and boolean values are never scaled: pass them as plain arrays."
        )
    scale_dtype = scale.dtype if hasattr(scale, "dtype") else np.asarray(scale).dtype
    if not jnp.issubdtype(scale_dtype, jnp.floating):
        raise ScaleError(f"ScaledArray scale must be a float array, got dtype {scale_dtype}.")
    scale_shape = np.shape(scale)
    try:
        out_shape = np.broadcast_shapes(tuple(data.shape), tuple(scale_shape))
    except ValueError:
        out_shape = None
    if out_shape != tuple(data.shape):
        raise ScaleError(
            f"ScaledArray scale of shape {scale_shape} does not broadcast to data of shape "
            f"{tuple(data.shape)}. Use a scalar scale or a shape that broadcasts to the data "
            "(e.g. (n, 1) for per-row scales)."
        )
    if is_concrete(scale):
        s = np.asarray(scale, dtype=np.float64)
        bad = ~is_pow2(s)
        if bad.any():
            raise ScaleError(
                f"ScaledArray scale must be a positive power of two, got {s[bad].ravel()[:4]}. "
                "Round it with `scalify.pow2_round`, or use `as_scaled_array(x)` which splits a "
                "value exactly into mantissa and power-of-two scale."
            )


def is_scaled_leaf(x: Any) -> bool:
    """`is_leaf` predicate for jax.tree_util: stops at ScaledArray (and at plain leaves)."""
    return isinstance(x, ScaledArray)


def _is_float_leaf(x) -> bool:
    if isinstance(x, (float, np.floating)):
        return True
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def scaled_array(data, scale, dtype=None, npapi=jnp) -> ScaledArray:
    """Construct a checked ScaledArray from data and scale.

    Args:
      data: array-like of float values.
      scale: a power of two, scalar or broadcastable to `data`.
      dtype: optional dtype of `data` (cast exactly as `data.astype(dtype)`).
      npapi: `jnp` (default) or `np` for host arrays.
    Returns:
      ScaledArray(data, scale) with scale in the configured scale dtype.
    """
    data = npapi.asarray(data, dtype=dtype)
    if not jnp.issubdtype(data.dtype, jnp.floating):
        raise ScaleError(
            f"scaled_array data must be floating point, got {data.dtype}; integer and "
            "boolean arrays are never scaled."
        )
    scale = npapi.asarray(scale, dtype=get_config().scale_dtype)
    return ScaledArray(data, scale)


def as_scaled_array(tree: Any, scale=None) -> Any:
    """Convert the float leaves of a pytree to ScaledArray; other leaves stay as they are.

    - Python floats and 0-d arrays are split exactly: `x = mantissa * 2^e`.
    - Arrays get scale 1, or `scale` when given (then `data = x / scale`, exact for a
      power-of-two scale as long as nothing under- or overflows).
    - ScaledArray leaves are kept.
    """

    def convert(x):
        if isinstance(x, ScaledArray) or not _is_float_leaf(x):
            return x
        sdtype = get_config().scale_dtype
        if scale is not None:
            s = jnp.asarray(scale, dtype=sdtype)
            xa = jnp.asarray(x)
            return ScaledArray((xa / s.astype(xa.dtype)).astype(xa.dtype), s)
        if isinstance(x, (float, np.floating)) or np.ndim(x) == 0:
            xa = jnp.asarray(x)
            mant, s = split_pow2(xa)
            return ScaledArray(mant, s.astype(sdtype))
        xa = jnp.asarray(x)
        return ScaledArray(xa, jnp.ones((), sdtype))

    return jax.tree_util.tree_map(convert, tree, is_leaf=is_scaled_leaf)


def asarray(tree: Any, dtype=None) -> Any:
    """Materialise every ScaledArray in a pytree (`data * scale`); other leaves unchanged."""
    return jax.tree_util.tree_map(
        lambda x: x.to_array(dtype) if isinstance(x, ScaledArray) else x,
        tree,
        is_leaf=is_scaled_leaf,
    )
