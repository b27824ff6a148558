"""Scaled low-precision master weights: params stored as FP16 `ScaledArray`s.

Master weights in float16 lose an update `u` whenever `|u|` is below half the spacing of
float16 at the weight (`|u| < 2^-12 |w|` in the normal range): round-to-nearest rounds it
away, every step, so a small learning rate stops training altogether. Two things keep
small updates here:

- the per-tensor power-of-two scale puts the largest weight just below the float16
  maximum, so no weight of the tensor underflows into the subnormals (where the spacing
  is coarser relative to the weight) and the whole 2^-11 relative precision is used;
- stochastic rounding (`rounding="stochastic"`) rounds up with probability equal to the
  fractional part in units of the spacing: `E[round(w + u)] = w + u`, so updates far
  below the spacing still move the weights on average (Gupta et al. 2015, "Deep Learning
  with Limited Numerical Precision"). It costs one random draw per weight per step.

The default is round-to-nearest (deterministic). docs/optimizers.md reports both on the
small regression problem of the tests.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from scalify.core.scaled_array import ScaledArray
from scalify.quant.formats import format_info
from scalify.ops import get_data_scale, stop_scaling
from scalify.optim.codecs import (ScaledCodec, at_scales, encode_scaled, finite_amaxes_variadic,
                                  is_stored_leaf, scale_for)

__all__ = ["scaled_params", "apply_updates"]


def _unit_margin(dtype, margin):
    # Data near unit scale by default: scalify's rules assume unit-scale data and compute
    # on it in its own dtype (e.g. `weight_decay * w` multiplies float16 data by a
    # mantissa in [1, 2)), so master weights keep the format's headroom above them.
    return format_info(dtype).emax if margin is None else margin


def scaled_params(params: Any, dtype=jnp.float16, *, margin: int | None = None) -> Any:
    """Float leaves of `params` as `ScaledArray`s of `dtype` with a per-tensor power-of-two
    scale from the tensor's absolute maximum (see `codecs.scale_for`); other leaves kept.

    By default (`margin=None`) the scale puts the largest weight of each tensor in
    `(1, 2]` of data (unit scale: what scalify's rules assume; float16 keeps 15 binades of
    headroom above and full 2^-11 relative precision down to 2^-14 times the largest
    weight). `margin=0` puts it just below the format maximum instead.
    Bytes per parameter: `itemsize(dtype)` (+ 4 per tensor for the scale).

    Optimizer state: optax makes its moments in the params' dtype, so a plain optax
    optimizer initialised from these params (`tx.init(params)`) keeps float16 moments whose
    scales are the ones scalify propagates. Outside scalify (or with
    `ScalifyConfig(cast_drift_window=None)`) Adam's second moment of a small gradient then
    underflows to zero and its update `m / (sqrt(v) + eps)` grows to many times the
    learning rate. For float32 moments initialise it from the float32 view,
    `tx.init(scalify.optim.values(params))`; for FP16 moments with a per-tensor scale chosen
    at every update, wrap it in `scalify.optim.scaled_state`.
    """
    dtype = jnp.dtype(dtype)
    codec = ScaledCodec(dtype, _unit_margin(dtype, margin))

    def enc(p):
        if isinstance(p, ScaledArray) or not (
            hasattr(p, "dtype") and jnp.issubdtype(p.dtype, jnp.floating)
        ):
            return p
        return codec.encode(jnp.asarray(p))

    return jax.tree_util.tree_map(enc, params, is_leaf=is_stored_leaf)


SCALE_FROM = ("new", "previous")


def apply_updates(
    params: Any,
    updates: Any,
    *,
    rounding: str = "nearest",
    key=None,
    margin: int | None = None,
    scale_from: str = "new",
    float32_scale_from: str | None = None,
) -> Any:
    """`params + updates` for params that may be scaled low-precision master weights.

    - ScaledArray leaves: `w = data*scale + u` is computed in float32, a new power-of-two
      scale is chosen from `max|w|`, and `w / scale` is rounded to the data dtype with
      `rounding` ("nearest" or "stochastic"; stochastic needs `key`, e.g.
      `jax.random.fold_in(key, step)`; each leaf draws its bits from `key` and its index).
    - Plain float32 (or wider) leaves: `(p + u).astype(p.dtype)`, exactly `optax.apply_updates`.
    - Plain low-precision leaves (float16, bfloat16, FP8; also what a ScaledArray param
      looks like inside `scalify.scalify`): as for ScaledArray, the result expressed with
      `scalify.ops.set_scaling` so that the scalify interpreter carries the new scale
      (outside scalify this is `(p + u).astype(p.dtype)` with the chosen rounding).

    `updates` may be ScaledArray too (materialised in float32). None updates are skipped.
    The new scale follows `scaled_params` (`margin=None`: largest weight in `(1, 2]`) from
    the maximum given by `scale_from`:

    - "new" (default): `max|w|` of the updated value. Exact placement, but the value must
      be written in float32 and reduced before it is encoded: two more passes over every
      tensor, and on a GPU two more kernels per shape.
    - "previous": `max|p|` of the value before the update. It is known before the update
      is computed, so the update and the encode are one elementwise pass (XLA fuses them
      with the optimizer's own arithmetic); the reduction reads the stored low-precision
      data, which the step reads anyway. The largest weight then sits in
      `(1, 2] * max|w| / max|p|` of data: for updates small against the weights (any
      training step) the same scale, or one binade off, as "new". The data keep 2^m of
      headroom above the previous maximum (m = `margin`; by default the format's emax,
      2^15 for float16): a tensor whose largest value grows more than that in one update
      overflows to inf, which the next step's loss shows. "new" has no such limit, and
      "previous" refuses a margin below 4 binades. Vectors and scalars (`ndim <= 1`:
      biases, norm scales, layer-scale gains) are measured after the update, as with
      "new": from zero, or from a layer scale of 1e-6, one update grows them by orders of
      magnitude, and their two more passes are over a few elements.

    `float32_scale_from`: the scale of the new value of float32 (or wider) leaves inside
    scalify. None (default): the one scalify's `add` rule gives `p + u`, which follows the
    update's scale rather than the weights' size, so over training the weights' data drift
    away from unit scale and later 16- or 8-bit casts of them lose bits. "previous": the
    power of two that puts the largest weight *before* the update at data in `[1, 2)`
    (the maxima of all such leaves in one variadic reduction per shape, read from the
    stored weights, their scales in one vector; scale 1 for a tensor of zeros; every such
    leaf is placed, scaled or not, whatever the update's scale), applied in the update's own
    elementwise pass: the new value is the sum of the unscaled weight and update, in the
    weight's dtype, rescaled by one power of two. Vectors and scalars take the scale of
    their updated value, as above. Float32 values are exact at any power-of-two scale: the
    values are `optax.apply_updates`' either way, and outside scalify the option changes
    nothing. A dynamic rescale of the new value (`dynamic_rescale_max`) places it as well,
    but must write the new value, reduce it and rewrite it: three passes over every weight
    instead of one.
    """
    if float32_scale_from not in (None, "previous"):
        raise ValueError(f"float32_scale_from must be None or 'previous', got {float32_scale_from!r}.")
    if scale_from not in SCALE_FROM:
        raise ValueError(f"scale_from must be one of {SCALE_FROM}, got {scale_from!r}: 'new' places "
                         "the scale from the updated value, 'previous' from the value before the update.")
    if scale_from == "previous" and margin is not None and margin < 4:
        raise ValueError(f"scale_from='previous' with margin={margin}: the updated data would keep only "
                         f"2^{margin} of headroom above the previous maximum; use margin=None (unit "
                         "scale, the format's whole range above) or scale_from='new'.")
    leaves, treedef = jax.tree_util.tree_flatten(params, is_leaf=is_stored_leaf)
    ups = treedef.flatten_up_to(updates)
    out, encoded = [], []  # encoded: (index in out, new float32 value, previous leaf or None)
    placed = []  # float32 leaves with `float32_scale_from`: (index in out, previous leaf, new value)
    for p, u in zip(leaves, ups):
        if u is None:
            out.append(p)
            continue
        if isinstance(u, ScaledArray):
            u = u.to_array(jnp.float32)
        if isinstance(p, ScaledArray):
            encoded.append((len(out), p, p.to_array(jnp.float32) + u.astype(jnp.float32), None))
        elif hasattr(p, "dtype") and jnp.issubdtype(p.dtype, jnp.floating) and p.dtype.itemsize < 4:
            # The value data * scale plus u, in float32 as for a ScaledArray: inside scalify
            # the unscaled value (`stop_scaling`), so that the sum is a plain float32 add
            # rather than the scale rule of an add of two differently scaled operands.
            encoded.append((len(out), p, stop_scaling(p, jnp.float32) + jnp.asarray(u).astype(jnp.float32), p))
        elif float32_scale_from is not None and hasattr(p, "dtype") and jnp.issubdtype(p.dtype, jnp.floating):
            # The unscaled values' sum: a plain add, exact as optax's, rather than the scale
            # rule of an add of two differently scaled operands; `at_scales` places it.
            placed.append((len(out), p, optax.apply_updates(stop_scaling(p), stop_scaling(jnp.asarray(u)))))
        else:
            out.append(optax.apply_updates(p, u))
            continue
        out.append(None)
    # Every new value's scale from a maximum: one variadic reduction per shape
    # (`finite_amaxes_variadic`: no stacked copy of the leaves), of the new values or of the
    # previous ones (`scale_from`).
    values = [stop_scaling(w, jnp.float32) for _, _, w, _ in encoded]
    previous = [not (scale_from == "new" or _measured_after(p)) for _, p, _, _ in encoded]
    codecs = [ScaledCodec(p.dtype, _unit_margin(p.dtype, margin)) for _, p, _, _ in encoded]
    amaxes = _amaxes([p if prev else w for (_, p, _, _), w, prev in zip(encoded, values, previous)], previous)
    if rounding == "nearest":  # the scales of each format in one vector (`encode_scaled`)
        news = encode_scaled(codecs, values, [like for _, _, _, like in encoded], amaxes)
    else:
        news = [c.encode(w, like, rounding, key, j, amax=amax)
                for c, (j, _, _, like), w, amax in zip(codecs, encoded, values, amaxes)]
    for (j, _, _, _), new in zip(encoded, news):
        out[j] = new
    # The unit-scale placement of the 16-bit masters, for float32: 2^floor(log2 max|p|) (the
    # finite elements'); scale 1 for a tensor of zeros (a bias before its first update).
    # All the scales in one vector: their arithmetic is traced once, not once per leaf.
    if placed:
        previous = [not _measured_after(p) for _, p, _ in placed]
        amaxes = _amaxes([p if prev else stop_scaling(w, jnp.float32) for (_, p, w), prev in zip(placed, previous)],
                         previous)
        scales = scale_for(jnp.stack(amaxes), jnp.float32, _unit_margin(jnp.float32, None))
        for (j, _, _), w in zip(placed, at_scales([w for _, _, w in placed], scales)):
            out[j] = w
    return jax.tree_util.tree_unflatten(treedef, out)


def _measured_after(p) -> bool:
    """Whether a leaf's new scale under "previous" comes from its updated value: vectors
    and scalars (biases, norm scales, layer-scale gains), whose value can grow by orders
    of magnitude in one update (from zero, or from a layer scale of 1e-6 to the learning
    rate), at the cost of two more passes over a few elements."""
    return jnp.ndim(p) <= 1


def _amaxes(xs, stored):
    """`finite_amaxes_variadic` of the values of `xs` (a reduction per shape and dtype);
    `stored[i]`: xs[i] is a stored master, whose maximum is `max|data| * scale` (a power of
    two: exact), read from its stored data. Its float32 value `data * scale` is what the
    step's other readers of the master compute (the FP8 weight cast, the update): a
    reduction over it would let XLA write that value once, in float32, where it is first
    computed, and hold it to the reduction, 4 bytes per parameter."""
    pairs = [_data_scale(x) if s else (x, None) for x, s in zip(xs, stored)]
    maxima = finite_amaxes_variadic([d for d, _ in pairs])
    return [m if s is None else m * jnp.asarray(s, jnp.float32) for m, (_, s) in zip(maxima, pairs)]


def _data_scale(p):
    """(data, scale) of a stored master: a ScaledArray's (outside scalify), the
    representation of a low-precision array as the scalify interpreter carries it (inside;
    `get_data_scale`, per-layer scales merged), `(p, 1)` for a plain array outside."""
    if isinstance(p, ScaledArray):
        return p.data, p.scale
    return get_data_scale(p, merge=True)
