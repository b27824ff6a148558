"""Scale rules of `shard_map` and of the collectives of its body.

`shard_map` is a call rule: its body is interpreted on the scaled inputs inside a new
`jax.shard_map` with the same mesh, manual axes and specs. A ScaledArray crosses the
boundary as its data (the input's spec) and its scale: a scalar scale is replicated
(spec `P()`); a per-element scale of the data's rank is sharded like the data on the
dimensions where it has the data's size, replicated where it broadcasts (size 1).

Scales inside the body may differ per device (a dynamic rescale of local data gives each
device its own scale). Every rule below, except the sums of data of float32's exponent
range (which add the values themselves, as plain JAX does), therefore first agrees on a
*common scale* `S = pmax(s)` over the collective's axes (skipped when the scale is a trace-time constant),
the largest scale of all devices: every device's data is then multiplied by `s / S <= 1`,
so agreeing on a scale can underflow the smallest values but never overflows (the min
would overflow the devices with the largest values). This is FP8-LM's "shared minimum
scaling factor" (Peng et al. 2023, section 3.1: their factor multiplies, ours divides).
Per-element scales are first merged to their largest element (exact up to underflow).

| primitive | output scale | data |
|---|---|---|
| psum, psum_invariant, reduce_scatter (N devices), float32 or bfloat16 data | 1 (no common scale) | `op(d * s)`, the values as plain JAX sums them |
| the same, float16 or FP8 data | `S*sqrt(N)` rounded | `op(d * s/S')` |
| pmax, pmin, all_gather, all_to_all | `S` | `op(d * s/S)` |
| ppermute | the sender's (moved with the data) | `op(d)` |
| pvary | unchanged | `pvary(d)` |

`axis_index` has no float input and is never scaled: it runs as is.

The new shard_map is built with `check_vma=False`: the body was type-checked when the user
traced it, and scalify's rules mix device-invariant scales with device-varying data in ways
JAX's varying-axes types would reject (and some scalify ops do not carry those types). An
output whose spec shards a dimension gets its scale made common over the spec's mesh axes
(`pmax`); outputs replicated over an axis were computed from replicated values, so their
scales agree already. Autodiff of the re-built call follows JAX's `check_vma=False` rules:
differentiate inside the scalified function (`scalify(jax.grad(f))`).
"""
from __future__ import annotations

import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from scalify.core.scaled_array import ScaledArray, has_float32_range, is_concrete
from scalify.core.registry import register_call_rule, register_scale_rule
from scalify.core.scale_flow import unchecked_scaled as _scaled
from scalify.interpreter import interpret_jaxpr
from scalify.rules.common import rescale, round_scale, with_scale
from scalify.rules.control_flow import SCALED, Static, pack_inputs, unpack_inputs


# ---------------------------------------------------------------------------------------
# Primitives (found where this JAX version keeps them; missing ones get no rule)
# ---------------------------------------------------------------------------------------
def _find(name: str, *modules: str):
    for mod in ("jax.lax", *modules):
        try:
            prim = getattr(importlib.import_module(mod), name, None)
        except ImportError:  # pragma: no cover - depends on the JAX version
            prim = None
        if prim is not None:
            return prim
    return None


_PAR = ("jax._src.lax.parallel",)
psum_p = _find("psum_p", *_PAR)
psum_invariant_p = _find("psum_invariant_p", *_PAR)
pmax_p = _find("pmax_p", *_PAR)
pmin_p = _find("pmin_p", *_PAR)
all_gather_p = _find("all_gather_p", *_PAR)
all_gather_invariant_p = _find("all_gather_invariant_p", *_PAR)
reduce_scatter_p = _find("reduce_scatter_p", *_PAR)
all_to_all_p = _find("all_to_all_p", *_PAR)
ppermute_p = _find("ppermute_p", *_PAR)
pvary_p = _find("pvary_p", "jax._src.core")
shard_map_p = _find("shard_map_p", "jax._src.shard_map", "jax.experimental.shard_map")


def _present(*prims):
    return [p for p in prims if p is not None]


# ---------------------------------------------------------------------------------------
# Axes and common scales
# ---------------------------------------------------------------------------------------
def _axis_tuple(axes) -> tuple:
    if axes is None:
        return ()
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def axis_size(axes, axis_index_groups=None) -> int:
    """Number of devices a collective over `axes` reduces (a static int)."""
    if axis_index_groups is not None:
        return len(axis_index_groups[0])
    n = 1
    for a in _axis_tuple(axes):
        if hasattr(lax, "axis_size"):
            n *= int(lax.axis_size(a))
        else:  # pragma: no cover - older JAX: psum of a constant is the static size
            n *= int(lax.psum(1, a))
    return n


def varying_axes(x) -> frozenset | None:
    """The mesh axes over which JAX types `x` as device-varying (None: no such types)."""
    try:
        aval = jax.typeof(x)
    except Exception:  # noqa: BLE001 - not a JAX value
        return None
    vma = getattr(aval, "vma", None)
    if vma is None:
        mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
        vma = getattr(mat, "varying", None)
    return None if vma is None else frozenset(vma)


def _pmax(x, axes, groups=None):
    if groups is None:
        return lax.pmax(x, axes)
    return pmax_p.bind(x, axes=axes, axis_index_groups=groups)


def common_scale(x: ScaledArray, axes, groups=None):
    """The largest scale of `x` over the devices of `axes` (a scalar): `pmax(max(s))`.

    A trace-time constant scale is the same everywhere and is returned as is.
    """
    s = jnp.asarray(x.scale)
    if s.size != 1:
        s = jnp.max(s)
    s = s.reshape(())
    if is_concrete(s) or not _axis_tuple(axes):
        return s
    return _pmax(s, _axis_tuple(axes), groups)


# ---------------------------------------------------------------------------------------
# Collective rules
# ---------------------------------------------------------------------------------------
def _multi(prim, outs):
    return list(outs) if prim.multiple_results else outs[0]


def _bind_sum(prim, datas, params):
    """Bind a sum; psum_invariant (JAX's typed psum) on untyped data (a check_vma=False
    body, as scalify re-builds shard_maps) becomes the untyped psum."""
    if prim is psum_invariant_p and psum_p is not None:
        axes = set(_axis_tuple(params["axes"]))
        if any(not axes <= (varying_axes(d) or frozenset()) for d in datas):
            return psum_p.bind(*datas, axes=params["axes"], axis_index_groups=None)
    return prim.bind(*datas, **params)


def _sum_rule(prim, axes_key):
    def rule(*xs, **params):
        axes = params[axes_key]
        groups = params.get("axis_index_groups")
        n = axis_size(axes, groups)
        datas, scales = [], []
        for x in xs:
            if not isinstance(x, ScaledArray):
                datas.append(x)
                scales.append(None)
                continue
            if has_float32_range(x.dtype):  # the values hold in the data: no scale to agree on
                out_s = np.ones((), np.float32)
            else:
                out_s = round_scale(common_scale(x, axes, groups) * math.sqrt(n))
            datas.append(rescale(x, out_s))
            scales.append(out_s)
        outs = _bind_sum(prim, datas, params)
        outs = list(outs) if prim.multiple_results else [outs]
        res = [o if s is None else with_scale(o, s) for o, s in zip(outs, scales)]
        return _multi(prim, res)

    rule.__doc__ = (
        f"{prim.name} over N devices. Data of float32's exponent range (float32, bfloat16): "
        "the values d*s are summed in the data's dtype, as plain JAX sums them, output scale "
        "1; no collective agrees on a scale first, so each sum is one collective, as in the "
        "plain program (values beyond the dtype's range overflow as they do there). "
        "Narrower data (float16, FP8): scale S*sqrt(N) rounded to a power of two, S = pmax "
        "of the devices' scales (unit scaling: a sum of N independent unit-variance terms; "
        "as reduce_sum); data op(d * s/S'), the power-of-two ratio applied before the "
        "reduction, in the data's dtype.\n\nThe sum runs in the data's dtype (that is what "
        "crosses the wire); use `scalify.distributed.scaled_psum` to choose the wire format "
        "and the pre/post/auto scaling."
    )
    return rule


for _p, _key in ((psum_p, "axes"), (psum_invariant_p, "axes"), (reduce_scatter_p, "axis_name")):
    if _p is not None:
        register_scale_rule(_p)(_sum_rule(_p, _key))


def _common_rule(prim, axes_key, what):
    def rule(x, **params):
        if not isinstance(x, ScaledArray):  # pragma: no cover - float inputs are promoted
            return prim.bind(x, **params)
        axes = params[axes_key]
        s = common_scale(x, axes, params.get("axis_index_groups"))
        return with_scale(prim.bind(rescale(x, s), **params), s)

    rule.__doc__ = (
        f"{prim.name}: scale S = pmax of the devices' scales (the largest: the others' data "
        f"shrink by s/S <= 1, never overflow); data {prim.name}(d * s/S) ({what}; exact "
        "unless the smaller devices' data underflow)."
    )
    return rule


for _p, _key, _what in (
    (pmax_p, "axes", "max and scale commute for a positive common scale"),
    (pmin_p, "axes", "min and scale commute for a positive common scale"),
    (all_gather_p, "axis_name", "the gathered pieces share one scale"),
    (all_gather_invariant_p, "axis_name", "the gathered pieces share one scale"),
    (all_to_all_p, "axis_name", "the exchanged pieces share one scale"),
):
    if _p is not None:
        register_scale_rule(_p)(_common_rule(_p, _key, _what))


def _move_rule(prim):
    def rule(x: ScaledArray, **params):
        data = prim.bind(jnp.asarray(x.data), **params)
        s = jnp.asarray(x.scale)
        if is_concrete(s):
            return with_scale(data, s)
        moved = prim.bind(s, **params)
        # A device nobody sends to receives zeros: give its zero data scale 1.
        return with_scale(data, jnp.where(moved == 0, jnp.ones_like(moved), moved))

    rule.__doc__ = (
        f"{prim.name}: data and scale move together (exact): output scale is the sender's, "
        "data op(d). A device that receives nothing gets zero data with scale 1; a "
        "trace-time constant scale is not sent."
    )
    return rule


for _p in _present(ppermute_p):
    register_scale_rule(_p)(_move_rule(_p))


if pvary_p is not None:

    @register_scale_rule(pvary_p)
    def _pvary_rule(x: ScaledArray, *, axes, **params):
        """pvary (a type cast: invariant -> varying over axes): scale unchanged; data
        pvary(d) over the axes it does not already vary over (none: returned as is)."""
        data = jnp.asarray(x.data)
        have = varying_axes(data) or frozenset()
        todo = tuple(a for a in _axis_tuple(axes) if a not in have)
        if todo:
            data = pvary_p.bind(data, axes=todo, **params)
        return _scaled(data, x.scale)


# ---------------------------------------------------------------------------------------
# shard_map
# ---------------------------------------------------------------------------------------
def _spec_axes(entry) -> tuple:
    """Mesh axes named by one entry of a PartitionSpec (None, a name, or a tuple)."""
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _spec_entries(spec, ndim) -> list:
    entries = list(spec) if spec is not None else []
    return (entries + [None] * ndim)[:ndim]


def _scale_nd(data, scale):
    """The scale with the data's rank (leading ones), or () for a scalar scale."""
    s = jnp.asarray(scale)
    if s.size == 1:
        return s.reshape(())
    nd = np.ndim(data)
    return s.reshape((1,) * (nd - s.ndim) + tuple(s.shape))


def _scale_spec(spec, data, scale):
    """Spec of a scale next to data of `spec`: P() for a scalar scale; else the data's entry
    on dimensions where the scale has the data's size, None where it broadcasts."""
    s_shape = np.shape(scale)
    if len(s_shape) == 0:
        return P()
    d_shape = np.shape(data)
    entries = _spec_entries(spec, len(d_shape))
    return P(*[e if s_shape[i] == d_shape[i] and s_shape[i] != 1 else None
               for i, e in enumerate(entries)])


def _manual_axes(mesh, params) -> frozenset:
    if "newly_manual_axes" in params:
        return frozenset(params["newly_manual_axes"])
    if "manual_axes" in params:  # pragma: no cover - other JAX versions
        return frozenset(params["manual_axes"])
    if "auto" in params:  # pragma: no cover - other JAX versions
        return frozenset(mesh.axis_names) - frozenset(params["auto"])
    return frozenset(mesh.axis_names)  # pragma: no cover


def _agree_output(o: ScaledArray, spec, manual):
    """Make a body output's scale the same on every device that holds a piece of it: pmax
    over the mesh axes its spec shards on dimensions where the scale broadcasts."""
    s = _scale_nd(o.data, o.scale)
    entries = _spec_entries(spec, o.ndim)
    axes = []
    for i, e in enumerate(entries):
        if s.ndim == 0 or s.shape[i] == 1:
            axes += [a for a in _spec_axes(e) if a in manual and a not in axes]
    if not axes or is_concrete(s):
        return o.data, s
    common = lax.pmax(s, tuple(axes))
    return rescale(_scaled(o.data, s), common), common


def _bind_body(jaxpr):
    if hasattr(jaxpr, "jaxpr"):  # a ClosedJaxpr
        return jaxpr.jaxpr, list(jaxpr.consts)
    return jaxpr, []


@register_call_rule(*_present(shard_map_p))
def _shard_map_rule(invals, scalars, *, mesh, in_specs, out_specs, jaxpr, check_vma=True, **params):
    """shard_map: the body is interpreted on the scaled inputs inside a new `jax.shard_map`
    with the same mesh, manual axes, in/out specs (check_vma=False); scales are replicated
    (spec P()), or sharded like the data for per-element scales.

    Scales: those of the body's rules; a sharded output's scale is made common over the
    mesh axes of its spec (pmax; data rescaled by s/S <= 1).
    """
    manual = _manual_axes(mesh, params)
    layout, leaves = pack_inputs(invals, scalars)
    body_jaxpr, consts = _bind_body(jaxpr)

    # Data keep the input's spec; scales get P() (or data-like, with the data's rank, when
    # per-element); extra leaves (broadcast-scalar metadata) are 0-d and replicated.
    leaf_specs, local_leaves, it = [], [], iter(leaves)
    for e, x, spec in zip(layout, invals, in_specs):
        if isinstance(e, Static):
            continue
        if e[0] == SCALED:
            d, s = next(it), next(it)
            s = _scale_nd(d, s)
            local_leaves += [d, s]
            leaf_specs += [spec, _scale_spec(spec, d, s)]
        else:
            local_leaves.append(next(it))
            leaf_specs.append(spec)
    extras = list(it)
    local_leaves += extras
    leaf_specs += [P()] * len(extras)

    box: list = []

    def body(*local):
        vals, scs = unpack_inputs(layout, local)
        outs = interpret_jaxpr(body_jaxpr, consts, vals, scs)
        res, meta = [], []
        for o, spec in zip(outs, out_specs):
            if isinstance(o, ScaledArray):
                data, s = _agree_output(o, spec, manual)
                meta.append(np.shape(s))
                res.append((data, s if s.ndim else jnp.reshape(s, (1,) * np.ndim(data))))
            else:
                meta.append(None)
                res.append(o)
        box[:] = [meta]
        return tuple(res)

    sm = jax.shard_map(body, mesh=mesh, in_specs=tuple(leaf_specs), out_specs=tuple(out_specs),
                       axis_names=set(manual), check_vma=False)
    flat = sm(*local_leaves)
    outs = []
    for o, local_shape, spec in zip(flat, box[0], out_specs):
        if local_shape is None:
            outs.append(o)
            continue
        data, s = o
        if len(local_shape) == 0:  # scalar: every device holds the same value
            s = s.reshape(-1)[0] if s.size > 1 else s.reshape(())
        else:  # keep one copy along the sharded dimensions where the scale broadcasts
            idx = tuple(slice(0, 1) if local_shape[i] == 1 else slice(None) for i in range(s.ndim))
            s = s[idx]
        outs.append(_scaled(data, s))
    return outs
