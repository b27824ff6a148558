"""Diagnostics for optimizer states: memory per parameter and quantisation error."""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from scalify.optim.codecs import is_stored_leaf
from scalify.optim.wrappers import QuantizedState, values

__all__ = [
    "tree_nbytes",
    "parameter_count",
    "bytes_per_parameter",
    "dequantize_state",
    "QuantizationError",
    "quantization_error",
]


def tree_nbytes(tree: Any) -> int:
    """Bytes held by the array leaves of a pytree (every child of ScaledArray, BlockwiseArray
    and CoatArray counts: data, scales, absmax, k). Python scalars count as nothing."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        if hasattr(x, "dtype") and hasattr(x, "shape"):
            total += int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def parameter_count(params: Any) -> int:
    """Number of parameter elements (a ScaledArray counts its data elements only)."""
    n = 0
    for x in jax.tree_util.tree_leaves(params, is_leaf=is_stored_leaf):
        shape = x.shape if hasattr(x, "shape") else np.shape(x)
        n += int(np.prod(shape, dtype=np.int64))
    return n


def bytes_per_parameter(tree: Any, params: Any) -> float:
    """Bytes of `tree` (an optimizer state, or the params themselves for master-weight
    bytes) per parameter element of `params`. Works for any pytree, scaled or not.

    Example: `optax.adamw` in float32 gives 8.0 (+ 4 bytes for the step count in total);
    `bytes_per_parameter(params, params)` gives 4.0 for float32 params, ~2.0 for
    `scaled_params(params, jnp.float16)`.
    """
    n = parameter_count(params)
    if n == 0:
        raise ValueError("bytes_per_parameter: `params` has no array leaves to count.")
    return tree_nbytes(tree) / n


def dequantize_state(state: Any) -> Any:
    """The state with every stored leaf decoded to float32 and every `QuantizedState`
    replaced by its inner state: the structure of the unwrapped transformation's state
    (e.g. `adamw_8bit(...)` state -> the structure of `optax.adamw(...)`'s)."""

    def unwrap(x):
        if isinstance(x, QuantizedState):
            return dequantize_state(x.inner)
        return values(x)

    return jax.tree_util.tree_map(
        unwrap, state, is_leaf=lambda x: isinstance(x, QuantizedState) or is_stored_leaf(x)
    )


class QuantizationError(NamedTuple):
    """Result of `quantization_error`."""

    rel_l2: float  # ||q - r|| / ||r|| over all compared float leaves
    max_abs: float  # max |q - r| over all compared float leaves
    per_leaf: dict  # key path string -> rel_l2 of that leaf


def quantization_error(state: Any, reference_state: Any) -> QuantizationError:
    """Error of a (quantised) optimizer state against a reference state of the same
    transformation, e.g. `adamw_8bit` state vs `optax.adamw` float32 state after the same
    gradients. Both are decoded with `dequantize_state`; float leaves are compared in
    float64 and integer leaves (step counts) must be equal.

    Raises:
      ValueError: if the decoded structures differ (say which transformation to compare).
    """
    q = dequantize_state(state)
    r = dequantize_state(reference_state)
    q_leaves, q_def = jax.tree_util.tree_flatten_with_path(q)
    r_leaves, r_def = jax.tree_util.tree_flatten_with_path(r)
    if q_def != r_def:
        raise ValueError(
            "quantization_error: the decoded state and the reference state have different "
            f"structures:\n  state:     {q_def}\n  reference: {r_def}\nCompare a state with "
            "the state of the same transformation without quantisation (e.g. adamw_8bit(...) "
            "with optax.adamw(...) of the same hyperparameters)."
        )
    num = den = 0.0
    max_abs = 0.0
    per_leaf = {}
    for (path, a), (_, b) in zip(q_leaves, r_leaves):
        a, b = np.asarray(a), np.asarray(b)
        if not np.issubdtype(b.dtype, np.floating):
            if not np.array_equal(a, b):
                raise ValueError(
                    f"quantization_error: non-float leaf {jax.tree_util.keystr(path)} differs "
                    f"({a} vs {b}); the states are not at the same step."
                )
            continue
        d = a.astype(np.float64) - b.astype(np.float64)
        dn, rn = float(np.sum(d * d)), float(np.sum(b.astype(np.float64) ** 2))
        num, den = num + dn, den + rn
        max_abs = max(max_abs, float(np.max(np.abs(d), initial=0.0)))
        per_leaf[jax.tree_util.keystr(path)] = float(np.sqrt(dn / rn)) if rn > 0 else float(np.sqrt(dn))
    rel = float(np.sqrt(num / den)) if den > 0 else float(np.sqrt(num))
    return QuantizationError(rel, max_abs, per_leaf)
