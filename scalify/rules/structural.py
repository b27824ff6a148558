"""Scale rules of structural primitives: ops that move, copy or select elements.

A structural op does no arithmetic, so the output scale is the input scale and the op runs
on `data` . Ops that combine several float inputs into one array
(concatenate, pad, dynamic_update_slice, scatter, stack) need a common scale: the largest
input scale, the other inputs rescaled to it (exact for powers of two, barring underflow).

Non-scalar scales (any shape that broadcasts to the data) are always handled correctly:
- where it is cheap and exact, the same op is applied to the scale, seen with the data's
  rank (`scale_at_rank`): its size-1 dimensions stay size 1 (transpose, reshape, broadcast, slice,
  rev, squeeze, tile, split, dynamic_slice, concatenate, pad, ...);
- otherwise the rule falls back to `full_scale(x)` (the scale broadcast to the data's shape)
  moved like the data (gather, dynamic_update_slice, scatter-mul, sort, top_k), or to one
  common scalar scale (the largest) where elements are combined (scatter-add/max/min).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify.core.scale_flow import PromotedConstant, common_scale, note_transpose, pass_max_abs
from scalify.core.scaled_array import ScaledArray, compute_dtype
from scalify.core.registry import register_scale_rule
from scalify.rules.common import (
    align_scale,
    full_scale,
    named_rule,
    materialize,
    rescale,
    scalar_of,
    scalar_scale,
    scale_at_rank,
    with_scale,
)

__all__: list[str] = []


# -- helpers ------------------------------------------------------------------------------
def _collapse(x: ScaledArray):
    """x rescaled to one scalar scale, its largest; returns (data, scale).

    Fallback of rules that combine elements: the largest scale among non-zero elements
    (`align_scale`); exact, unless the scale spread is so wide that small-scale elements
    underflow the data dtype.
    """
    if scalar_scale(x):
        return x.data, scalar_of(x.scale)
    data, s = align_scale(x, range(x.ndim))
    return data, s.reshape(())


def _common(*xs: ScaledArray):
    """The data of `xs` on their common (scalar) scale; returns (list of data, scale).

    The common scale is the largest, a promoted constant counting with its placement scale
    (`scalify.core.scale_flow.common_scale`: a large constant never flushes the others).
    """
    collapsed = [_collapse(x) for x in xs]
    scale = common_scale([
        x if isinstance(x, PromotedConstant) else ScaledArray(d, s) for x, (d, s) in zip(xs, collapsed)
    ])
    datas = [rescale(ScaledArray(d, s), scale) for d, s in collapsed]
    return datas, scale


def _sort_key(x: ScaledArray):
    """Values of x in >= float32, on one scale (its largest): the order of x, ready to sort.

    Used when the scale varies: comparing data alone would be wrong. The scale is the largest
    among non-zero elements (`align_scale`; zeros stay zero), so nothing overflows.
    """
    return align_scale(x, range(x.ndim), compute_dtype(x.dtype))[0]


# Ops whose output holds every element of the input (so the same max |data|).
_KEEPS_EVERY_ELEMENT = (lax.reshape_p, lax.broadcast_in_dim_p, lax.transpose_p, lax.squeeze_p,
                        lax.rev_p, lax.tile_p, lax.copy_p)


def _register_same_scale(prim, scale_fn, *, doc: str):
    """Register a rule for a one-float-input op: data -> prim(data), scale -> scale_fn."""

    def rule(x: ScaledArray, *rest, **params):
        data = prim.bind(x.data, *rest, **params)
        if prim in _KEEPS_EVERY_ELEMENT:
            pass_max_abs(data, x.data)
        if prim is lax.transpose_p:
            note_transpose(data, x.data)
        if scalar_scale(x):
            return ScaledArray(data, scalar_of(x.scale))
        return ScaledArray(data, scale_fn(scale_at_rank(x), x, *rest, **params))

    register_scale_rule(prim)(named_rule(prim, rule, doc))
    return rule


# -- layout ops: the scale follows the data -------------------------------------------------
def _reshape_scale(s, x, *, new_sizes, dimensions=None, **_):
    """Reshape a broadcastable scale, keeping it small where the reshape allows.

    The non-1 dims of input and output are paired into groups of equal size products; a
    group on which the scale varies is broadcast to full size and reshaped like the data, a
    group on which it is constant stays size 1. Row-major order makes this exact.
    """
    in_shape = x.shape
    if dimensions is not None:
        s = lax.transpose(s, dimensions)
        in_shape = tuple(in_shape[d] for d in dimensions)
    out_shape = tuple(new_sizes)
    if 0 in in_shape:
        return jnp.broadcast_to(s, in_shape).reshape(out_shape)
    in_d = [d for d, n in enumerate(in_shape) if n != 1]
    out_d = [d for d, n in enumerate(out_shape) if n != 1]
    full_in, target = list(s.shape), [1] * len(out_shape)
    i = j = 0
    while i < len(in_d):
        gi, gj = [in_d[i]], [out_d[j]]
        pi, pj = in_shape[in_d[i]], out_shape[out_d[j]]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(in_d[i])
                pi, i = pi * in_shape[in_d[i]], i + 1
            else:
                gj.append(out_d[j])
                pj, j = pj * out_shape[out_d[j]], j + 1
        if any(s.shape[d] != 1 for d in gi):
            for d in gi:
                full_in[d] = in_shape[d]
            for d in gj:
                target[d] = out_shape[d]
    return jnp.broadcast_to(s, full_in).reshape(target)


_register_same_scale(
    lax.reshape_p,
    _reshape_scale,
    doc="reshape(x): scale unchanged; data reshaped. A non-scalar scale is reshaped along "
    "the groups of dims on which it varies (see `_reshape_scale`).",
)


def _broadcast_in_dim_scale(s, x, *rest, shape, broadcast_dimensions, **_):
    target = [1] * len(shape)
    for i, d in enumerate(broadcast_dimensions):
        target[d] = s.shape[i]
    return lax.broadcast_in_dim(s, target, broadcast_dimensions)


_register_same_scale(
    lax.broadcast_in_dim_p,
    _broadcast_in_dim_scale,
    doc="broadcast_in_dim(x): scale unchanged (a non-scalar scale gets the new dims with "
    "size 1); data broadcast.",
)

_register_same_scale(
    lax.transpose_p,
    lambda s, x, *, permutation: lax.transpose(s, permutation),
    doc="transpose(x): scale unchanged (a non-scalar scale is transposed); data transposed.",
)

_register_same_scale(
    lax.squeeze_p,
    lambda s, x, *, dimensions: lax.squeeze(s, dimensions),
    doc="squeeze(x): scale unchanged (squeezed alike); data squeezed.",
)

_register_same_scale(
    lax.rev_p,
    lambda s, x, *, dimensions: lax.rev(s, [d for d in dimensions if s.shape[d] != 1]),
    doc="rev(x): scale unchanged (reversed alike where it varies); data reversed.",
)


def _slice_scale(s, x, *, start_indices, limit_indices, strides=None):
    strides = strides or (1,) * s.ndim
    varies = [n != 1 for n in s.shape]
    return lax.slice(
        s,
        [b if v else 0 for b, v in zip(start_indices, varies)],
        [e if v else 1 for e, v in zip(limit_indices, varies)],
        [st if v else 1 for st, v in zip(strides, varies)],
    )


_register_same_scale(
    lax.slice_p,
    _slice_scale,
    doc="slice(x): scale unchanged (sliced alike where it varies); data sliced.",
)


def _dynamic_slice_scale(s, x, *indices, slice_sizes):
    # The primitive, not lax.dynamic_slice: that wrapper would wrap negative indices again.
    varies = [n != 1 for n in s.shape]
    return lax.dynamic_slice_p.bind(
        s,
        *[i if v else jnp.zeros((), jnp.asarray(i).dtype) for i, v in zip(indices, varies)],
        slice_sizes=tuple(n if v else 1 for n, v in zip(slice_sizes, varies)),
    )


_register_same_scale(
    lax.dynamic_slice_p,
    _dynamic_slice_scale,
    doc="dynamic_slice(x, *idx): scale unchanged (sliced alike where it varies; the same "
    "index clamping applies since those dims have the data's size); data sliced.",
)

_register_same_scale(
    lax.tile_p,
    lambda s, x, *, reps: lax.tile_p.bind(s, reps=tuple(r if n != 1 else 1 for r, n in zip(reps, s.shape))),
    doc="tile(x): scale unchanged (tiled alike where it varies); data tiled.",
)

_register_same_scale(
    lax.copy_p,
    lambda s, x: s,
    doc="copy(x): scale unchanged; data copied.",
)


@register_scale_rule(lax.split_p)
def _split_rule(x: ScaledArray, *, sizes, axis):
    """split(x): each piece keeps the scale (split alike where it varies along `axis`)."""
    datas = lax.split_p.bind(x.data, sizes=sizes, axis=axis)
    if scalar_scale(x):
        return [ScaledArray(d, scalar_of(x.scale)) for d in datas]
    s = scale_at_rank(x)
    scales = [s] * len(datas) if s.shape[axis] == 1 else lax.split(s, sizes, axis)
    return [ScaledArray(d, sc) for d, sc in zip(datas, scales)]


@register_scale_rule(lax.unstack_p)
def _unstack_rule(x: ScaledArray, *, axis):
    """unstack(x): each slice keeps the scale (unstacked alike where it varies)."""
    datas = lax.unstack_p.bind(x.data, axis=axis)
    if scalar_scale(x):
        return [ScaledArray(d, scalar_of(x.scale)) for d in datas]
    s = scale_at_rank(x)
    if s.shape[axis] == 1:
        scales = [lax.squeeze(s, (axis,))] * len(datas)
    else:
        scales = lax.unstack_p.bind(s, axis=axis)
    return [ScaledArray(d, sc) for d, sc in zip(datas, scales)]


@register_scale_rule(jax.lax.device_put_p)
def _device_put_rule(*xs, devices, srcs, copy_semantics):
    """device_put(*xs): scales unchanged; data moved (a scale follows to a plain Device;
    under a Sharding it stays as is, replicated scales being the norm)."""
    datas = [x.data if isinstance(x, ScaledArray) else x for x in xs]
    outs = jax.lax.device_put_p.bind(*datas, devices=devices, srcs=srcs, copy_semantics=copy_semantics)
    result = []
    for x, out, dev in zip(xs, outs, devices):
        if isinstance(x, ScaledArray):
            scale = x.scale
            if isinstance(dev, jax.Device):
                scale = jax.device_put(scale, dev)
            out = ScaledArray(out, scale)
        result.append(out)
    return result


# -- ops that combine inputs: largest scale, or the scale moved like the data ----------------
@register_scale_rule(lax.concatenate_p)
def _concatenate_rule(*xs: ScaledArray, dimension):
    """concatenate(*xs): scale = largest input scale, inputs rescaled to it.

    With a non-scalar scale the scales are concatenated instead (each broadcast to its
    input's size along `dimension`): exact, no rescaling.
    """
    if all(scalar_scale(x) for x in xs):
        datas, scale = _common(*xs)
        return with_scale(lax.concatenate_p.bind(*datas, dimension=dimension), scale)
    snds = [scale_at_rank(x) for x in xs]
    ndim = xs[0].ndim
    varies = [any(s.shape[d] != 1 for s in snds) for d in range(ndim)]
    scales = [
        jnp.broadcast_to(s, [x.shape[d] if (d == dimension or varies[d]) else 1 for d in range(ndim)])
        for s, x in zip(snds, xs)
    ]
    data = lax.concatenate_p.bind(*[x.data for x in xs], dimension=dimension)
    return with_scale(data, lax.concatenate(scales, dimension))


@register_scale_rule(lax.stack_p)
def _stack_rule(*xs: ScaledArray, axis):
    """stack(*xs): scale = largest input scale, inputs rescaled to it (non-scalar scales are
    stacked instead: exact)."""
    if all(scalar_scale(x) for x in xs):
        datas, scale = _common(*xs)
        return with_scale(lax.stack_p.bind(*datas, axis=axis), scale)
    snds = [scale_at_rank(x) for x in xs]
    shape = np.broadcast_shapes(*[s.shape for s in snds])
    scales = [jnp.broadcast_to(s, shape) for s in snds]
    data = lax.stack_p.bind(*[x.data for x in xs], axis=axis)
    return with_scale(data, jnp.stack(scales, axis=axis))


@register_scale_rule(lax.pad_p)
def _pad_rule(x: ScaledArray, padding_value: ScaledArray, *, padding_config):
    """pad(x, v): scale = largest of the two scales, both rescaled to it.

    A zero (or inf/nan) padding value is an "any scale" value: the interpreter gives it x's
    scale, so x keeps its scale and its data unchanged. With a non-scalar scale, the scale
    is padded with v's scale instead (exact, no rescaling).
    """
    if scalar_scale(x):
        (data, pad), scale = _common(x, padding_value)
        return with_scale(lax.pad_p.bind(data, pad, padding_config=padding_config), scale)
    s = scale_at_rank(x)
    varies = [n != 1 or cfg != (0, 0, 0) for n, cfg in zip(s.shape, map(tuple, padding_config))]
    s = jnp.broadcast_to(s, [n if v else 1 for n, v in zip(x.shape, varies)])
    cfg = [tuple(c) if v else (0, 0, 0) for c, v in zip(padding_config, varies)]
    scale = lax.pad(s, scalar_of(padding_value.scale).astype(s.dtype), cfg)
    data = lax.pad_p.bind(x.data, padding_value.data, padding_config=padding_config)
    return with_scale(data, scale)


@register_scale_rule(lax.dynamic_update_slice_p)
def _dynamic_update_slice_rule(x: ScaledArray, update: ScaledArray, *indices):
    """dynamic_update_slice(x, u, *idx): scale = largest of the two, both rescaled to it.

    With a non-scalar scale, the full scale of u is written into the full scale of x
    (exact, no rescaling).
    """
    if scalar_scale(x) and scalar_scale(update):
        (xd, ud), scale = _common(x, update)
        return with_scale(lax.dynamic_update_slice_p.bind(xd, ud, *indices), scale)
    data = lax.dynamic_update_slice_p.bind(x.data, update.data, *indices)
    sdt = jnp.asarray(x.scale).dtype
    scale = lax.dynamic_update_slice_p.bind(full_scale(x), full_scale(update).astype(sdt), *indices)
    return with_scale(data, scale)


# -- gather / scatter -------------------------------------------------------------------------
def _needs_fill_scale(mode, fill_value) -> bool:
    """Whether gather's out-of-bounds fill is a finite non-zero value (data * scale would
    change it): 0, inf and nan are the same at any scale."""
    if lax.GatherScatterMode.from_any(mode) != lax.GatherScatterMode.FILL_OR_DROP:
        return False
    if fill_value is None:
        return False  # NaN for floats
    v = float(fill_value)
    return np.isfinite(v) and v != 0


@register_scale_rule(lax.gather_p)
def _gather_rule(x: ScaledArray, indices, **params):
    """gather(x, idx): scale unchanged; data gathered (indices are plain integers).

    A non-scalar scale, or a finite non-zero `fill_value` for out-of-bounds indices, makes
    the scale gathered alike from `full_scale(x)` (with fill 1, so filled elements are
    exactly `fill_value`).
    """
    data = lax.gather_p.bind(x.data, indices, **params)
    if scalar_scale(x) and not _needs_fill_scale(params["mode"], params["fill_value"]):
        return ScaledArray(data, scalar_of(x.scale))
    scale = lax.gather_p.bind(full_scale(x), indices, **{**params, "fill_value": 1.0})
    return with_scale(data, scale)


def _scatter_call(prim, operand, indices, updates, params):
    """Bind `prim` on scales: the update_jaxpr is rebuilt for the scale dtype by lax."""
    fn = {
        lax.scatter_p: lax.scatter,
        lax.scatter_mul_p: lax.scatter_mul,
    }[prim]
    return fn(
        operand,
        indices,
        updates,
        params["dimension_numbers"],
        indices_are_sorted=params["indices_are_sorted"],
        unique_indices=params["unique_indices"],
        mode=params["mode"],
    )


@register_scale_rule(lax.scatter_p)
def _scatter_rule(x: ScaledArray, indices, updates: ScaledArray, **params):
    """scatter(x, idx, u) (`x.at[idx].set(u)`): scale = largest of the two, both rescaled.

    Setting zeros (an "any scale" value) keeps x's scale. Non-scalar scales with
    `unique_indices` are scattered alike from full scales (exact); otherwise both inputs
    go to one common scalar scale (which duplicate index wins is unspecified in XLA, so
    scale and data must not be scattered separately).
    """
    if not (scalar_scale(x) and scalar_scale(updates)) and params["unique_indices"]:
        data = lax.scatter_p.bind(x.data, indices, updates.data, **params)
        sdt = jnp.asarray(x.scale).dtype
        scale = _scatter_call(lax.scatter_p, full_scale(x), indices, full_scale(updates).astype(sdt), params)
        return with_scale(data, scale)
    (xd, ud), scale = _common(x, updates)
    return with_scale(lax.scatter_p.bind(xd, indices, ud, **params), scale)


def _register_common_scatter(prim, doc):
    def rule(x: ScaledArray, indices, updates: ScaledArray, **params):
        (xd, ud), scale = _common(x, updates)
        return with_scale(prim.bind(xd, indices, ud, **params), scale)

    register_scale_rule(prim)(named_rule(prim, rule, doc))


for _p in (lax.scatter_add_p, lax.scatter_sub_p):
    _register_common_scatter(
        _p,
        f"{_p.name}(x, idx, u): scale = largest scale of x and u (scalar), both rescaled to "
        "it; data combined on that common scale.",
    )
for _p in (lax.scatter_max_p, lax.scatter_min_p):
    _register_common_scatter(
        _p,
        f"{_p.name}(x, idx, u): compared on a common scale: the largest of x's and u's "
        "(scalar), both rescaled to it.",
    )


@register_scale_rule(lax.scatter_mul_p)
def _scatter_mul_rule(x: ScaledArray, indices, updates: ScaledArray, **params):
    """scatter-mul(x, idx, u) (`x.at[idx].multiply(u)`): data multiplied on data, scales
    multiplied on full scales: out scale = sx * su where updated, sx elsewhere.

    Exact (products of powers of two commute, so duplicate indices are fine); the output
    scale has the data's shape.
    """
    data = lax.scatter_mul_p.bind(x.data, indices, updates.data, **params)
    sdt = jnp.asarray(x.scale).dtype
    scale = _scatter_call(lax.scatter_mul_p, full_scale(x), indices, full_scale(updates).astype(sdt), params)
    return with_scale(data, scale)


# -- sorting and selection ------------------------------------------------------------------
@register_scale_rule(lax.sort_p)
def _sort_rule(*operands, dimension, is_stable, num_keys):
    """sort(*operands): scales unchanged; data sorted.

    A key with a scalar scale is compared on its data (a positive scale keeps the order).
    A key with a non-scalar scale is compared on its values on one scale (`_sort_key`, in
    float32), its data carried along. Non-key operands with non-scalar scales carry their
    full scale along as an extra operand.
    """
    keys, carried, extras = [], [], []  # extras: (operand index, "data"|"scale", array)
    for i, x in enumerate(operands):
        is_key = i < num_keys
        if not isinstance(x, ScaledArray):
            (keys if is_key else carried).append(x)
        elif scalar_scale(x):
            (keys if is_key else carried).append(x.data)
        else:
            if is_key:
                keys.append(_sort_key(x))
                extras.append((i, "data", x.data))
            else:
                carried.append(x.data)
            extras.append((i, "scale", full_scale(x)))
    outs = lax.sort_p.bind(
        *keys, *carried, *[a for _, _, a in extras],
        dimension=dimension, is_stable=is_stable, num_keys=num_keys,
    )
    main, extra_outs = list(outs[: len(operands)]), outs[len(operands):]
    datas = {i: main[i] for i in range(len(operands))}
    scales = {}
    for (i, what, _), out in zip(extras, extra_outs):
        (datas if what == "data" else scales)[i] = out
    result = []
    for i, x in enumerate(operands):
        if not isinstance(x, ScaledArray):
            result.append(datas[i])
        else:
            result.append(ScaledArray(datas[i], scales.get(i, scalar_of(x.scale) if scalar_scale(x) else None)))
    return result


@register_scale_rule(lax.top_k_p)
def _top_k_rule(x: ScaledArray, *, k, axis, **params):
    """top_k(x): values keep the scale, indices are plain; computed on data.

    A non-scalar scale: indices from the values on one scale (`_sort_key`), data and full
    scale gathered along `axis` with them.
    """
    if scalar_scale(x):
        vals, idx = lax.top_k_p.bind(x.data, k=k, axis=axis, **params)
        return [ScaledArray(vals, scalar_of(x.scale)), idx]
    _, idx = lax.top_k_p.bind(_sort_key(x), k=k, axis=axis, **params)
    ax = axis % x.ndim
    vals = jnp.take_along_axis(x.data, idx, axis=ax)
    scale = jnp.take_along_axis(full_scale(x), idx, axis=ax)
    return [with_scale(vals, scale), idx]


@register_scale_rule(lax.approx_top_k_p)
def _approx_top_k_rule(x: ScaledArray, **params):
    """approx_max_k / approx_min_k(x): values keep the scale, indices plain; computed on
    data (a non-scalar scale is first collapsed to its largest value)."""
    data, scale = _collapse(x)
    vals, idx = lax.approx_top_k_p.bind(data, **params)
    return [with_scale(vals, scale), idx]


@register_scale_rule(lax.select_and_gather_add_p)
def _select_and_gather_add_rule(tangents: ScaledArray, operand: ScaledArray, **params):
    """select_and_gather_add(t, x) (max-pool JVP): picks t where x wins each window; scale of
    t, x compared on its data (non-scalar scales collapsed to their largest value)."""
    td, ts = _collapse(tangents)
    xd, _ = _collapse(operand)
    return with_scale(lax.select_and_gather_add_p.bind(td, xd, **params), ts)


@register_scale_rule(lax.select_and_scatter_add_p)
def _select_and_scatter_add_rule(source: ScaledArray, operand: ScaledArray, **params):
    """select_and_scatter_add(s, x) (max-pool gradient): adds s where x wins each window;
    scale of s, x compared on its data (non-scalar scales collapsed to their largest)."""
    sd, ss = _collapse(source)
    xd, _ = _collapse(operand)
    return with_scale(lax.select_and_scatter_add_p.bind(sd, xd, **params), ss)


# -- bit-level ------------------------------------------------------------------------------
@register_scale_rule(lax.bitcast_convert_type_p)
def _bitcast_convert_type_rule(x: ScaledArray, *, new_dtype):
    """bitcast_convert_type(x): the bits of the *value*: x is materialised in its data dtype
    (`data * scale`, as plain JAX would hold it) and bitcast; the output is unscaled.

    Bitcasting the data alone would silently drop the scale. Materialising keeps model
    invariance for code that reads float bits (`jnp.signbit`, `frexp`, `nextafter`, power-of-two
    rounding); the price is that a value outside the data dtype's range saturates to inf,
    as it would in plain JAX at that precision. To get the bits of the data itself, call
    `scalify.get_data_scale` first.
    """
    return lax.bitcast_convert_type_p.bind(materialize(x, x.dtype), new_dtype=new_dtype)
