"""`custom_scale`: give a function its own scale rule, as `jax.custom_jvp` gives a derivative.

    @scalify.custom_scale
    def swish(x):
        return x * jax.nn.sigmoid(x)

    @swish.defscale
    def _swish_scale(x: ScaledArray) -> ScaledArray:
        gate = jax.nn.sigmoid(materialize(x))        # bounded, on the value in float32
        return ScaledArray((x.data * gate).astype(x.dtype), x.scale)

`f.defbounds(rule)` may declare static bounds of the outputs' values (`|out| <= B` whatever
the inputs, e.g. sqrt(D) for a normalised row of D elements), which the product rule uses to
place a product with a bounded factor without measuring it (`scalify.core.value_bounds`).

Outside `scalify`, `swish` runs as written. Inside, on scaled inputs, the rule runs: its float
arguments arrive as `ScaledArray` (unscaled ones promoted as for any scale rule, integer ones
plain) and it returns the function's output structure with ScaledArray or plain leaves. A
function with no rule is scalified op by op, like plain code.

Design: a call binds the primitive `custom_scale_call`, whose params hold the function traced
to a jaxpr and a handle to the rule (looked up when the call is interpreted, so `defscale`
may come after the first call). It has an eager implementation and a lowering (the jaxpr,
inlined), a JVP and a batching rule, so it survives `jax.jit`, `jax.grad`, `jax.vmap` and
`jax.checkpoint` on either side of `scalify`.

Gradients:
- `scalify(jax.grad(f))`: `jax.grad` sees the primitive and differentiates the function as
  written (including any `jax.custom_jvp` inside it); the primal keeps the primitive, so the
  forward pass uses the scale rule, and the derivative's ops are scalified by their own rules.
  To give the derivative scale-friendly ops too, write the function as a `jax.custom_jvp`
  whose JVP calls `custom_scale` functions (see `scalify.ops.activations`).
- `jax.grad(scalify(f))`: the rule is what runs, so the gradient is the derivative of the
  rule's computation (equal to the function's wherever it is smooth). Choices of scales in
  a rule should sit under `jax.lax.stop_gradient`.

Limitation: the function and its rule must not close over traced values (take them as
arguments); under scalify a function that does and has a rule raises an error.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.interpreters import ad, batching

from scalify.core.errors import ScalifyError
from scalify.core.scaled_array import ScaledArray, is_scaled_leaf
from scalify.core.scale_flow import promote_inputs
from scalify.core.registry import register_call_rule
from scalify.interpreter import interpret_jaxpr, scalify
from scalify.ops._common import define_primitive, has_scaled

__all__ = ["custom_scale", "custom_scale_call_p"]


# ---------------------------------------------------------------------------------------
# The primitive
# ---------------------------------------------------------------------------------------
def _impl(*args, call_jaxpr, num_consts, callee):
    return jaxpr_as_fun(call_jaxpr)(*args)


def _abstract_eval(*avals, call_jaxpr, num_consts, callee):
    return list(call_jaxpr.out_avals)


custom_scale_call_p = define_primitive(
    "custom_scale_call", _impl, _abstract_eval, multiple_results=True
)


def _jvp(primals, tangents, *, call_jaxpr, num_consts, callee):
    # The primal keeps the primitive (its scale rule runs inside scalify); the tangent is the
    # JVP of the function as written.
    outs = custom_scale_call_p.bind(
        *primals, call_jaxpr=call_jaxpr, num_consts=num_consts, callee=callee
    )
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    _, t_outs = jax.jvp(jaxpr_as_fun(call_jaxpr), tuple(primals), tangents)
    return outs, list(t_outs)


def _batch(args, dims, *, call_jaxpr, num_consts, callee):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    in_axes = tuple(None if d is None else 0 for d in dims)
    avals = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in args]
    batched = jax.make_jaxpr(
        jax.vmap(jaxpr_as_fun(call_jaxpr), in_axes=in_axes, axis_size=size)
    )(*avals)
    callee = _BatchedCallee(callee, in_axes[num_consts:], size)
    outs = custom_scale_call_p.bind(*args, call_jaxpr=batched, num_consts=num_consts, callee=callee)
    return outs, [0] * len(outs)


ad.primitive_jvps[custom_scale_call_p] = _jvp
batching.primitive_batchers[custom_scale_call_p] = _batch


# ---------------------------------------------------------------------------------------
# Handles to the rule, held in the primitive's params (hashable)
# ---------------------------------------------------------------------------------------
def _merge(dyn: Sequence[Any], statics: tuple) -> list:
    """Positional arguments from the dynamic ones and ((argnum, value), ...) statics."""
    args, it = [], iter(dyn)
    static = dict(statics)
    for i in range(len(dyn) + len(static)):
        args.append(static[i] if i in static else next(it))
    return args


@dataclasses.dataclass(frozen=True)
class _Callee:
    """The custom_scale function of a call, its static arguments and pytree structures."""

    fn: "custom_scale"
    statics: tuple
    in_tree: Any
    out_tree: Any

    @property
    def rule(self):
        return self.fn.scale_rule

    def __repr__(self) -> str:
        return self.fn.__name__

    def apply_rule(self, flat_args: Sequence[Any]) -> list:
        args = _merge(jax.tree_util.tree_unflatten(self.in_tree, list(flat_args)), self.statics)
        out = self.rule(*args)
        flat, tree = jax.tree_util.tree_flatten(out, is_leaf=is_scaled_leaf)
        if tree != self.out_tree:
            raise ScalifyError(
                f"The scale rule of custom_scale function '{self.fn.__name__}' returned the "
                f"structure {tree}, but the function returns {self.out_tree}. A rule must return "
                "the same structure, with ScaledArray or plain arrays as leaves."
            )
        return flat

    def out_bounds(self, avals: Sequence[Any]) -> list | None:
        """Static bounds |out| <= B of the outputs, one per flat output (None where unbounded),
        from the function's `defbounds` on the arguments' shapes; None without it."""
        if self.fn.bounds_rule is None:
            return None
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
        args = _merge(jax.tree_util.tree_unflatten(self.in_tree, structs), self.statics)
        bounds = self.fn.bounds_rule(*args)
        flat = jax.tree_util.tree_leaves(bounds, is_leaf=lambda b: b is None)
        if len(flat) != self.out_tree.num_leaves:
            raise ScalifyError(
                f"The bounds rule of custom_scale function '{self.fn.__name__}' gave {len(flat)} "
                f"bounds for {self.out_tree.num_leaves} outputs: give one per output (None where "
                "there is none)."
            )
        return flat


@dataclasses.dataclass(frozen=True)
class _BatchedCallee:
    """The rule of a call under `jax.vmap`: the inner rule, vmapped."""

    inner: Any
    in_axes: tuple  # 0 or None per (non-const) argument
    size: int

    @property
    def rule(self):
        return self.inner.rule

    @property
    def fn(self):
        return self.inner.fn

    def __repr__(self) -> str:
        return f"vmap({self.inner!r})"

    def apply_rule(self, flat_args: Sequence[Any]) -> list:
        args, axes = [], []
        for x, ax in zip(flat_args, self.in_axes):
            if isinstance(x, ScaledArray):
                s, s_ax = jnp.asarray(x.scale), None
                if ax is not None and s.ndim == x.ndim and s.ndim > 0:
                    if s.shape[0] == 1:
                        s = s.reshape(s.shape[1:])
                    else:
                        s_ax = 0  # a per-example scale
                x = ScaledArray.tree_unflatten(None, (x.data, s))
                ax = ScaledArray.tree_unflatten(None, (ax, s_ax))
            args.append(x)
            axes.append(ax)
        scaled: list[bool] = []

        def split(*a):
            outs = self.inner.apply_rule(a)
            scaled[:] = [isinstance(o, ScaledArray) for o in outs]
            datas = [o.data if isinstance(o, ScaledArray) else o for o in outs]
            scales = [jnp.asarray(o.scale) if isinstance(o, ScaledArray) else jnp.zeros(()) for o in outs]
            return datas, scales

        vmap = functools.partial(jax.vmap, split, in_axes=tuple(axes), axis_size=self.size)
        try:  # scales that do not depend on the example stay unbatched
            datas, scales = vmap(out_axes=(0, None))(*args)
            batched = False
        except ValueError:
            datas, scales = vmap(out_axes=0)(*args)
            batched = True
        outs = []
        for d, s, sc in zip(datas, scales, scaled):
            if not sc:
                outs.append(d)
                continue
            if batched:
                inner = s.shape[1:]
                s = s.reshape((self.size,) + (1,) * (d.ndim - 1 - len(inner)) + inner)
            outs.append(ScaledArray(d, s))
        return outs


# ---------------------------------------------------------------------------------------
# The scale rule of the call
# ---------------------------------------------------------------------------------------
@register_call_rule(custom_scale_call_p)
def _custom_scale_call_rule(invals, scalars, *, call_jaxpr, num_consts, callee):
    """custom_scale_call: the function's scale rule on its arguments (float ones promoted to
    ScaledArray); with no rule, the function's body is scalified op by op."""
    if callee.rule is None:
        return interpret_jaxpr(call_jaxpr.jaxpr, call_jaxpr.consts, invals, scalars)
    if num_consts:
        raise ScalifyError(
            f"custom_scale function '{callee.fn.__name__}' closes over {num_consts} traced "
            "value(s), which its scale rule cannot see. Pass them to it as arguments."
        )
    return callee.apply_rule(promote_inputs(invals, scalars))


# ---------------------------------------------------------------------------------------
# The decorator
# ---------------------------------------------------------------------------------------
class custom_scale:
    """Decorate a function to give it a scale rule with `f.defscale(rule)`.

    Args:
      fun: the function (positional array arguments, pytrees allowed; returns a pytree of
        arrays).
      static_argnums: positions of hashable non-array arguments; they are passed to the rule
        at the same positions.
    See the module docstring for the semantics, in particular of gradients.
    """

    def __init__(self, fun: Callable, static_argnums: int | Sequence[int] = ()):
        functools.update_wrapper(self, fun)
        self.__name__ = getattr(fun, "__name__", type(fun).__name__)
        self.fun = fun
        nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        if any(i < 0 for i in nums):
            raise ValueError(f"static_argnums must be non-negative, got {nums}.")
        self.static_argnums = tuple(sorted(nums))
        self.scale_rule: Callable | None = None
        self.bounds_rule: Callable | None = None
        self._cache: dict[Any, tuple] = {}
        self._eager: dict[Any, Callable] = {}

    def defscale(self, rule: Callable) -> Callable:
        """Set the scale rule: `rule(*args)` with float arguments as ScaledArray, returning
        the function's output structure (ScaledArray or plain leaves). Returns `rule`."""
        self.scale_rule = rule
        return rule

    def defbounds(self, rule: Callable) -> Callable:
        """Declare static bounds of the outputs' values: `rule(*args)`, with the array
        arguments as `jax.ShapeDtypeStruct`s and the static ones as given, returns the
        output structure with a float B (|value| <= B for every element, whatever the
        inputs) or None per output. The scale rules of the ops that use an output read
        its bound (`scalify.core.value_bounds`): a product with a bounded factor is placed
        without measuring it. Returns `rule`."""
        self.bounds_rule = rule
        return rule

    def __get__(self, obj, objtype=None):  # usable as a method
        return self if obj is None else functools.partial(self, obj)

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise TypeError(
                f"custom_scale function '{self.__name__}' takes positional arguments only; got "
                f"keywords {sorted(kwargs)}. Use static_argnums for non-array options."
            )
        statics = tuple((i, args[i]) for i in self.static_argnums if i < len(args))
        try:
            hash(statics)
        except TypeError:
            raise TypeError(
                f"custom_scale function '{self.__name__}': static arguments must be hashable, "
                f"got {statics}."
            ) from None
        dyn = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
        if has_scaled(dyn):
            return self._eager_scalified(statics)(*dyn)
        leaves, in_tree = jax.tree_util.tree_flatten(dyn)
        leaves = [jnp.asarray(x) for x in leaves]
        avals = tuple(_struct(x) for x in leaves)
        closed, hoisted, out_tree = self._trace(statics, in_tree, avals)
        outs = custom_scale_call_p.bind(
            *hoisted,
            *leaves,
            call_jaxpr=closed,
            num_consts=len(hoisted),
            callee=_Callee(self, statics, in_tree, out_tree),
        )
        return jax.tree_util.tree_unflatten(out_tree, outs)

    def _eager_scalified(self, statics):
        """Outside scalify with ScaledArray arguments: run under scalify (so the rule runs)."""
        if statics not in self._eager:
            self._eager[statics] = scalify(lambda *dyn: self(*_merge(dyn, statics)))
        return self._eager[statics]

    def _trace(self, statics, in_tree, avals):
        key = (statics, in_tree, avals)
        if key in self._cache:
            return self._cache[key]
        out_trees = []

        def flat_fun(*flat):
            out = self.fun(*_merge(jax.tree_util.tree_unflatten(in_tree, list(flat)), statics))
            flat_out, out_tree = jax.tree_util.tree_flatten(out)
            out_trees.append(out_tree)
            return flat_out

        closed = jax.make_jaxpr(flat_fun)(*avals)
        if closed.effects:
            raise ScalifyError(
                f"custom_scale function '{self.__name__}' has side effects ({closed.effects}); "
                "it must be a pure function."
            )
        traced = [i for i, c in enumerate(closed.consts) if isinstance(c, jax.core.Tracer)]
        if not traced:
            entry = (closed, [], out_trees[0])
            self._cache[key] = entry
            return entry
        # Values closed over from an enclosing trace become explicit (leading) operands.
        hoisted = [closed.consts[i] for i in traced]

        def with_consts(*all_args):
            consts = list(closed.consts)
            for i, v in zip(traced, all_args):
                consts[i] = v
            return jaxpr_as_fun(ClosedJaxpr(closed.jaxpr, consts))(*all_args[len(traced) :])

        closed = jax.make_jaxpr(with_consts)(*[_struct(c) for c in hoisted], *avals)
        return closed, hoisted, out_trees[0]


def _struct(x) -> jax.ShapeDtypeStruct:
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))
