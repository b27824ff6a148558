"""Scale rules of call-like and control-flow primitives.

Every rule here is a "call rule": it gets the raw inputs (ScaledArray or plain) and their
broadcast-scalar metadata, interprets the sub-jaxpr(s) on them with `interpret_jaxpr`, and
re-binds the call through JAX's public API so that its options survive:

| primitive | re-bound with | kept |
|---|---|---|
| jit (pjit) | `jax.jit` | name, donation, keep_unused, inline, shardings, compiler options |
| closed_call | `closed_call_p` on a re-traced jaxpr | the call |
| remat2 | `jax.checkpoint` | policy, prevent_cse, differentiated |
| scan | `jax.lax.scan` | length, reverse, unroll |
| while | `jax.lax.while_loop` | |
| cond | `jax.lax.switch` | |
| custom_jvp_call | `jax.custom_jvp` | the custom derivative |
| custom_vjp_call | `jax.custom_vjp` | the custom fwd/bwd |
| sharding_constraint, optimization_barrier | the primitive / `jax.lax.optimization_barrier` | |

A ScaledArray crosses a call boundary as two leaves, its data and its scale. Data keeps
the input's options (donation, sharding); scales are tiny, never donated and replicated.
Re-wrapped jits are cached per sub-jaxpr, input layout, avals and config, so that calling a
scalified function eagerly does not recompile its inner jits on every call.

Loops and branches carry values as (data, scale) pairs, so the scale of a carry may change
per iteration. Scaledness must agree between the initial carry and the body's output (and
between branches of a cond): a carry that becomes scaled in the body is promoted in the
initial value (the exact split of a broadcast scalar; the largest scale of the loop's
inputs for "any scale" values such as a zero initial carry; else 1), and scale shapes/dtypes
are unified by broadcasting. This is a fixed point found by re-tracing the body only when
the first trace shows a mismatch.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex
from jax.extend.core import primitives as jprims

from scalify.core import observe
from scalify.core.config import get_config
from scalify.core.errors import ScalifyError
from scalify.core.scaled_array import ScaledArray, compute_dtype
from scalify.core.scale_flow import conform_constant, promote, reference_scale
from scalify.core.guards import rebalance_drift
from scalify.core.scale_flow import unchecked_scaled as _scaled
from scalify.core.lax_utils import bind_as_is
from scalify.core.lru import LRUCache
from scalify.core.registry import register_call_rule, register_scale_rule
from scalify.interpreter import interpret_jaxpr

# ---------------------------------------------------------------------------------------
# Crossing a call boundary: raw inputs <-> flat leaves of a JAX-level function
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Static:
    """A literal value (closed over by a traced function), hashable by dtype and bytes."""

    value: Any

    def _key(self):
        a = np.asarray(self.value)
        return (a.dtype.str, a.shape, a.tobytes(), type(self.value))

    def __eq__(self, other):
        return isinstance(other, Static) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


# Per-input entries of a layout.
SCALED = "scaled"  # two leaves: data, scale
_LEAF = "leaf"  # one leaf
_EXTRA = "extra"  # broadcast-scalar metadata passed as an extra leaf (it is traced)


def _is_literal(x) -> bool:
    """A Python/NumPy 0-d value: a jaxpr literal. Closed over so its value stays static."""
    return isinstance(x, (bool, int, float, complex, np.generic, np.ndarray)) and np.ndim(x) == 0


def pack_inputs(invals: Sequence[Any], scalars: Sequence[Any]):
    """Split a call's raw inputs into a hashable layout and the list of leaves.

    Layout entries per input: `(SCALED,)`, `(_LEAF, meta)` or `Static(literal)`, where
    `meta` is None, `Static(scalar)` (a literal broadcast scalar) or `_EXTRA` (a traced
    broadcast scalar, appended to the leaves after all inputs). Literal inputs are closed
    over (so that `jnp.where(m, x, -inf)` keeps its static "any scale" -inf); 0-d traced
    inputs need no metadata: inside, a 0-d value is its own broadcast scalar.
    """
    layout, leaves, extras = [], [], []
    for x, s in zip(invals, scalars):
        if isinstance(x, ScaledArray):
            layout.append((SCALED,))
            leaves += [x.data, x.scale]
        elif _is_literal(x):
            layout.append(Static(x))
        else:
            meta = None
            if s is not None and np.ndim(x) > 0:
                if _is_literal(s):
                    meta = Static(s)
                else:
                    meta = _EXTRA
                    extras.append(s)
            layout.append((_LEAF, meta))
            leaves.append(x)
    return tuple(layout), leaves + extras


def unpack_inputs(layout, leaves):
    """Inverse of `pack_inputs`: (invals, scalars)."""
    n_extra = sum(1 for e in layout if isinstance(e, tuple) and e[0] == _LEAF and e[1] == _EXTRA)
    main = list(leaves[: len(leaves) - n_extra])
    extras = iter(leaves[len(leaves) - n_extra :])
    it = iter(main)
    invals, scalars = [], []
    for e in layout:
        if isinstance(e, Static):
            invals.append(e.value)
            scalars.append(None)
        elif e[0] == SCALED:
            invals.append(_scaled(next(it), next(it)))
            scalars.append(None)
        else:
            invals.append(next(it))
            meta = e[1]
            if isinstance(meta, Static):
                scalars.append(meta.value)
            else:
                scalars.append(next(extras) if meta == _EXTRA else None)
    return invals, scalars


def _expand(layout, per_input: Sequence[Any], n_leaves: int, scale_value, extra_value):
    """Per-leaf values from per-input ones: data and plain leaves take the input's value,
    scales `scale_value`, extra leaves `extra_value`; literal inputs have no leaf."""
    out = []
    for e, v in zip(layout, per_input):
        if isinstance(e, Static):
            continue
        out += [v, scale_value] if e[0] == SCALED else [v]
    return out + [extra_value] * (n_leaves - len(out))


def _flatten_outs(outs):
    """Outputs -> (flat leaves, per-output "is scaled" flags)."""
    flat, scaled = [], []
    for o in outs:
        if isinstance(o, ScaledArray):
            flat += [o.data, o.scale]
        else:
            flat.append(jnp.asarray(o) if _is_literal(o) else o)
        scaled.append(isinstance(o, ScaledArray))
    return flat, tuple(scaled)


def _unflatten_outs(flat, scaled):
    it = iter(flat)
    return [_scaled(next(it), next(it)) if s else next(it) for s in scaled]


def _sub_fun(jaxpr, consts, layout, name=None):
    """A function of flat leaves evaluating `jaxpr` on the unpacked inputs.

    Returns (fun, box): after `fun` is traced, `box[0]` holds the per-output scaled flags.
    """
    box: list = []

    def fun(*leaves):
        invals, scalars = unpack_inputs(layout, leaves)
        outs = interpret_jaxpr(jaxpr, consts, invals, scalars)
        flat, scaled = _flatten_outs(outs)
        box[:] = [scaled]
        return tuple(flat)

    if name is not None:
        fun.__name__ = fun.__qualname__ = name
    return fun, box


# ---------------------------------------------------------------------------------------
# jit / closed_call / remat
# ---------------------------------------------------------------------------------------
# Re-wrapped jits, per sub-jaxpr, layout, avals, params and config (each entry holds a jitted
# function and, through it, its compiled executables).
_JIT_CACHE = LRUCache(64)


def _is_sharding(s) -> bool:
    return isinstance(s, jax.sharding.Sharding)


def _aval_key(x):
    aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)
    return aval


@register_call_rule(jprims.jit_p)
def _jit_rule(
    invals,
    scalars,
    *,
    jaxpr,
    name,
    donated_invars,
    in_shardings,
    out_shardings,
    keep_unused,
    inline,
    compiler_options_kvs=(),
    in_layouts=None,
    out_layouts=None,
    **params,
):
    """jit: the sub-jaxpr is interpreted on the scaled inputs inside a new `jax.jit`.

    Scales: those the sub-jaxpr's rules give. Kept: name, keep_unused, inline, compiler
    options; donation and shardings of each input go to its data (scales are replicated and
    never donated), output shardings to the output data.
    """
    if observe.active():  # scale_health: run inline, so the observer sees concrete values
        return interpret_jaxpr(jaxpr.jaxpr, jaxpr.consts, invals, scalars)
    layout, leaves = pack_inputs(invals, scalars)
    if any(lay is not None for lay in (*(in_layouts or ()), *(out_layouts or ()))):
        warnings.warn(
            f"scalify: the layouts of jit '{name}' are dropped when it is re-traced on scaled "
            "inputs (values are unchanged).",
            stacklevel=2,
        )
    key = (
        jaxpr,
        layout,
        tuple(_aval_key(x) for x in leaves),
        name,
        tuple(donated_invars),
        tuple(in_shardings),
        tuple(out_shardings),
        keep_unused,
        inline,
        tuple(compiler_options_kvs),
        get_config(),
    )
    try:
        entry = _JIT_CACHE.get(key)
    except TypeError:  # an unhashable param: no caching
        key, entry = None, None
    if entry is None:
        entry = _make_jit(jaxpr, layout, leaves, name, donated_invars, in_shardings,
                          out_shardings, keep_unused, inline, compiler_options_kvs)
        if key is not None:
            _JIT_CACHE.put(key, entry)
    jitted, box = entry
    flat = jitted(*leaves)
    return _unflatten_outs(flat, box[0])


def _make_jit(jaxpr, layout, leaves, name, donated_invars, in_shardings, out_shardings,
              keep_unused, inline, compiler_options_kvs):
    fun, box = _sub_fun(jaxpr.jaxpr, jaxpr.consts, layout, name)
    donate = _expand(layout, donated_invars, len(leaves), False, False)
    kwargs: dict[str, Any] = dict(
        donate_argnums=tuple(i for i, d in enumerate(donate) if d),
        keep_unused=keep_unused,
        inline=inline,
    )
    if compiler_options_kvs:
        kwargs["compiler_options"] = dict(compiler_options_kvs)
    if any(_is_sharding(s) for s in in_shardings):
        kwargs["in_shardings"] = tuple(_expand(layout, in_shardings, len(leaves), None, None))
    if any(_is_sharding(s) for s in out_shardings):
        jax.eval_shape(fun, *leaves)  # the output structure, to place the output shardings
        out = []
        for s, scaled in zip(out_shardings, box[0]):
            out += [s, None] if scaled else [s]
        kwargs["out_shardings"] = tuple(out)
    return jax.jit(fun, **kwargs), box


@register_call_rule(jprims.closed_call_p)
def _closed_call_rule(invals, scalars, *, call_jaxpr, **params):
    """closed_call: the sub-jaxpr is interpreted on the scaled inputs, re-traced and bound
    again as a closed_call. Scales: those of the sub-jaxpr's rules."""
    layout, leaves = pack_inputs(invals, scalars)
    fun, box = _sub_fun(call_jaxpr.jaxpr, call_jaxpr.consts, layout)
    closed = jax.make_jaxpr(fun)(*leaves)
    flat = bind_as_is(jprims.closed_call_p, dict(params, call_jaxpr=closed), leaves)
    return _unflatten_outs(flat, box[0])


@register_call_rule(jprims.remat_p)
def _remat_rule(invals, scalars, *, jaxpr, prevent_cse, differentiated, policy, **params):
    """checkpoint/remat: the sub-jaxpr is interpreted on the scaled inputs inside
    `jax.checkpoint` with the same policy and prevent_cse (scales are residuals like data).

    `differentiated=True` (the recomputation in a backward pass, which JAX lowers with an
    optimization barrier) is not reachable through `jax.checkpoint`: the call is traced with
    it, then the flag is set on the traced equation.
    """
    layout, leaves = pack_inputs(invals, scalars)
    fun, box = _sub_fun(jaxpr, (), layout)
    wrapped = jax.checkpoint(fun, prevent_cse=prevent_cse, policy=policy)
    if not differentiated:
        flat = wrapped(*leaves)
    else:
        closed = jax.make_jaxpr(wrapped)(*leaves)
        eqns = [
            e.replace(params=dict(e.params, differentiated=True))
            if e.primitive is jprims.remat_p else e
            for e in closed.jaxpr.eqns
        ]
        closed = jex.ClosedJaxpr(closed.jaxpr.replace(eqns=eqns), closed.consts)
        flat = jex.jaxpr_as_fun(closed)(*leaves)
    return _unflatten_outs(flat, box[0])


# ---------------------------------------------------------------------------------------
# Loops and branches: agreeing on scaledness (a fixed point)
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Spec:
    """What a carried/branch-output scaled value looks like: its scale's shape and dtype."""

    shape: tuple
    dtype: Any


def _spec_of(x) -> _Spec | None:
    if not isinstance(x, ScaledArray):
        return None
    return _Spec(tuple(np.shape(x.scale)), np.dtype(jnp.result_type(x.scale)))


def _unify(a: _Spec | None, b: _Spec | None) -> _Spec | None:
    if a is None or b is None:
        return a if b is None else b
    dtype = np.dtype(jnp.promote_types(a.dtype, b.dtype))
    return _Spec(np.broadcast_shapes(a.shape, b.shape), dtype)


def _conform(x, spec: _Spec | None, scalar=None, ref_scale=lambda: None):
    """`x` in the form `spec` asks for: promoted to ScaledArray if unscaled (exact split of
    a broadcast scalar, placed at `min(its scale, 1)` (scale_flow.conform_constant);
    zeros take ZERO_SCALE (the body may multiply them: `jnp.polyval`'s Horner scan), other
    "any scale" values `ref_scale()`; else scale 1), scale cast and broadcast to the spec."""
    if spec is None:
        return x
    if not isinstance(x, ScaledArray):
        x = conform_constant(promote(x, scalar, ref_scale, zeros_at_bottom=True))
    scale = lax.convert_element_type(jnp.asarray(x.scale), spec.dtype)
    if scale.shape != spec.shape:
        scale = jnp.broadcast_to(scale, spec.shape)
    return _scaled(x.data, scale)


class _Respec(Exception):
    """Raised from inside a traced body when its outputs need other specs (retry)."""

    def __init__(self, specs):
        super().__init__("scalify: carry/branch specs changed; retrying")
        self.specs = specs


_MAX_RESPEC = 8


def _fixed_point(run: Callable, specs: list, what: str):
    """`run(specs)`, re-run with the specs a body asked for until they agree."""
    for _ in range(_MAX_RESPEC):
        try:
            return run(specs)
        except _Respec as e:
            specs = e.specs
    raise ScalifyError(
        f"scalify could not make the scales of a {what} consistent after {_MAX_RESPEC} "
        "re-traces (a scale keeps changing shape or dtype between iterations/branches). "
        "Give the carry a fixed scale with `scalify.set_scaling` before the loop."
    )


def _ref_scale(invals):
    """Scale for "any scale" initial carries (e.g. zeros): the largest scale of the loop's
    scaled inputs (`reference_scale`), as the interpreter does for the inputs of one
    equation."""
    scaled = [x for x in invals if isinstance(x, ScaledArray)]
    return (lambda: reference_scale(scaled)) if scaled else (lambda: None)


def _checked(specs: list, outs: Sequence[Any]) -> list:
    """Body outputs conformed to `specs`; raises `_Respec` if `specs` must widen."""
    new = [_unify(s, _spec_of(o)) for s, o in zip(specs, outs)]
    if new != list(specs):
        raise _Respec(new)
    return [_conform(o, s) for o, s in zip(outs, specs)]


def _scan_counts(n_in: int, params: dict) -> tuple[int, int]:
    """(num_consts, num_carry) of a scan equation: explicit params up to jax 0.10, read from
    the `ft_in` tree (consts, carry, xs) from jax 0.11."""
    if "num_consts" in params:
        return params.pop("num_consts"), params.pop("num_carry")
    consts, carry, _ = params.pop("ft_in").update(list(range(n_in))).unpack()
    params.pop("ft_out", None)
    return len(list(consts)), len(list(carry))


@register_call_rule(lax.scan_p)
def _scan_rule(invals, scalars, *, jaxpr, length, reverse, unroll, **params):
    """scan: the body is interpreted per iteration inside `jax.lax.scan`.

    Scaled xs: data sliced per iteration; a scale that does not vary along the scanned axis
    is a constant of the body, one of shape (length, ...) is sliced too. Carries are
    (data, scale) pairs (see the module docstring). Scaled ys are stacked with their
    per-iteration scales, reshaped to (length, 1, ..., 1, *scale_shape) so that they
    broadcast to the stacked data.
    """
    num_consts, num_carry = _scan_counts(len(invals), params)
    consts = list(invals[:num_consts])
    const_scalars = list(scalars[:num_consts])
    init = list(invals[num_consts : num_consts + num_carry])
    init_scalars = scalars[num_consts : num_consts + num_carry]
    xs = invals[num_consts + num_carry :]
    n_xs = len(xs)
    ref = _ref_scale(invals)

    xs_leaves, x_kinds = [], []  # kinds: ("plain",), ("sliced",), ("const", scale)
    for x in xs:
        if not isinstance(x, ScaledArray):
            xs_leaves.append(x)
            x_kinds.append(("plain",))
            continue
        scale = jnp.asarray(x.scale)
        xs_leaves.append(x.data)
        if scale.ndim == x.ndim and scale.shape[0] != 1:
            xs_leaves.append(scale)
            x_kinds.append(("sliced",))
        else:
            if scale.ndim == x.ndim:  # a leading 1: the same scale for every slice
                scale = scale.reshape(scale.shape[1:])
            x_kinds.append(("const", scale))
    extra = {k: v for k, v in params.items() if k == "_split_transpose" and v}

    def run(specs):
        def body(carry, x_leaves):
            it = iter(x_leaves)
            x_vals = []
            for kind in x_kinds:
                if kind[0] == "plain":
                    x_vals.append(next(it))
                elif kind[0] == "sliced":
                    x_vals.append(_scaled(next(it), next(it)))
                else:
                    x_vals.append(_scaled(next(it), kind[1]))
            outs = interpret_jaxpr(
                jaxpr.jaxpr, jaxpr.consts, [*consts, *carry, *x_vals],
                [*const_scalars, *([None] * (num_carry + n_xs))],
            )
            ys = [_guard_drift(y) for y in outs[num_carry:]]
            return _checked(specs, [_guard_drift(c) for c in outs[:num_carry]]), ys

        carry0 = [_conform(c, s, sc, ref) for c, s, sc in zip(init, specs, init_scalars)]
        carry, ys = lax.scan(body, carry0, xs_leaves, length=length, reverse=reverse,
                             unroll=unroll, **extra)
        return [*carry, *(_stacked(y) for y in ys)]

    return _fixed_point(run, [_spec_of(c) for c in init], "scan carry")


def _guard_drift(x):
    """The loop drift guard (`ScalifyConfig.carry_drift_window`) on scan/while carries and
    on each iteration's scan outputs: `guards.rebalance_drift`."""
    return rebalance_drift(x, get_config().carry_drift_window)


def _stacked(y):
    """A scan output: stacked scales reshaped to broadcast to the stacked data."""
    if not isinstance(y, ScaledArray):
        return y
    scale = jnp.asarray(y.scale)
    length, per_shape = scale.shape[0], scale.shape[1:]
    ones = (1,) * (y.ndim - 1 - len(per_shape))
    return _scaled(y.data, scale.reshape((length, *ones, *per_shape)))


@register_call_rule(lax.while_p)
def _while_rule(invals, scalars, *, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts, **params):
    """while: cond and body are interpreted inside `jax.lax.while_loop`; carries are
    (data, scale) pairs made consistent by a fixed point (see the module docstring)."""
    cconsts = list(invals[:cond_nconsts])
    cscalars = list(scalars[:cond_nconsts])
    bconsts = list(invals[cond_nconsts : cond_nconsts + body_nconsts])
    bscalars = list(scalars[cond_nconsts : cond_nconsts + body_nconsts])
    init = list(invals[cond_nconsts + body_nconsts :])
    init_scalars = scalars[cond_nconsts + body_nconsts :]
    nones = [None] * len(init)
    ref = _ref_scale(invals)

    def run(specs):
        def cond_fun(carry):
            (pred,) = interpret_jaxpr(cond_jaxpr.jaxpr, cond_jaxpr.consts, [*cconsts, *carry],
                                      [*cscalars, *nones])
            return jnp.asarray(pred)

        def body_fun(carry):
            outs = interpret_jaxpr(body_jaxpr.jaxpr, body_jaxpr.consts, [*bconsts, *carry],
                                   [*bscalars, *nones])
            return _checked(specs, [_guard_drift(c) for c in outs])

        carry0 = [_conform(c, s, sc, ref) for c, s, sc in zip(init, specs, init_scalars)]
        return list(lax.while_loop(cond_fun, body_fun, carry0))

    return _fixed_point(run, [_spec_of(c) for c in init], "while_loop carry")


@register_call_rule(lax.cond_p)
def _cond_rule(invals, scalars, *, branches, **params):
    """cond/switch: each branch is interpreted inside `jax.lax.switch`; branches agree on
    which outputs are scaled and on scale shapes (an output scaled in one branch is promoted
    with scale 1 in the others; scale shapes are broadcast to a common one)."""
    index, ops, op_scalars = invals[0], list(invals[1:]), list(scalars[1:])

    def run(specs):
        state = {"specs": specs}

        def make(branch):
            def fn(*operands):
                outs = interpret_jaxpr(branch.jaxpr, branch.consts, list(operands), op_scalars)
                if state["specs"] is None:  # the first branch traced sets the target
                    state["specs"] = [_spec_of(o) for o in outs]
                return _checked(state["specs"], outs)

            return fn

        return list(lax.switch(index, [make(b) for b in branches], *ops))

    return _fixed_point(run, None, "cond's branches")


# ---------------------------------------------------------------------------------------
# Custom derivatives
# ---------------------------------------------------------------------------------------
def _dynamic_inputs(layout, leaves, tangents=None):
    """Materialised inputs (and tangents) of the original call from scaled leaves.

    Returns (xs, dxs): one entry per non-literal input, in data's dtype. The tangent of
    `data * scale` is `ddata * scale + data * dscale`.
    """
    xs, dxs = [], []
    it = iter(leaves)
    tit = iter(tangents) if tangents is not None else None
    for e in layout:
        if isinstance(e, Static):
            continue
        if e[0] == SCALED:
            d, s = next(it), next(it)
            cdt = compute_dtype(d.dtype)
            xs.append((d.astype(cdt) * jnp.asarray(s).astype(cdt)).astype(d.dtype))
            if tit is not None:
                dd, ds = next(tit), next(tit)
                s_, ds_ = jnp.asarray(s).astype(cdt), jnp.asarray(ds).astype(cdt)
                dxs.append((dd.astype(cdt) * s_ + d.astype(cdt) * ds_).astype(d.dtype))
        else:
            xs.append(next(it))
            if tit is not None:
                dxs.append(next(tit))
    return xs, dxs


def _original(primitive, params, layout):
    """The original call as a function of its non-literal inputs (literals closed over)."""

    def fn(*xs):
        it = iter(xs)
        full = [e.value if isinstance(e, Static) else next(it) for e in layout]
        return bind_as_is(primitive, params, full)

    return fn


def _unbroadcast(x, shape):
    """Sum `x` down to `shape` (the inverse of broadcasting `shape` to `x.shape`)."""
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and x.shape[lead + i] != 1
    )
    return jnp.sum(x, axis=axes).reshape(shape) if axes else x.reshape(shape)


@register_call_rule(jprims.custom_jvp_call_p)
def _custom_jvp_call_rule(invals, scalars, *, call_jaxpr, **params):
    """custom_jvp: forward = `call_jaxpr` interpreted on the scaled inputs (its rules give
    the scales); the call is wrapped in `jax.custom_jvp` so that its custom derivative is
    kept under `jax.grad(scalify(f))`.

    The derivative is computed unscaled: the original custom JVP rule is evaluated (with
    `jax.jvp` of the original primitive) on materialised inputs `data * scale` in the data's
    dtype, and the output tangent is expressed in the output's scale (`dy / scale`; scales
    are piecewise constant, their tangent is 0). `scalify(jax.grad(f))` has no such
    limitation: there the derivative is an ordinary part of the jaxpr and is scaled.
    """
    all_params = dict(params, call_jaxpr=call_jaxpr)
    layout, leaves = pack_inputs(invals, scalars)
    fun, box = _sub_fun(call_jaxpr.jaxpr, call_jaxpr.consts, layout)
    original = _original(jprims.custom_jvp_call_p, all_params, layout)

    @jax.custom_jvp
    def scaled_call(*leaves):
        return fun(*leaves)

    @scaled_call.defjvp
    def scaled_call_jvp(primals, tangents):
        outs = fun(*primals)
        xs, dxs = _dynamic_inputs(layout, primals, tangents)
        _, dys = jax.jvp(original, xs, dxs)
        touts, it = [], iter(outs)
        for dy, scaled in zip(dys, box[0]):
            if scaled:
                d, s = next(it), next(it)
                cdt = compute_dtype(d.dtype)
                dd = (dy.astype(cdt) / jnp.asarray(s).astype(cdt)).astype(d.dtype)
                touts += [dd, jnp.zeros_like(s)]
            else:
                next(it)
                touts.append(dy)
        return outs, tuple(touts)

    flat = scaled_call(*leaves)
    return _unflatten_outs(flat, box[0])


@register_call_rule(jprims.custom_vjp_call_p)
def _custom_vjp_call_rule(invals, scalars, *, call_jaxpr, **params):
    """custom_vjp: forward = `call_jaxpr` interpreted on the scaled inputs; the call is
    wrapped in `jax.custom_vjp` so that `jax.grad(scalify(f))` uses the custom fwd/bwd.

    The derivative is computed unscaled: the fwd residuals are those of `jax.vjp` of the
    original primitive (its own fwd) on materialised inputs in the data's dtype (the
    original forward is evaluated once more for them); the bwd maps a cotangent `ct` of an
    output's data to `ct / scale`, runs the original bwd, and returns `ct_x * scale` for the
    data and `sum(ct_x * data)` for the scale of each scaled input.
    """
    all_params = dict(params, call_jaxpr=call_jaxpr)
    layout, leaves = pack_inputs(invals, scalars)
    fun, box = _sub_fun(call_jaxpr.jaxpr, call_jaxpr.consts, layout)
    original = _original(jprims.custom_vjp_call_p, all_params, layout)

    @jax.custom_vjp
    def scaled_call(*leaves):
        return fun(*leaves)

    def scaled_call_fwd(*leaves):
        outs = fun(*leaves)
        xs, _ = _dynamic_inputs(layout, leaves)
        _, vjp_fn = jax.vjp(original, *xs)
        out_scales = [o for o, s in zip(_unflatten_outs(outs, box[0]), box[0]) if s]
        return outs, (vjp_fn, list(leaves), [o.scale for o in out_scales])

    def scaled_call_bwd(res, cts):
        vjp_fn, leaves, out_scales = res
        ct_y, it, sit = [], iter(cts), iter(out_scales)
        for scaled in box[0]:
            ct = next(it)
            if scaled:
                next(it)  # the scale's cotangent: scales are piecewise constant
                s = next(sit)
                cdt = compute_dtype(ct.dtype)
                ct = (ct.astype(cdt) / jnp.asarray(s).astype(cdt)).astype(ct.dtype)
            ct_y.append(ct)
        ct_x = iter(vjp_fn(ct_y))
        out, lit = [], iter(leaves)
        for e in layout:
            if isinstance(e, Static):
                continue
            c = next(ct_x)
            if e[0] == SCALED:
                d, s = next(lit), next(lit)
                cdt = compute_dtype(d.dtype)
                s_arr = jnp.asarray(s)
                out.append((c.astype(cdt) * s_arr.astype(cdt)).astype(d.dtype))
                ct_s = _unbroadcast(c.astype(cdt) * d.astype(cdt), s_arr.shape)
                out.append(ct_s.astype(s_arr.dtype))
            else:
                next(lit)
                out.append(c)
        out += [jnp.zeros_like(x) for x in list(lit)]  # extra leaves: metadata only
        return tuple(out)

    scaled_call.defvjp(scaled_call_fwd, scaled_call_bwd)
    flat = scaled_call(*leaves)
    return _unflatten_outs(flat, box[0])


# ---------------------------------------------------------------------------------------
# Sharding and barriers
# ---------------------------------------------------------------------------------------
@register_scale_rule(jprims.sharding_constraint_p)
def _sharding_constraint_rule(x: ScaledArray, **params):
    """with_sharding_constraint: applied to the data; the scale is unchanged."""
    return _scaled(jprims.sharding_constraint_p.bind(x.data, **params), x.scale)


def _traced_primitive(fn, *args):
    """The primitive of the single equation `fn` traces to (for those not exported)."""
    (eqn,) = jax.make_jaxpr(fn)(*args).eqns
    return eqn.primitive


optimization_barrier_p = _traced_primitive(lax.optimization_barrier, 0.0)


@register_call_rule(optimization_barrier_p)
def _optimization_barrier_rule(invals, scalars, **params):
    """optimization_barrier: one barrier over every data and scale (scales unchanged)."""
    flat, scaled = _flatten_outs(invals)
    return _unflatten_outs(lax.optimization_barrier(flat), scaled)
