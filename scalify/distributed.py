"""Scalify across devices: scaled collectives, communication accounting, meshes and shardings.

Scaled collectives (call them inside `jax.shard_map` bodies, with or without `scalify`):

    grads = scalify.distributed.scaled_pmean(grads, "data", wire_dtype=jnp.float8_e5m2)

Every device holds `x_i = d_i * s_i`. The devices first agree on one scale per tensor, then
send their data in `wire_dtype` (8 or 16 bits) and sum it there (the FP8-LM recipe, Peng et
al. 2023, "FP8-LM: Training FP8 Large Language Models", section 3.1):

- the common scale is `S = max_i s_i` (FP8-LM's *minimum* scaling factor: their factor
  multiplies the value, our scale divides it). Every device's data is multiplied by
  `s_i / S <= 1`, so agreeing on a scale never overflows; the minimum would multiply the
  largest device's data by up to `max/min` and overflow it;
- `scaling` chooses the scale W of the data on the wire (`w_i = x_i / W`, output
  `ScaledArray(sum_i w_i, W)`, N devices, N2 the power of two >= N):
    * "pre":  W = S * N2. The sum of N terms each within the data's range stays within it:
      never overflows if the data fit the wire format; costs log2(N2) bits at the bottom
      (values below the wire's smallest subnormal times N2 underflow);
    * "post": W = S. Full precision of each term, but the sum can reach N times the
      largest data: terms above wire_max / N saturate (FP8-LM's post-scaling divides by N
      after the sum, and overflows there);
    * "auto" (default): W = the smallest power of two with `max_i |x_i| / W <= T`,
      `T = min(wire_max, out_max, 2^16 * 2N) / (2N)` (the global amax, one more `pmax`;
      out_max: the largest value of the output dtype): the sum cannot overflow (<= wire_max
      / 2, one binade of margin for rounding) and the data use the top of the wire's
      range, so the fewest small values underflow. Just-in-time scaling: it
      does not trust the incoming scales, so it also holds for data that exceed their
      unit-scaling estimate. FP8-LM's "auto-scaling" adapts a factor over steps; this one
      needs no state.
  On a wire with float32's exponent range (bfloat16, float32) "auto" needs no common
  scale: each device sends its values `x_i` rounded to the wire, as plain JAX's psum
  would, with no `pmax` first, so each leaf's all-reduce can start as soon as that leaf
  is computed (and overlap the rest of the backward pass); a float16 output gets the
  smallest power-of-two scale that puts `max |sum|` within half its range, fitted after
  the sum on each device (the sum is the same on every device).
  On a narrower wire each device's finite terms are saturated to `wire_max / N`, so no
  partial sum overflows in any mode ("auto" never reaches the bound; "pre" and "post" do
  when the data exceed what their scales promise: those values are clipped, as the
  library's FP8 casts saturate); inf and nan propagate (E4M3 has no infinity: inf
  saturates to its max).
- `scaled_pmean` divides the output scale by N2 (and the data by N/N2 when N is not a power
  of two, in float32 or wider).

Method "psum": the scalars of all leaves are stacked, so one call costs one small `pmax`
(scales, amaxes) plus one all-reduce (or reduce-scatter) per leaf in `wire_dtype`, which XLA
may combine. Method "all_to_all": all leaves are packed into one buffer of raw bytes (each
leaf cut into N equal chunks, chunk n of every leaf for device n) and the scales travel in
the same buffer: one all-to-all (each device sums its chunks in float32, every sender's
piece decoded with that sender's scale) and, for a sum, one all-gather of the shard sums
re-cast to the wire format with each device's own scales. With "auto" each device fits its
own scale to its data (no `pmax`): 2 collectives per call whatever the number of leaves.

`gather_as` casts an FSDP-sharded parameter to a narrow format before XLA all-gathers it
(the FP8 weight gather: 1 byte per weight, the scale replicated).

Inputs may be ScaledArray (outside `scalify`), or plain arrays: inside `scalify` their data
and scale are read with `scalify.get_data_scale` and the result is a ScaledArray with the
chosen scale; outside `scalify` a plain array has scale 1 (use "auto" for plain arrays:
"pre"/"post" would cast the raw values). Per-element scales are merged to their largest
element first (exact up to underflow). Not differentiable (a gradient all-reduce is applied
to gradients, not differentiated through).

`scalify.inspect.collective_bytes(compiled)` counts the bytes the collectives of a compiled
XLA program move (per operation, from the HLO text). `make_mesh` builds a mesh over the available devices,
and `fsdp_shardings` / `replicated_shardings` / `scaled_specs` give shardings and specs for
pytrees with ScaledArray leaves (data sharded, scales replicated). See docs/distributed.md.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from scalify.core.pow2 import pow2_fit
from scalify.core.scaled_array import (ScaledArray, compute_dtype, has_float32_range, is_concrete,
                                        is_scaled_leaf)
from scalify.ops.casts import cast
from scalify.ops.scaling import get_data_scale, merge_scale, set_scaling
from scalify.quant.formats import saturating_cast
from scalify.rules.collectives import axis_size as _axis_size

__all__ = [
    "SCALINGS",
    "METHODS",
    "scaled_psum",
    "scaled_pmean",
    "scaled_psum_scatter",
    "gather_as",
    "DATA_AXIS",
    "make_mesh",
    "fsdp_specs",
    "fsdp_shardings",
    "replicated_shardings",
    "batch_sharding",
    "place",
    "scaled_specs",
    "axis_size",
]

SCALINGS = ("pre", "post", "auto")
METHODS = ("psum", "all_to_all")
DATA_AXIS = "data"


# ---------------------------------------------------------------------------------------
# Scaled collectives
# ---------------------------------------------------------------------------------------
def _axes(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def axis_size(axis_name) -> int:
    """Number of devices along `axis_name` (a name or a tuple of names), inside shard_map."""
    return _axis_size(_axes(axis_name))


def _wire_max(wire) -> float:
    return float(jnp.finfo(wire).max)


def _narrow(wire) -> bool:
    return jnp.dtype(wire).itemsize < 4


def _check_options(wire_dtype, scaling):
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}.")
    if wire_dtype is not None and not jnp.issubdtype(jnp.dtype(wire_dtype), jnp.floating):
        raise ValueError(
            f"wire_dtype must be a floating-point dtype (e.g. jnp.float8_e5m2, jnp.float16) or "
            f"None for the data's dtype, got {wire_dtype!r}."
        )


@dataclasses.dataclass
class _Leaf:
    """One float leaf on its way: data, scalar scale, and where its result goes."""

    data: Any
    scale: Any
    scaled: bool  # a ScaledArray input (else a plain array, read with get_data_scale)
    dtype: Any  # dtype of the output data


def _split(x) -> _Leaf:
    """x's data and scalar scale: a finer scale (per element, per layer of an nn.scan
    stack) is merged to its largest first (exact up to underflow)."""
    if isinstance(x, ScaledArray):
        x = merge_scale(x)
        data, s = jnp.asarray(x.data), jnp.asarray(x.scale)
        scaled, dtype = True, data.dtype
    else:
        x = jnp.asarray(x)
        data, s = get_data_scale(x, merge=True)
        scaled, dtype = False, x.dtype
    return _Leaf(data, s.astype(jnp.float32).reshape(()), scaled, dtype)


def _join(leaf: _Leaf, data, scale):
    """The output leaf: a ScaledArray for ScaledArray inputs, else (inside scalify) a value
    whose data is `data` and whose scale is `scale`, i.e. `data * scale` outside."""
    if leaf.scaled:
        return ScaledArray.tree_unflatten(None, (data.astype(leaf.dtype), scale))
    # Inside scalify: set_scaling gives (data, 1) and the product with the 0-d `scale` is
    # the exact split of a broadcast scalar, so the data are unchanged and the scale is
    # `scale`. Outside: the product, in float32 or wider.
    cdt = compute_dtype(data.dtype, leaf.dtype)
    y = set_scaling(data.astype(cdt), jnp.ones((), cdt)) * scale.astype(cdt)
    return y.astype(leaf.dtype)


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _to_wire(v, wire, bound):
    """`v` (float32 or wider) cast to `wire`: finite values saturated to +-bound first on a
    narrow wire (inf and nan kept; E4M3 saturates inf)."""
    if not _narrow(wire):
        return v.astype(wire)
    v = jnp.where(jnp.isfinite(v), jnp.clip(v, -bound, bound), v)
    return saturating_cast(v, wire)


def _bits(x):
    return lax.bitcast_convert_type(x, _UINT[jnp.dtype(x.dtype).itemsize])


def _unbits(x, wire):
    return lax.bitcast_convert_type(x, wire)


def _to_u8(q):
    """(N, c) array -> (N, c * itemsize) uint8, its raw bytes."""
    b = _bits(q)
    if b.dtype != jnp.uint8:
        b = lax.bitcast_convert_type(b, jnp.uint8)  # (N, c, itemsize)
    return b.reshape(q.shape[0], -1)


def _from_u8(b, dtype):
    """Inverse of `_to_u8`: (N, c * itemsize) uint8 -> (N, c) of `dtype`."""
    k = jnp.dtype(dtype).itemsize
    if k == 1:
        return _unbits(b, dtype)
    words = lax.bitcast_convert_type(b.reshape(b.shape[0], -1, k), _UINT[k])
    return _unbits(words, dtype)


class _Packer:
    """The layout of one bucket: every leaf padded to a multiple of N and cut into N equal
    chunks; chunk n of every leaf, then a float32 scale per leaf, form row n of an (N, B)
    uint8 array. Row n is what device n receives (all-to-all) or sends (all-gather), and
    within a row each leaf sits at the same static offset."""

    def __init__(self, widths, n):
        self.widths = list(widths)  # bytes per row of each leaf's chunk
        self.offsets = list(np.cumsum([0] + self.widths))
        self.n = n

    def pack(self, chunks, scales):
        """chunks: [(N, c_l) wire arrays], scales: (N, L) float32 -> (N, B) uint8."""
        sbytes = lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.uint8)
        return jnp.concatenate([_to_u8(c) for c in chunks] + [sbytes.reshape(scales.shape[0], -1)], axis=1)

    def unpack(self, rows, wires):
        """(N, B) uint8 -> ([(N, c_l) wire arrays], (N, L) float32 scales)."""
        chunks = [_from_u8(rows[:, a:b], w) for a, b, w in zip(self.offsets, self.offsets[1:], wires)]
        tail = rows[:, self.offsets[-1]:].reshape(self.n, len(wires), 4)
        return chunks, lax.bitcast_convert_type(tail, jnp.float32)


def _fit_scale(amax, target, fallback):
    """The smallest power of two W with amax / W <= target (`pow2_fit`; fallback where
    amax is 0 or not finite)."""
    return jnp.where(jnp.isfinite(amax) & (amax > 0), pow2_fit(amax, target), fallback)


def _finite_amax(v):
    mag = jnp.abs(v)
    return jnp.max(jnp.where(jnp.isfinite(mag), mag, 0), axis=-1, initial=0).astype(jnp.float32)


def _packed_a2a(live, wires, dtypes, send_scales, axes, n, n2, kind, scatter_dimension, mean):
    """Sum (kind "sum") or reduce-scatter (kind "scatter") of the leaves `live` over `axes`
    as ONE all-to-all (and, for "sum", ONE all-gather) of raw bytes, each device's float32
    scales inside the same buffers as its data.

    Phase 1: device j sends chunk n of every leaf l, as `x_jl / W_jl` in the wire format,
    with its scales `W_j` (L float32) appended, to device n; device n sums the N chunks of
    each leaf in float32, in units of `R_l = max_j W_jl` (the same on every device: every
    device receives every W_j). "scatter" ends here: data `sum / N2`, scale `R_l * N2`.
    Phase 2 ("sum"): device n casts its shard sums to the wire format with its own scale
    `V_nl` (amax within the target) and all-gathers them with `V_n`; every device decodes
    the same bytes: data `q_nl * V_nl / max_n V_nl`, scale `R_l * max_n V_nl`.
    """
    f32 = jnp.float32
    chunks, widths, shapes = [], [], []
    for p, w, s_send in zip(live, wires, send_scales):
        d = p.data
        if kind == "scatter":
            d = jnp.moveaxis(d, scatter_dimension, 0)
        shapes.append(d.shape)
        flat = d.reshape(-1)
        flat = jnp.pad(flat, (0, (-flat.shape[0]) % n))
        cdt = compute_dtype(flat.dtype)
        q = _to_wire(flat.astype(cdt) * (p.scale / s_send).astype(cdt), w, _wire_max(w))
        q = q.reshape(n, -1)
        chunks.append(q)
        widths.append(q.shape[1] * jnp.dtype(w).itemsize)
    packer = _Packer(widths, n)
    sent = jnp.broadcast_to(jnp.stack(send_scales)[None, :], (n, len(live)))
    recv = lax.all_to_all(packer.pack(chunks, sent), axes, 0, 0, tiled=True)
    got, w_all = packer.unpack(recv, wires)  # w_all[j, l]: sender j's scale of leaf l
    r = jnp.max(w_all, axis=0)  # R_l, common to all devices
    sums = [jnp.sum(g.astype(f32) * (w_all[:, l] / r[l])[:, None], axis=0) for l, g in enumerate(got)]

    outs = []
    if kind == "scatter":
        for l, (p, total, shape) in enumerate(zip(live, sums, shapes)):
            rows = shape[0] // n
            piece = total.reshape((rows,) + shape[1:])
            data = piece / n2 * (n2 / n if mean else 1.0)
            scale = r[l] * n2 / (n2 if mean else 1.0)
            outs.append((jnp.moveaxis(data, 0, scatter_dimension).astype(dtypes[l]), scale))
        return outs
    # Phase 2: the shard sums, each device with its own scales, gathered as bytes.
    factor = n2 / n if mean else 1.0
    backs, v = [], []
    for w, dt, total in zip(wires, dtypes, sums):
        target = min(_wire_max(w), _wire_max(dt) / factor)
        v_l = _fit_scale(_finite_amax(total), target, jnp.ones((), f32))
        if not _narrow(w):  # a wide wire needs no fitting: only shrink to fit the output
            v_l = jnp.maximum(v_l, 1.0)
        v.append(v_l)
        backs.append(_to_wire(total / v_l, w, _wire_max(w))[None])
    mine = jnp.stack(v)[None]
    rows = lax.all_gather(packer.pack(backs, mine), axes, axis=0, tiled=True)
    parts, v_all = packer.unpack(rows, wires)  # v_all[i, l]: device i's scale of leaf l
    for l, (p, q, shape) in enumerate(zip(live, parts, shapes)):
        vmax = jnp.max(v_all[:, l])
        data = (q.astype(f32) * (v_all[:, l] / vmax)[:, None]).reshape(-1)
        size = int(np.prod(shape, dtype=np.int64))
        data = data[:size].reshape(shape) * factor
        scale = r[l] * vmax / (n2 if mean else 1.0)
        outs.append((data.astype(dtypes[l]), scale))
    return outs


def _scaled_reduce(x, axis_name, kind, *, wire_dtype, scaling, mean, out_dtype, method,
                   scatter_dimension=0, own_dtype_below=0):
    _check_options(wire_dtype, scaling)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    axes = _axes(axis_name)
    n = axis_size(axes)
    n2 = float(2 ** math.ceil(math.log2(n))) if n > 1 else 1.0
    leaves, tree = jax.tree_util.tree_flatten(x, is_leaf=is_scaled_leaf)
    floats = [isinstance(v, ScaledArray) or jnp.issubdtype(jnp.result_type(v), jnp.floating)
              for v in leaves]
    parts = [_split(v) if f else None for v, f in zip(leaves, floats)]
    live = [p for p in parts if p is not None]

    def plain(v):  # a non-float leaf: the collective as is
        if kind == "sum":
            out = lax.psum(v, axes)
        else:
            out = lax.psum_scatter(v, axes, scatter_dimension=scatter_dimension, tiled=True)
        return out // n if mean else out

    def wire_of(p):
        if wire_dtype is None or int(np.prod(np.shape(p.data), dtype=np.int64)) < own_dtype_below:
            return jnp.dtype(p.data.dtype)
        return jnp.dtype(wire_dtype)

    if method == "all_to_all" and live:
        return _reduce_packed(x, leaves, tree, parts, live, plain, wire_of, axes, n, n2, kind,
                              scaling, mean, out_dtype, scatter_dimension)

    def values_on_wire(p):
        """With "auto" on a wire of float32's exponent range every device sends its values
        `x_i = d_i * s_i` rounded to the wire, as plain JAX would, so the devices need not
        agree on a scale first (no `pmax`: each leaf's collective depends on that leaf
        alone and can start as soon as it is computed). The output keeps scale 1 (1/N2 for
        a mean), placed by `_fit_output` if its dtype is narrower than float32's range."""
        return scaling == "auto" and has_float32_range(wire_of(p))

    # One pmax for every leaf's scale (and, for "auto" on a narrow wire, the amax of the
    # value x_i = d_i * s_i); none for the leaves whose values travel as they are.
    stats, where = [], []
    for p in live:
        where.append(len(stats))
        if values_on_wire(p):
            continue
        stats.append(p.scale)
        if scaling == "auto" and _narrow(wire_of(p)):
            cdt = compute_dtype(p.data.dtype)
            mag = jnp.abs(p.data.astype(cdt))
            finite = jnp.max(jnp.where(jnp.isfinite(mag), mag, 0), initial=0)
            stats.append(finite.astype(jnp.float32) * p.scale)
    if stats:
        vec = jnp.stack([jnp.asarray(s, jnp.float32).reshape(()) for s in stats])
        if not all(is_concrete(s) for s in stats):
            vec = lax.pmax(vec, axes)

    out, i = [], 0
    for v, p in zip(leaves, parts):
        if p is None:
            out.append(plain(v))
            continue
        wire = wire_of(p)
        dtype = p.dtype if out_dtype is None else jnp.dtype(out_dtype)
        values = values_on_wire(p)
        if values:  # the values themselves: W = 1, nothing to agree on
            w_scale = jnp.ones((), jnp.float32)
        elif scaling == "pre":
            w_scale = vec[where[i]] * n2
        elif scaling == "post" or not _narrow(wire):  # a wide wire has nothing to fit
            w_scale = vec[where[i]]
        else:
            common, amax = vec[where[i]], vec[where[i] + 1]
            # The sum must also fit the output's dtype (e.g. float16 data over a bf16 wire).
            target = min(_wire_max(wire), _wire_max(dtype)) / (2 * n)
            target = min(target, 2.0**16)
            w_scale = _fit_scale(amax, target, common)
        w_scale = lax.stop_gradient(w_scale)
        cdt = compute_dtype(p.data.dtype)
        w = p.data.astype(cdt) * (p.scale / w_scale).astype(cdt)
        # Each of the N terms within wire_max / N: no partial sum can overflow. Values on a
        # wire of float32's range are cast as plain JAX casts them (inf beyond its range).
        q = w.astype(wire) if values else _to_wire(w, wire, _wire_max(wire) / n)
        if kind == "sum":
            total = lax.psum(q, axes)
        else:
            total = lax.psum_scatter(q, axes, scatter_dimension=scatter_dimension, tiled=True)
        out_scale = w_scale
        p = dataclasses.replace(p, dtype=dtype)
        if mean:
            out_scale = w_scale / n2
            if n2 != n:  # the non-power-of-two part of 1/N, in the data
                tcdt = compute_dtype(total.dtype, dtype)
                total = total.astype(tcdt) * jnp.asarray(n2 / n, tcdt)
        if values and not has_float32_range(dtype):
            total, out_scale = _fit_output(total, out_scale, dtype)
        out.append(_join(p, total, out_scale))
        i += 1
    return jax.tree_util.tree_unflatten(tree, out)


def _fit_output(total, scale, dtype):
    """A sum of values (scale `scale`, float32's range) placed for a narrower output `dtype`
    (e.g. float16): the smallest power of two W with `max |total| / W <= out_max / 2` moves
    from the data into the scale. The total of an all-reduce is the same on every device,
    so is W; a reduce-scatter's shards may get different scales (a scale may differ per
    device inside shard_map)."""
    tcdt = compute_dtype(total.dtype, dtype)
    total = total.astype(tcdt)
    fit = lax.stop_gradient(_fit_scale(_finite_amax(total.reshape(-1)), _wire_max(dtype) / 2, 1.0))
    return total / fit.astype(tcdt), scale * fit


def _reduce_packed(x, leaves, tree, parts, live, plain, wire_of, axes, n, n2, kind, scaling, mean,
                   out_dtype, scatter_dimension):
    """`_scaled_reduce` with method "all_to_all": every float leaf in one packed bucket
    (`_packed_a2a`). The senders' scales: "auto", each device's own (the smallest power of
    two that puts its amax within min(wire max, output max); no collective: the scales
    travel with the data); "pre"/"post", the common scale S (one pmax) times N2 or 1."""
    wires = [wire_of(p) for p in live]
    dtypes = [p.dtype if out_dtype is None else jnp.dtype(out_dtype) for p in live]
    if scaling == "auto":
        send = []
        for p, w, dt in zip(live, wires, dtypes):
            if not _narrow(w):
                send.append(p.scale)
                continue
            cdt = compute_dtype(p.data.dtype)
            amax = _finite_amax(p.data.astype(cdt).reshape(-1)) * p.scale
            send.append(lax.stop_gradient(_fit_scale(amax, min(_wire_max(w), _wire_max(dt)), p.scale)))
    else:
        vec = jnp.stack([p.scale for p in live])
        if not all(is_concrete(p.scale) for p in live):
            vec = lax.pmax(vec, axes)
        send = [vec[i] * (n2 if scaling == "pre" else 1.0) for i in range(len(live))]
    results = iter(_packed_a2a(live, wires, dtypes, send, axes, n, n2, kind, scatter_dimension, mean))
    out = []
    for v, p in zip(leaves, parts):
        if p is None:
            out.append(plain(v))
            continue
        data, scale = next(results)
        out.append(_join(dataclasses.replace(p, dtype=data.dtype), data, scale))
    return jax.tree_util.tree_unflatten(tree, out)


def scaled_psum(x, axis_name, *, wire_dtype=None, scaling: str = "auto", out_dtype=None,
                method: str = "psum", own_dtype_below: int = 0):
    """Sum of `x` over the devices of `axis_name`, sent in `wire_dtype` with a shared scale.

    Args:
      x: a pytree of ScaledArray or arrays (non-float leaves are summed as is).
      axis_name: a mesh axis name of the enclosing shard_map (or a tuple of names).
      wire_dtype: dtype of the data on the wire (e.g. jnp.float8_e5m2, jnp.float16); None:
        the data's dtype.
      scaling: "pre", "post" or "auto" (see the module docstring).
      out_dtype: dtype of the output data (default: the input's data dtype).
      method: "psum": one all-reduce in the wire format (partial sums rounded to it at each
        step; a backend may widen the all-reduce of 8-bit types: XLA's CPU backend sums
        FP8 in float16). "all_to_all": every leaf packed into one buffer of raw bytes,
        reduce-scattered by one all-to-all with a local sum in float32, the shard sums
        all-gathered in the wire format by one all-gather; each device's float32 scales
        travel in the same buffers (no other collective for "auto"): the bytes of a ring
        all-reduce in the wire format on any backend, one collective of each kind per call.
      own_dtype_below: float leaves with fewer elements travel in their data's dtype, not
        `wire_dtype` (e.g. a float32 loss, biases and norms: negligible bytes, no FP8
        rounding; with "all_to_all" they share the buffers of the others).
    Returns:
      The pytree of sums (ScaledArray leaves for ScaledArray inputs).
    """
    return _scaled_reduce(x, axis_name, "sum", wire_dtype=wire_dtype, scaling=scaling,
                          mean=False, out_dtype=out_dtype, method=method,
                          own_dtype_below=own_dtype_below)


def scaled_pmean(x, axis_name, *, wire_dtype=None, scaling: str = "auto", out_dtype=None,
                 method: str = "psum", own_dtype_below: int = 0):
    """Mean of `x` over the devices of `axis_name` (`scaled_psum` divided by N, the 1/N in
    the scale): the data-parallel gradient all-reduce. Arguments as `scaled_psum`."""
    return _scaled_reduce(x, axis_name, "sum", wire_dtype=wire_dtype, scaling=scaling,
                          mean=True, out_dtype=out_dtype, method=method,
                          own_dtype_below=own_dtype_below)


def scaled_psum_scatter(x, axis_name, *, scatter_dimension: int = 0, mean: bool = False,
                        wire_dtype=None, scaling: str = "auto", out_dtype=None,
                        method: str = "psum"):
    """Reduce-scatter of `x` over `axis_name` (`jax.lax.psum_scatter(..., tiled=True)`) in
    `wire_dtype` with a shared scale: the FSDP gradient collective. `mean=True` divides by
    N. With method "all_to_all" the pieces travel as raw bits and are summed in float32.
    Other arguments as `scaled_psum`; the amax of "auto" is over the whole local tensor."""
    return _scaled_reduce(x, axis_name, "scatter", wire_dtype=wire_dtype, scaling=scaling,
                          mean=mean, out_dtype=out_dtype, method=method,
                          scatter_dimension=scatter_dimension)


# ---------------------------------------------------------------------------------------
# Parameter gathers in a narrow format (FSDP)
# ---------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather_as(x, wire, sharding, source):
    data, scale = get_data_scale(x)  # inside scalify: the data cross the wire, not the value
    bits = _bits(cast(data, wire))  # as raw words: no backend widens an integer re-layout
    if source is not None:  # the narrow words keep x's layout: the reshard happens on them
        bits = lax.with_sharding_constraint(bits, source)
    bits = lax.with_sharding_constraint(bits, sharding)
    moved = cast(_unbits(bits, wire), x.dtype)
    return _join(_Leaf(moved, scale, False, x.dtype), moved, scale.reshape(()))


def _gather_as_fwd(x, wire, sharding, source):
    return _gather_as(x, wire, sharding, source), None


def _gather_as_bwd(wire, sharding, source, _, g):
    # The gradient of the gathered value goes back to x's layout (a reduce-scatter).
    return (g if source is None else lax.with_sharding_constraint(g, source),)


_gather_as.defvjp(_gather_as_fwd, _gather_as_bwd)


def gather_as(x, wire_dtype, sharding, *, source=None):
    """`x` cast to `wire_dtype`, laid out as `sharding`, cast back to its dtype.

    For FSDP under `jax.jit` (GSPMD): `x` is a parameter sharded over the mesh (`source`,
    its sharding) and `sharding` is replicated, so XLA all-gathers it in `wire_dtype` (1
    byte per element for FP8) instead of in the parameter's dtype. The narrow values move as
    raw words (bitcast to unsigned integers: XLA's CPU backend widens FP8 and bfloat16
    collectives). Without `source` XLA may place the all-gather on `x` itself, before the
    cast (sharding propagation crosses elementwise ops). Forward: `cast(cast(x, W), x.dtype)` (FP8 saturating, as
    `scalify.ops.cast`), exact when `x`'s values are already those of W, e.g. a kernel the
    matmul casts to W anyway. Backward: straight-through (the cotangent is returned as is,
    so XLA reduce-scatters the gradient in its own dtype).

    Inside `scalify` the cast applies to the data of a ScaledArray and the scale (a
    replicated scalar) is kept: the weight crosses the wire as W data, its float32 scale
    needs no collective.
    """
    wire = jnp.dtype(wire_dtype)
    if isinstance(x, ScaledArray):
        return ScaledArray(gather_as(x.data, wire, sharding, source=source), x.scale)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or not jnp.issubdtype(wire, jnp.floating):
        raise TypeError(f"gather_as casts floating-point arrays to a floating-point wire format, got "
                        f"{x.dtype} -> {wire}.")
    return _gather_as(x, wire, sharding, source)


# ---------------------------------------------------------------------------------------
# Meshes and shardings
# ---------------------------------------------------------------------------------------
def make_mesh(shape: Sequence[int] | int | None = None, axis_names: Sequence[str] = (DATA_AXIS,),
              *, devices: Sequence[Any] | None = None) -> Mesh:
    """A mesh over the available devices (or `devices`), axes of type Auto (GSPMD).

    Args:
      shape: devices per axis; one entry may be -1 (inferred). Default: every device on
        the first axis (data parallel / FSDP over "data"), 1 on the others. An int is the
        number of devices of a 1-D mesh (the first `shape` devices).
      axis_names: mesh axis names (default ("data",)).
      devices: the devices to use (default `jax.devices()`).
    Raises:
      ValueError: the shape does not fit the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    names = tuple(axis_names)
    if isinstance(shape, int):
        if shape > len(devices):
            raise ValueError(f"make_mesh: {shape} devices asked for, {len(devices)} available.")
        devices, shape = devices[:shape], None
    if shape is None:
        shape = (len(devices),) + (1,) * (len(names) - 1)
    shape = list(shape)
    if len(shape) != len(names):
        raise ValueError(f"make_mesh: shape {tuple(shape)} and axis_names {names} differ in length.")
    if shape.count(-1) > 1:
        raise ValueError("make_mesh: at most one -1 in shape.")
    known = int(np.prod([s for s in shape if s != -1]))
    if -1 in shape:
        if len(devices) % known:
            raise ValueError(f"make_mesh: {len(devices)} devices do not divide into {tuple(shape)}.")
        shape[shape.index(-1)] = len(devices) // known
    total = int(np.prod(shape))
    if total > len(devices):
        raise ValueError(f"make_mesh: shape {tuple(shape)} needs {total} devices, "
                         f"{len(devices)} available.")
    grid = np.array(devices[:total], dtype=object).reshape(shape)
    return Mesh(grid, names)


def _leaf_spec_fsdp(shape, n: int, axis, min_size: int):
    if n <= 1 or int(np.prod(shape, dtype=np.int64)) < min_size:
        return P()
    dims = [i for i, d in enumerate(shape) if d % n == 0 and d >= n]
    if not dims:
        return P()
    best = max(dims, key=lambda i: (shape[i], -i))
    return P(*[axis if i == best else None for i in range(best + 1)])


def _scale_spec(data_spec, data_shape, scale_shape):
    if int(np.prod(scale_shape, dtype=np.int64)) == 1:
        return P()
    entries = (list(data_spec) + [None] * len(data_shape))[: len(data_shape)]
    lead = len(data_shape) - len(scale_shape)
    return P(*[entries[lead + i] if scale_shape[i] == data_shape[lead + i] and scale_shape[i] != 1
               else None for i in range(len(scale_shape))])


def _map_leaves(fn_array, tree):
    """Map `fn_array(shape) -> spec` over the arrays of `tree`; ScaledArray leaves become
    ScaledArray(data spec, scale spec)."""

    def one(x):
        if isinstance(x, ScaledArray):
            d_shape, s_shape = tuple(np.shape(x.data)), tuple(np.shape(x.scale))
            spec = fn_array(d_shape)
            return ScaledArray.tree_unflatten(None, (spec, _scale_spec(spec, d_shape, s_shape)))
        return fn_array(tuple(np.shape(x)))

    return jax.tree_util.tree_map(one, tree, is_leaf=is_scaled_leaf)


def fsdp_specs(tree, mesh: Mesh, axis: str = DATA_AXIS, *, min_size: int = 2**10):
    """PartitionSpecs that shard every array of `tree` over mesh axis `axis` (FSDP/ZeRO-3).

    Each array is split along its largest dimension divisible by the axis size (the first
    such on ties); arrays smaller than `min_size` elements, or with no divisible dimension,
    are replicated. ScaledArray leaves get `ScaledArray(data spec, scale spec)`: a scalar
    scale is replicated (P()), a per-element scale follows the data where it has its size.
    """
    n = int(mesh.shape[axis])
    return _map_leaves(lambda shape: _leaf_spec_fsdp(shape, n, axis, min_size), tree)


def fsdp_shardings(tree, mesh: Mesh, axis: str = DATA_AXIS, *, min_size: int = 2**10):
    """`fsdp_specs` as NamedShardings on `mesh` (for jit in/out_shardings, device_put)."""
    specs = fsdp_specs(tree, mesh, axis, min_size=min_size)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                  is_leaf=lambda s: isinstance(s, P))


def replicated_shardings(tree, mesh: Mesh):
    """A replicated NamedSharding for every array of `tree` (data parallel parameters);
    ScaledArray leaves get ScaledArray(sharding, sharding)."""
    specs = _map_leaves(lambda shape: P(), tree)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                  is_leaf=lambda s: isinstance(s, P))


def place(tree, shardings):
    """`jax.device_put(tree, shardings)` of host values or arrays. With several processes
    (`jax.distributed`) the values go through host copies, which every process must pass
    alike: each process keeps the shards of its own devices."""
    if jax.process_count() > 1:
        tree = jax.device_get(tree)
    return jax.device_put(tree, shardings)


def batch_sharding(mesh: Mesh, axes: str | Sequence[str] = DATA_AXIS) -> NamedSharding:
    """Sharding of a batch split along its first dimension over `axes`."""
    axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
    return NamedSharding(mesh, P(axes if len(axes) > 1 else axes[0]))


def scaled_specs(specs, tree):
    """Expand `specs` (a pytree prefix of `tree`) so that each ScaledArray of `tree` gets
    `ScaledArray(spec, scale spec)`: for `jax.shard_map` in/out_specs over ScaledArray
    values (a spec like P("data") cannot apply to a 0-d scale).

    Example: `jax.shard_map(f, mesh=m, in_specs=scaled_specs(P("data"), x), ...)(x)`.
    """

    def expand(spec, sub):
        return _map_leaves(lambda shape: spec, sub)

    return jax.tree_util.tree_map(expand, specs, tree, is_leaf=lambda s: isinstance(s, P) or s is None)
