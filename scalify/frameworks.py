"""Arguments that are modules of Flax NNX or Equinox: how `scalify` passes them to the trace.

`scalify` traces its function with `jax.make_jaxpr` over the pytree leaves of the
arguments, so the function runs on copies of its arguments. Two module frameworks need more:

- **Flax NNX** graph nodes (`nnx.Module`, `nnx.Optimizer`, `nnx.Variable`, `nnx.Rngs`) are
  mutable: a step that calls `optimizer.update(model, grads)` changes them in place. The
  argument nodes are split into a static graph definition and a state of Variables
  (`nnx.split`, shared Variables counted once); the trace merges them back (`nnx.merge`),
  runs the function, and returns the nodes' final state as extra outputs, which are written
  back into the caller's objects (`nnx.update`), as `nnx.jit` does. A function that returns
  one of its argument nodes returns the caller's object.
- **Equinox** modules keep options as Python fields (`Dropout(p=0.0)`) that their code
  reads as Python values. Inside an `eqx.Module`, only arrays (and ScaledArrays) are
  traced; every other leaf, Python numbers included, is static, as `eqx.filter_jit` does.
  Elsewhere Python numbers are traced, as `jax.jit` does (a learning rate passed each step
  does not re-trace).
- A module (or a bound method of one) given as the function itself, `scalify(model)`, is
  passed as an argument, so these rules apply to it too.

Neither framework is imported here: a value can only be one of their objects if the
framework's package is already imported, so the checks look them up in `sys.modules`.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Sequence

import jax
import numpy as np

from scalify.core.errors import ScaledTypeError
from scalify.core.scaled_array import ScaledArray, is_scaled_leaf

__all__ = ["GraphArgs", "dynamic_mask", "leaf_names", "module_call", "traced_number_note"]


# ---------------------------------------------------------------------------------------
# Equinox: which leaves are traced
# ---------------------------------------------------------------------------------------
def _eqx_module_type():
    eqx = sys.modules.get("equinox")
    return getattr(eqx, "Module", None)


def _is_array(x) -> bool:
    """The leaves that `eqx.filter_jit` traces (jax/NumPy arrays and scalars), plus
    ScaledArrays."""
    return isinstance(x, (ScaledArray, jax.Array, np.ndarray, np.number, np.bool_))


def dynamic_mask(tree, is_dynamic: Callable[[Any], bool]) -> list[bool]:
    """For each leaf of `tree` (flattened with `is_scaled_leaf`): traced or static.

    Leaves inside an Equinox module are traced iff they are arrays; others follow
    `is_dynamic`. The order is that of `jax.tree_util.tree_leaves(tree, is_scaled_leaf)`:
    stopping the flatten at a module and flattening it next keeps depth-first order.
    """
    module = _eqx_module_type()
    if module is None:
        leaves = jax.tree_util.tree_leaves(tree, is_leaf=is_scaled_leaf)
        return [is_dynamic(x) for x in leaves]
    stop = lambda x: isinstance(x, (ScaledArray, module))  # noqa: E731
    mask = []
    for x in jax.tree_util.tree_leaves(tree, is_leaf=stop):
        if isinstance(x, module):
            mask += [_is_array(y) for y in jax.tree_util.tree_leaves(x, is_leaf=is_scaled_leaf)]
        else:
            mask.append(is_dynamic(x))
    return mask


def leaf_names(tree) -> list[str]:
    """A readable name per leaf of the traced arguments `tree` (flattened with
    `is_scaled_leaf`): `args[1].lr`, `kwargs['rate']`, or `NNX state[...]` for the state of
    NNX argument nodes (see GraphArgs.tree)."""
    nnx_tree = isinstance(tree, tuple) and len(tree) == 3 and isinstance(tree[1], _GraphDef)
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_scaled_leaf)[0]:
        if nnx_tree:
            if path[0].idx == 2:
                names.append("NNX state" + jax.tree_util.keystr(path[1:]))
                continue
            path = path[1:]
        head = "args" if path[0].idx == 0 else "kwargs"
        names.append(head + jax.tree_util.keystr(path[1:]))
    return names


def traced_number_note(fn, tree, leaves: Sequence[Any], dynamic: Sequence[bool]) -> str | None:
    """The note added to an error raised while tracing `fn` with Python numbers among its
    traced leaves (they may be what the function needed as Python values), else None."""
    numbers = (int, float, complex)
    traced = [d and isinstance(x, numbers) and not isinstance(x, bool) for x, d in zip(leaves, dynamic)]
    if not any(traced):
        return None
    where = [name for name, t in zip(leaf_names(tree), traced) if t]
    name = getattr(fn, "__name__", repr(fn))
    shown = ", ".join(where[:4]) + (", ..." if len(where) > 4 else "")
    return (
        f"scalify({name}) traced the Python number(s) at {shown} as arrays, as "
        "jax.jit does. If the function needs a Python value there (an `if`, a "
        "shape, a module option such as a dropout rate), make it static: "
        "`scalify(fn, static_argnums=...)` / `static_argnames=...`, or bind it with "
        "functools.partial; for a module that keeps options in Python fields, mark the "
        "fields static (Equinox modules' non-array fields already are)."
    )


# ---------------------------------------------------------------------------------------
# A module as the function: scalify(model), scalify(model.method)
# ---------------------------------------------------------------------------------------
def _is_module(x) -> bool:
    module = _eqx_module_type()
    nnx = _nnx()
    return (module is not None and isinstance(x, module)) or (nnx is not None and nnx.graph.is_graph_node(x))


def module_call(fn) -> tuple[Any, Callable] | None:
    """`(module, call)` when `fn` is an NNX / Equinox module or a bound method of one, so
    that `fn(*a, **k) == call(module, *a, **k)`; else None. Passed as the first argument,
    the module's arrays are traced (ScaledArray parameters included) and NNX updates are
    written back, instead of being captured as constants of the trace."""
    if _is_module(fn):
        return fn, _call_module
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", None)
    if owner is not None and func is not None and _is_module(owner):
        return owner, func
    return None


def _call_module(module, *args, **kwargs):
    return module(*args, **kwargs)


# ---------------------------------------------------------------------------------------
# Flax NNX: in-place semantics
# ---------------------------------------------------------------------------------------
def _nnx():
    """flax.nnx if the user imported it (no NNX object can exist otherwise), else None."""
    return sys.modules.get("flax.nnx")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _NodeSlot:
    """Where argument node `index` sits in the arguments (or in the output)."""

    index: int


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _GraphDef:
    """The static graph definition of the argument nodes (part of the trace cache key)."""

    graphdef: Any


class GraphArgs:
    """The NNX graph nodes among a call's arguments, split for the trace and updated back.

    `tree` replaces (args, kwargs) for the trace: `((args, kwargs) with each node replaced
    by a slot, graph definition, state)`. `wrap(call)` is the traced function of `tree`;
    `finish(out)` writes the nodes' final state into the caller's nodes and returns the
    function's output with the caller's nodes where it returned argument nodes.
    """

    def __init__(self, nodes: list, tree):
        nnx = _nnx()
        self.nodes = nodes
        graphdef, state = nnx.split(nodes)
        self.tree = (tree, _GraphDef(graphdef), state)

    @classmethod
    def split(cls, tree) -> "GraphArgs | None":
        """Replace the NNX graph nodes of `tree` by slots; None when it holds none."""
        nnx = _nnx()
        if nnx is None:
            return None
        is_node = nnx.graph.is_graph_node
        stop = lambda x: isinstance(x, ScaledArray) or is_node(x)  # noqa: E731
        leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=stop)
        nodes: list = []
        slots = []
        for x in leaves:
            if is_node(x):
                i = next((k for k, n in enumerate(nodes) if n is x), len(nodes))
                if i == len(nodes):
                    nodes.append(x)
                slots.append(_NodeSlot(i))
            else:
                slots.append(x)
        if not nodes:
            return None
        return cls(nodes, jax.tree_util.tree_unflatten(treedef, slots))

    @staticmethod
    def wrap(call: Callable) -> Callable:
        """`call(args, kwargs)` as a function of `tree`, returning (output, final state)."""

        def traced(tree):
            (args, kwargs), gdef, state = tree
            nnx = _nnx()
            nodes = nnx.merge(gdef.graphdef, state)
            fill = lambda x: nodes[x.index] if isinstance(x, _NodeSlot) else x  # noqa: E731
            args, kwargs = jax.tree_util.tree_map(fill, (args, kwargs), is_leaf=_is_slot)
            out = call(args, kwargs)
            new_gdef, new_state = nnx.split(nodes)
            if new_gdef != gdef.graphdef:
                raise ScaledTypeError(
                    "A function transformed by scalify changed the structure of an NNX "
                    "argument (added or removed a Variable or submodule, or changed a static "
                    "attribute). scalify writes back in-place value updates only: make the "
                    "structural change outside the scalified function."
                )
            returned = lambda x: any(x is n for n in nodes)  # noqa: E731
            out = jax.tree_util.tree_map(
                lambda x: _NodeSlot(next(i for i, n in enumerate(nodes) if n is x)) if returned(x) else x,
                out,
                is_leaf=lambda x: returned(x) or isinstance(x, ScaledArray),
            )
            return out, new_state

        return traced

    def finish(self, result):
        """Write the final state into the caller's nodes; return the function's output."""
        out, state = result
        _nnx().update(self.nodes, state)
        fill = lambda x: self.nodes[x.index] if isinstance(x, _NodeSlot) else x  # noqa: E731
        return jax.tree_util.tree_map(fill, out, is_leaf=_is_slot)


def _is_slot(x) -> bool:
    return isinstance(x, (_NodeSlot, ScaledArray))
