"""Where an FP8 recipe stores its matmul kernels: transposed, as (out, in).

A Flax `nn.Dense` kernel is (in, out). cuBLASLt's FP8 GEMM reads both operands with the
contracting dim minor, so every step of an FP8 layer with an (in, out) kernel transposes
it for the forward GEMM, and its weight gradient, which the GEMM writes as (out, in), is
transposed back before the optimizer reads it: at large widths these weight-sized
transposes (in float32, through the optimizer's state) cost as much as the FP8 GEMMs win.

An FP8 recipe therefore stores each 2-D `kernel` of a module it does not keep as a
`TransposedKernel` holding the (out, in) array: the optimizer's moments, the update and
the master encode all run in that layout, and the model sees the kernel transposed back,
`kernel = stored.T`, inside the differentiated function, where XLA cancels the transpose
against the GEMM's own layout. Values are unchanged; `TrainStep.params(state)` returns the
model's layout. A `TransposedKernel` handed to a model as it is fails loudly (it is not an
array), and its message says what to call instead.

Which leaves: a leaf at a path whose last key is "kernel", with 2 dimensions, under a
module path (the keys before it, a leading "params" collection dropped, joined by "/")
that `Recipe.keeps` does not keep. A 2-D kernel that is not a matmul's is stored
transposed too, which changes no value.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from scalify.core.scaled_array import ScaledArray, is_scaled_leaf

__all__ = ["TransposedKernel", "to_storage", "to_model"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TransposedKernel:
    """A model's (in, out) kernel stored as its (out, in) transpose (a pytree node: optax,
    orbax and `jax.tree_util` see the array inside)."""

    out_in: Any

    def __repr__(self) -> str:
        shape = tuple(getattr(self.out_in, "shape", ()))
        return (f"TransposedKernel(out_in of shape {shape}: a kernel an FP8 recipe stores transposed; "
                "give the model `train.params(state)`, not `state.params`)")

    def _not_an_array(self, *args, **kwargs):
        raise TypeError(f"{self!r} is not an array.")

    __array__ = __float__ = _not_an_array


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _transpose(x):
    if isinstance(x, ScaledArray):
        return ScaledArray.tree_unflatten(None, (x.data.T, x.scale))
    return x.T


def to_storage(recipe, params: Any) -> Any:
    """`params` in the model's layout -> `recipe`'s storage: with `recipe.fp8`, the 2-D
    kernels of the modules it does not keep become `TransposedKernel`s (module doc)."""
    if not recipe.fp8:
        return params

    def store(path, leaf):
        names = [_key_name(k) for k in path]
        if not names or names[-1] != "kernel" or jnp.ndim(leaf) != 2:
            return leaf
        module = names[1:-1] if names[0] == "params" else names[:-1]
        return leaf if recipe.keeps("/".join(module)) else TransposedKernel(_transpose(leaf))

    return jax.tree_util.tree_map_with_path(store, params, is_leaf=is_scaled_leaf)


def _is_transposed(x) -> bool:
    return isinstance(x, TransposedKernel)


def to_model(params: Any) -> Any:
    """`params` in a recipe's storage -> the model's layout (each `TransposedKernel`
    transposed back)."""
    return jax.tree_util.tree_map(lambda x: _transpose(x.out_in) if _is_transposed(x) else x, params,
                                  is_leaf=_is_transposed)
