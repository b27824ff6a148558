"""`scalify(fn)` called inside a shard_map body: scales that agree across the devices.

Inside a `jax.shard_map` body each device runs the scalified function on its own piece of
the data, and a dynamic rescale (the input guard, a loop-carry or power guard) gives each
device its own scale. A shard_map's specs declare a scalar scale replicated (`P()`), so
a scale that differs per device is a wrong number: code reading one device's copy (a
host transfer, a checkpoint, a resharding) applies it to every device's data. Two steps
keep the scales common over the body's manual mesh axes (`manual_axes`):

- the input guard measures its norm over all devices (`guards.rebalance_inputs`);
- every scaled output with a traced scale `s` leaves with `S = pmax(s)` over the manual
  axes and data `d * s / S` (`agree_scales`; exact barring underflow, `s / S <= 1` never
  overflows): one pmax for all outputs. A per-element scale agrees elementwise, which
  holds for any spec of it.

Outside a shard_map body (and under `vmap`, whose named axes are not manual mesh axes)
there are no manual axes and nothing changes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from scalify.core.lax_utils import astype, div, mul
from scalify.core.scale_flow import unchecked_scaled
from scalify.core.scaled_array import ScaledArray, compute_dtype, is_concrete


def manual_axes() -> tuple:
    """The manual mesh axes of the enclosing shard_map body, () outside one."""
    return tuple(jax.sharding.get_abstract_mesh().manual_axes)


def agree_scales(outs, axes: tuple) -> list:
    """`outs` with every traced scale made common over the devices of `axes`: `S = pmax(s)`
    (one pmax for the scales of all outputs), data `d * s / S`."""
    live = [i for i, o in enumerate(outs) if isinstance(o, ScaledArray) and not is_concrete(o.scale)]
    if not axes or not live:
        return list(outs)
    scales = [jnp.asarray(outs[i].scale) for i in live]
    sdt = jnp.result_type(*scales)
    flat = jnp.concatenate([astype(s, sdt).reshape(-1) for s in scales])
    common = lax.pmax(flat, tuple(axes))
    res, start = list(outs), 0
    for i, s in zip(live, scales):
        o, size = outs[i], s.size
        big = common[start:start + size].reshape(s.shape).astype(s.dtype)
        start += size
        cdt = compute_dtype(o.data.dtype, s.dtype)
        data = mul(astype(o.data, cdt), astype(div(s, big), cdt))
        res[i] = unchecked_scaled(astype(data, o.data.dtype), big)
    return res
