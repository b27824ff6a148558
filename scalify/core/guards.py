"""The drift guards: data moved back to unit scale where it drifted.

Static rules assume unit data; where data and scale disagree (data 2^-30 at scale 2^30)
non-linear rules multiply the mismatch. A guard measures a norm m of the data (max |d| by
default) and, where m lies outside a window [2^-lo, 2^hi], moves the power of two
2^floor(log2 m) from the data to the scale: the same value, unit data.

- `rebalance_drift`: one value (loop carries, powers, FP8 casts of wide data);
- `rebalance_inputs`: the scaled arguments of a scalified function, their maxima in one
  variadic reduction per shape (over the devices of a shard_map body's manual axes);
- `delayed_estimate`: under `scalify.core.statistics.delayed_statistics`, a measured
  site's norm from the previous step's record, so that the data pass does not wait for
  this step's reduction.

Measured and derived maxima are shared with later guards through `scale_flow`'s
`scale_cache` (`known_max_abs`, `note_max_abs`).
"""
from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from scalify.core import statistics
from scalify.core.lax_utils import add, arr, astype, div, is_static, minimum, mul, stacked_reductions, sub
from scalify.core.pow2 import clear_mantissa
from scalify.core.scale_flow import (F32_RANGE, ZERO_SCALE, f32_bits, cut_scale, known_max_abs, memo_get, memo_put,
                                     note_max_abs, product_scale, scale_exponent_range, unchecked_scaled)
from scalify.core.scaled_array import ScaledArray, compute_dtype

__all__ = ["power_window", "input_window", "rebalance_inputs", "rebalance_drift", "delayed_estimate"]


def power_window(dtype, power: int = 2) -> tuple[int, int]:
    """(lo, hi) such that data of max-abs m in [2^-lo, 2^hi] keeps `m^power` normal in
    `dtype` with the mantissa's room below it: m^|power| >= tiny * 2^mantissa_bits (so the
    squares of elements up to 2^-mantissa_bits smaller than the max are not subnormal) and
    m^|power| <= max / 2^mantissa_bits... bounded to the exponent range. float32, power 2:
    (51, 52); float16: (2, 3); E4M3: (1, 2)."""
    fi = ml_dtypes.finfo(dtype)
    p = max(abs(int(power)), 1)
    lo_exp = int(np.log2(float(fi.tiny))) + int(fi.nmant)
    hi_exp = int(np.floor(np.log2(float(fi.max)))) - int(fi.nmant)
    lo = max((-lo_exp) // p, 1) if lo_exp < 0 else 1
    hi = max(hi_exp // p, 1) if hi_exp > 0 else 1
    return lo, hi


def input_window(dtype):
    """The "auto" window of the input guard: 2 for dtypes with at least 8 exponent bits
    (float32, bfloat16, float64): data whose max |d| lies outside [2^-2, 2^2] leave at unit
    max |d|; None (no guard) for float16 and FP8, whose producers place the data
    deliberately (a move to unit data would give up range they chose to keep)."""
    return 2 if ml_dtypes.finfo(dtype).maxexp >= 128 else None


def rebalance_inputs(xs, window, axes: tuple = ()):
    """The input guard (`ScalifyConfig.input_drift_window`) on the scaled arguments of
    `scalify(fn)`: each wide-float argument whose data max-abs left the window (see
    `input_window`) enters with unit max-abs data, so that every call (every training step)
    starts from the near-unit data that the rules assume, whatever the previous step left
    in the parameters and optimizer state. (Max-abs, not mean: a tensor whose energy sits
    in a few entries keeps those entries near 1, where a float16 matmul of them cannot
    overflow.)

    `axes`: the manual mesh axes of an enclosing shard_map body, where each device holds a
    piece of an argument. The max is then over all pieces (one pmax for all arguments): the
    same factor on every device, the one the guard outside the shard_map gives the whole
    array. A per-device factor would give each device its own scale for a scale the specs
    declare replicated."""
    if window is None:
        return xs
    windows = [input_window(o.dtype) if isinstance(o, ScaledArray) and window == "auto" else window
               for o in xs]
    maxes = [None] * len(xs)
    guarded = [i for i, (o, w) in enumerate(zip(xs, windows)) if w is not None and isinstance(o, ScaledArray)]
    if guarded:
        maxes = _grouped_max_abs(xs, guarded)
        if axes:
            cdt = jnp.result_type(*[maxes[i].dtype for i in guarded])
            total = lax.pmax(jnp.stack([astype(maxes[i], cdt) for i in guarded]), tuple(axes))
            for k, i in enumerate(guarded):
                maxes[i] = total[k]
        else:
            for i in guarded:
                note_max_abs(xs[i].data, maxes[i])
    out = list(xs)
    groups: dict = {}
    for i in guarded:
        if _moves_on_bits(xs[i]):
            groups.setdefault(windows[i], []).append(i)
    for w, members in groups.items():
        if len(members) > 1:
            moved = _rebalance_stacked([xs[i] for i in members], [maxes[i] for i in members], w, not axes)
            for i, o in zip(members, moved):
                out[i] = o
    return [o if w is None or o is not x else rebalance_drift(o, w, norm="max", m=m, local=not axes)
            for o, x, w, m in zip(out, xs, windows, maxes)]


def _moves_on_bits(x) -> bool:
    """Whether the drift guard moves `x` on the float32 bits of its scale (`_moved_scale`):
    float32 (or narrower) data computed in float32, one float32 scale."""
    return (isinstance(x, ScaledArray) and compute_dtype(x.dtype) == np.float32 and np.ndim(x.scale) == 0
            and jnp.result_type(x.scale) == np.float32 and scale_exponent_range() == F32_RANGE)


def _rebalance_stacked(xs, maxes, window, local: bool):
    """`rebalance_drift(x, window, norm="max", m=m)` of each x (`_moves_on_bits`) with its
    measured max-abs m, the scale arithmetic done once on the vectors of maxima and scales
    (the same elementwise operations: the same values) instead of once per argument."""
    lo, hi = window if isinstance(window, tuple) else (window, window)
    m = jnp.stack([astype(mi, np.float32) for mi in maxes])
    scales = jnp.stack([lax.reshape(astype(x.scale, np.float32), ()) for x in xs])
    new_scales, rs = _moved_scale(scales, minimum(_drift_factor(m, scales, lo, hi), np.float32(2.0**126)))
    # cut (`cut_scale`): each argument's slice reads the vectors, not a copy of their chain
    new_scales, rs = cut_scale(new_scales), cut_scale(rs)
    tops = mul(m, rs)
    out = []
    for k, x in enumerate(xs):
        r = lax.index_in_dim(rs, k, keepdims=False)
        data = astype(mul(astype(x.data, np.float32), r), x.dtype)
        note_max_abs(data, astype(astype(lax.index_in_dim(tops, k, keepdims=False), x.dtype), np.float32))
        scale = lax.index_in_dim(new_scales, k, keepdims=False)
        if local:
            _note_placed(data, scale, lo, hi)
        out.append(unchecked_scaled(data, scale))
    return out


def _grouped_max_abs(xs, indices):
    """max |data| of each `xs[i]` (i in `indices`), as a list indexed like `xs`: arguments of
    one shape and dtype (a layer's parameters and their optimizer moments, layer after
    layer) are reduced together (`stacked_reductions`), each keeping its own maximum."""
    def max_abs(x, axes):
        a = lax.abs(astype(x, compute_dtype(x.dtype)))
        return lax.reduce_max(a, axes) if axes else a  # 0-d: no reduction

    maxes = [None] * len(xs)
    for i, m in zip(indices, stacked_reductions([xs[i].data for i in indices], max_abs)):
        maxes[i] = m
    return maxes


def delayed_estimate(measure, top):
    """(norm, recorded) of a measured site (`scalify.core.statistics`): under delayed
    statistics, the norm this site of the trace estimates from the previous step's record,
    with `measure()` (a float32 norm of data at the 0-d scale `top`, computed apart from the
    data path) recorded for the next (NaN where the record gives none: the site keeps its
    data); counting, the measured norm, recorded. A max-abs estimate is noted for later
    guards as a measured one is (`note_max_abs`): they derive theirs from it, not from this
    step's data. Without statistics (None, False), and `measure` is not called. At a
    static `top` of 1 (an unscaled value promoted to scale 1) the estimate is the record
    itself: a record is a power of two of at least 2^-126 or NaN, which a division by 1
    leaves as it is."""
    stats = statistics.active()
    if stats is None:
        return None, False
    unit = is_static(top) and np.size(top) == 1 and float(np.reshape(top, ())) == 1.0
    top = lax.reshape(astype(top, jnp.float32), ())
    now = astype(measure(), jnp.float32)
    previous = stats.exchange(now, top)
    if previous is None:
        return now, True
    if unit:  # a record (a power of two of at least 2^-126, or NaN) over 1: the record itself
        return previous, True
    estimate = lax.div(previous, top)  # powers of two: exact; a flush to 0 is no record
    return lax.select(lax.gt(estimate, np.float32(0.0)), estimate, np.float32(np.nan)), True


def _max_abs(data):
    return lax.reduce_max(lax.abs(data), tuple(range(data.ndim))) if data.ndim else lax.abs(data)


def rebalance_drift(x, window, power: int = 2, norm: str = "max", m=None, local: bool = True):
    """The drift guard: a scaled float value whose data norm m (max |d|, or mean |d| with
    norm="mean") lies outside [2^-lo, 2^hi] becomes (data / f, scale * f) with
    f = 2^floor(log2 m) (unit data; the scale clamped to its range, the rest kept in data);
    all-zero data take a scale of at most ZERO_SCALE; otherwise, and for m = inf or nan, it
    is unchanged. Exact barring underflow. Costs one reduction.

    `m`: the norm when the caller measured it (over several devices: `rebalance_inputs`,
    with `local` False).

    A max-norm guard on data that a max-norm guard of a window inside this one has just
    placed (the same data and scale, e.g. the float16 cast of a parameter the input guard
    placed) is the identity, and is skipped: that guard left max |d| inside its window, or
    at 1 <= max |d| < 2 where it moved the data, or a zero at a scale of at most
    ZERO_SCALE. A max-norm guard of a window on the data and scale that a guard of the same
    window has already taken in this trace (one activation quantised for several FP8
    matmuls, as attention's query, key and value projections read theirs) returns that
    guard's result: the decision is a function of the data, the scale and the window, so
    it is taken once (and, under delayed statistics, recorded at one site).

    `window` is an int W (lo = hi = W), a pair (lo, hi), or "auto": `power_window(dtype,
    power)`, where `m^power` would lose precision to subnormals or overflow (float32
    squares: m < 2^-51; float16: m < 2^-2).

    Static rules assume unit data; where data and scale disagree (data 2^-30 at scale 2^30)
    non-linear rules multiply the mismatch (square doubles it), so the guard runs where that
    compounds: loop carries (`ScalifyConfig.carry_drift_window`) and powers
    (`ScalifyConfig.power_drift_window`)."""
    if window is None or not isinstance(x, ScaledArray):
        return x
    if window == "auto":
        lo, hi = power_window(x.dtype, power)
    else:
        lo, hi = window if isinstance(window, tuple) else (window, window)
    if norm == "max" and _placed_within(x, lo, hi):
        return x
    key = _guard_key(x, lo, hi) if norm == "max" and m is None and local else None
    if key is not None:
        earlier = memo_get(*key)
        if earlier is not None:
            return earlier
    out = _rebalance_drift(x, lo, hi, norm, m, local)
    if key is not None:
        memo_put(*key, out)
    return out


def _guard_key(x, lo, hi):
    """(memo key, objects) of a max-norm guard of window (lo, hi) on `x` (`rebalance_drift`):
    the same data at the same scale (the same traced scale, or an equal static one) guarded
    with the same window is moved the same way."""
    if is_static(x.data):
        return None
    if is_static(x.scale):
        scale = np.asarray(x.scale)
        return ("drift guard", id(x.data), scale.dtype.str, scale.shape, scale.tobytes(), lo, hi), (x.data,)
    return ("drift guard", id(x.data), id(x.scale), lo, hi), (x.data, x.scale)


def _rebalance_drift(x, lo, hi, norm, m, local):
    """`rebalance_drift` of window (lo, hi) once its memo is missed."""
    cdt = compute_dtype(x.dtype)
    data = astype(x.data, cdt)
    scale = x.scale if is_static(x.scale) else arr(x.scale)  # a static scale stays static
    top = astype(scale if np.size(scale) == 1 else lax.reduce_max(scale, tuple(range(scale.ndim))), jnp.float32)
    from_record = False
    if m is None and norm == "max":
        m = known_max_abs(x.data)
        if m is None and local and not is_static(data):
            stats = statistics.active()
            from_record = stats is not None and stats.previous is not None and cdt == np.float32
            m, _ = delayed_estimate(lambda: _max_abs(data), top)
    if m is not None:
        m = astype(m, cdt)
    elif norm == "max":
        m = _max_abs(data)
        note_max_abs(x.data, m)
    else:  # the mean of |d| cannot underflow as a mean of squares of drifted data would
        m = div(lax.reduce_sum(lax.abs(data), tuple(range(x.ndim))), np.asarray(max(x.size, 1), cdt))
    f = _record_factor(m, lo, hi) if from_record else _drift_factor(m, lax.reshape(top, ()), lo, hi)
    if cdt == np.float32 and scale.dtype == np.float32 and scale_exponent_range() == F32_RANGE:
        # f <= 2^126 keeps r = scale / new_scale in [1/f, 1] a normal number
        new_scale, r = _moved_scale(scale, minimum(f, np.float32(2.0**126)))
        out = astype(mul(data, r), x.dtype)
        if norm == "max":  # a power-of-two factor: the largest element moves exactly (or the estimate)
            note_max_abs(out, astype(astype(mul(m, r), x.dtype), np.float32))
            if local:
                _note_placed(out, new_scale, lo, hi)
        return unchecked_scaled(out, new_scale)
    new_scale, factor = product_scale(scale, astype(f, scale.dtype))
    factor = astype(factor, cdt)
    out = astype(mul(div(data, f), factor), x.dtype)
    if norm == "max":  # the same monotone map on the maximum (or the estimate)
        note_max_abs(out, astype(astype(mul(div(m, f), factor), x.dtype), np.float32))
    return unchecked_scaled(out, new_scale)


def _note_placed(data, scale, lo, hi) -> None:
    """Record that a max-norm drift guard of window (lo, hi), on the float32 bits of a
    0-d scale (`_moved_scale`), made (data, scale)."""
    if not is_static(data) and not is_static(scale) and np.ndim(scale) == 0:
        memo_put(("placed", id(data), id(scale)), (data, scale), (lo, hi))


def _placed_within(x, lo, hi) -> bool:
    """Whether (x.data, x.scale) come from a guard of a window inside [2^-lo, 2^hi], with
    1 and 2 in it (`_note_placed`): a max-norm guard of this window leaves them as they are."""
    w = None if is_static(x.data) else memo_get(("placed", id(x.data), id(x.scale)), (x.data, x.scale))
    return w is not None and lo >= 0 and hi >= 1 and w[0] <= lo and w[1] <= hi


def _drift_factor(m, top, lo, hi):
    """The drift guard's factor f for data of max-abs m at largest scale `top` (elementwise
    where m and top are vectors of the same shape; a 0-d top with any m):
    f = 2^floor(log2 m) where that lies outside [2^-lo, 2^hi], min(ZERO_SCALE / top, 1)
    where m = 0, else 1."""
    # f = 2^floor(log2 m) for a normal m; inf / nan (excluded by is_finite) are not drifted.
    f = clear_mantissa(m)
    drifted = ((f > 2.0**hi) | (f < 2.0**-lo)) & (f > 0) & lax.is_finite(m)
    # All-zero data (m = 0; a subnormal m, flushed by the GPU and XLA:CPU anyway, counts as
    # 0) have any scale: their largest scale goes down to ZERO_SCALE (kept if already below).
    # A zero left at a stale large scale wins the largest-scale choice of the add, concatenate
    # or contraction that meets it and flushes the float16 values there (a masked time step of
    # a float16 LSTM's backward pass did this to its input projection's gradient).
    zero = lax.eq(f, jnp.zeros_like(f))
    down = astype(lax.min(lax.div(np.float32(ZERO_SCALE), top), np.float32(1.0)), f.dtype)
    if np.ndim(f) and not np.ndim(down):
        down = lax.broadcast_in_dim(down, np.shape(f), ())
    f = lax.select(zero, down, f)
    return lax.select(drifted | zero, f, jnp.ones_like(f))


def _record_factor(m, lo, hi):
    """`_drift_factor` of a float32 estimate from a delayed record (`delayed_estimate` after
    a previous step): m = record / top is a power of two (a power-of-two record over a
    power-of-two scale), inf (an overflow) or NaN (no record, or a quotient flushed to 0),
    never 0 or subnormal (XLA flushes subnormals): its mantissa is already clear and the
    all-zero branch cannot be taken, so f = m where m is finite and outside [2^-lo, 2^hi],
    else 1 (NaN fails every comparison) -- the same f in 5 operations instead of 16."""
    high = lax.bitwise_and(lax.gt(m, np.float32(2.0**hi)), lax.is_finite(m))
    drifted = lax.bitwise_or(high, lax.lt(m, np.float32(2.0**-lo)))
    return lax.select(drifted, m, jnp.ones_like(m))


def _moved_scale(scale, f):
    """(new_scale, r) for data d at `scale` moving to data d*r: new_scale = clamp(scale*f,
    2^-126, 2^127) (scale*f itself for a static scale in [1, 2], where it is in range for
    every f) and r = scale / new_scale from the bits (a power of two between 1/f and 1; a
    division would let XLA re-associate `d * (scale / new_scale)` into an overflowing
    `(d * scale) / new_scale`). f is cut from the scale graph (`cut_scale`): consumers of
    the moved value read it instead of re-computing the guard's test.
    float32 scale and f, f in [2^-126, 2^126]."""
    lo, hi = F32_RANGE
    f = cut_scale(f)
    if is_static(scale) and np.all((scale >= 2.0 ** (lo + 126)) & (scale <= 2.0 ** (hi - 126))):
        # a static scale in [1, 2]: scale * f is in range for every f, the clamp is the identity
        new_scale = mul(scale, f)
    else:
        new_scale = lax.clamp(np.float32(2.0**lo), mul(scale, f), np.float32(2.0**hi))
    r = lax.bitcast_convert_type(add(sub(f32_bits(scale), f32_bits(new_scale)), np.asarray(127 << 23, np.uint32)),
                                 jnp.float32)
    return new_scale, r
