"""Where an FP8 recipe stores its matmul kernels: transposed, as (out, in).

A Flax `nn.Dense` kernel is (in, out). cuBLASLt's FP8 GEMM reads both operands with the
contracting dim minor, so every step of an FP8 layer with an (in, out) kernel transposes
it for the forward GEMM, and its weight gradient, which the GEMM writes as (out, in), is
transposed back before the optimizer reads it: at large widths these weight-sized
transposes (in float32, through the optimizer's state) cost as much as the FP8 GEMMs win.

An FP8 recipe therefore stores each 2-D `kernel` of a module it does not keep as
(out, in): the optimizer's moments, the update and the master encode all run in that
layout, and the model sees the kernel transposed back, `kernel = stored.T`, inside the
differentiated function, where XLA cancels the transpose against the GEMM's own layout.
Values are unchanged; `TrainStep.params(state)` returns the model's layout.

Which leaves: a leaf at a path whose last key is "kernel", with 2 dimensions, under a
module path (the keys before it, a leading "params" collection dropped, joined by "/")
that `Recipe.keeps` does not keep. A 2-D kernel that is not a matmul's is stored
transposed too, which changes no value.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from scalify.core.scaled_array import ScaledArray, is_scaled_leaf

__all__ = ["out_in_kernels", "to_storage", "to_model"]


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def out_in_kernels(recipe, params: Any) -> Any:
    """A tree of bools with `params`' structure: True where `recipe` stores the leaf as
    (out, in) (module doc); all False unless `recipe.fp8`."""

    def stored_transposed(path, leaf) -> bool:
        names = [_key_name(k) for k in path]
        if not recipe.fp8 or not names or names[-1] != "kernel" or jnp.ndim(leaf) != 2:
            return False
        module = names[1:-1] if names[0] == "params" else names[:-1]
        return not recipe.keeps("/".join(module))

    return jax.tree_util.tree_map_with_path(stored_transposed, params, is_leaf=is_scaled_leaf)


def _transpose(x):
    if isinstance(x, ScaledArray):
        return ScaledArray.tree_unflatten(None, (x.data.T, x.scale))
    return x.T


def _apply(mask: Any, tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda t, x: _transpose(x) if t else x, mask, tree, is_leaf=is_scaled_leaf)


def to_storage(mask: Any, params: Any) -> Any:
    """`params` in the model's layout -> the recipe's storage layout (`mask` from
    `out_in_kernels`)."""
    return _apply(mask, params)


def to_model(mask: Any, params: Any) -> Any:
    """`params` in the recipe's storage layout -> the model's layout (the same transposes:
    a 2-D transpose is its own inverse)."""
    return _apply(mask, params)
