"""How unscaled values enter the scale graph, and how operands agree on a common scale.

This module is the one place that decides the scale of a value scalify did not receive as
a ScaledArray:

- **promotion** (`promote`): an unscaled float operand of an equation that has scaled
  inputs becomes a ScaledArray.
    * A plain array (not known to be a broadcast scalar) gets scale 1: it is represented
      exactly as plain JAX represents it.
    * A constant (a literal or a 0-d value, possibly broadcast, reshaped or converted) `c`
      is split exactly as `c = m * 2^e` with the power of two `2^e` the rounded `|c|`
      (ScalifyConfig rounding mode) clipped to the scale dtype's normal range; the mantissa
      `m` is computed in float32 (or wider), never in the data dtype, so `2^-e` cannot
      overflow float16 or FP8. The same arithmetic runs for a concrete constant (NumPy, at
      trace time) and a traced one (lax ops), so eager and jitted calls agree.
    * An "any scale" constant (0, inf, nan: e.g. an attention mask's `-inf`) takes the
      largest scale of the equation's scaled inputs, so it never changes a common scale.
- **common scale** (`common_scale`): rules that place values of several operands side by
  side (select_n, max, min, clamp, concatenate, pad, dynamic_update_slice, scatter,
  comparisons) rescale them to the largest operand scale. A promoted constant takes part
  with its *placement scale* `min(2^e, 1)`: a constant larger than 1 (`finfo.min` of a
  mask, a clip bound, `nan_to_num`'s `finfo.max`) raises the common scale at most to 1,
  where every value of the data dtype fits as it does in plain JAX. It never drags the
  scale to 2^127 and flushes the other operands (the result is then at least as accurate
  as the plain computation, and equal to it in float32).

Arithmetic rules (mul, div, add, sub, ...) use the constant's exact scale `2^e`, which keeps
its data a unit mantissa.

Static scales: the scale of a plain array or of a concrete constant is a NumPy value, and
the scale arithmetic here (`product_scale`, `scale_exponent`, `scale_from_exponent`,
`exp2_int`) runs in NumPy when its operands are NumPy, with the same integer arithmetic on
the float bits: a scale known at trace time stays a literal and adds no operation to the
traced program. Within one interpretation (`scale_cache`), the integer exponent of every
scale built by `scale_from_exponent` is remembered, and so is every `product_scale`, so
chains of products work on the exponents and identical products are computed once.
"""
from __future__ import annotations

import contextlib
import math
import threading

import jax.numpy as jnp
import ml_dtypes
from jax.extend import core as jex_core
import numpy as np
from jax import lax

from scalify.core.config import Pow2RoundMode, get_config
from scalify.core.lax_utils import add, arr, astype, div, is_static, maximum, minimum, mul, select, sub
from scalify.core.pow2 import clear_mantissa, np_pow2_round, pow2_round
from scalify.core.scaled_array import ScaledArray, broadcasts_to, compute_dtype, is_concrete, is_float

__all__ = [
    "PromotedConstant",
    "promote",
    "max_scale",
    "reference_scale",
    "placement_scale",
    "common_scale",
    "product_scale",
    "factor_scale",
    "is_zero_constant",
    "scale_exponent_range",
    "scale_cache",
]


class PromotedConstant(ScaledArray):
    """A constant promoted next to scaled operands: `data * scale` is the constant with its
    exact power-of-two scale; `placement` is the scale it asks of a common scale (`None`
    for an "any scale" value: 0, inf, nan). Only rules see it: the interpreter turns rule
    outputs back into plain ScaledArray."""

    __slots__ = ("placement", "zero")

    def __init__(self, data, scale, placement, zero: bool = False):
        super().__init__(data, scale)
        self.placement = placement
        self.zero = zero  # known at trace time to be all zeros


def scale_exponent_range() -> tuple[int, int]:
    """(min, max) exponent k of a normal power of two 2^k in the configured scale dtype
    (float32: -126, 127)."""
    finfo = jnp.finfo(get_config().scale_dtype)
    return max(int(finfo.minexp), -126), min(int(finfo.maxexp) - 1, 127)


def max_scale(*xs: ScaledArray):
    """Largest scale among `xs` (elementwise when scales are arrays)."""
    out = arr(xs[0].scale)
    for x in xs[1:]:
        out = out if x.scale is out else maximum(out, x.scale)
    return out


def reference_scale(xs):
    """The scale of "any scale" constants (0, inf, nan) next to the scaled values `xs`: their
    largest scale, elementwise where the scales broadcast together, else the largest value
    of each (the operands of a concatenate, or the inputs of a loop, may carry per-row
    scales of unrelated shapes)."""
    try:
        np.broadcast_shapes(*(np.shape(x.scale) for x in xs))
    except ValueError:
        top = lambda s: np.max(s) if is_static(s) else jnp.max(s)  # noqa: E731
        xs = [x if np.ndim(x.scale) == 0 else unchecked_scaled(x.data, top(x.scale)) for x in xs]
    return max_scale(*xs)


def placement_scale(x: ScaledArray):
    """The scale `x` asks of a common scale: its own, or a promoted constant's placement."""
    if isinstance(x, PromotedConstant) and x.placement is not None:
        return x.placement
    return x.scale


def unchecked_scaled(data, scale) -> ScaledArray:
    """A ScaledArray without construction checks (children may be tracers; the scale is a
    power of two by construction)."""
    return ScaledArray.tree_unflatten(None, (data, scale))


def half_exponent_range(dtype) -> int:
    """Half of the data dtype's exponent range above 1 (float32 64, float16 8, E4M3 4): the
    room left for data that are near unit."""
    return int(ml_dtypes.finfo(dtype).maxexp) // 2


def _headroom(dtype) -> float:
    """How far the common scale may fall below an operand's scale: 2^half_exponent_range
    (float32 2^64, float16 2^8, E4M3 2^4)."""
    return float(2.0 ** half_exponent_range(dtype))


def common_scale(xs):
    """The scale at which the ScaledArray among `xs` are placed side by side.

    S = the largest scale of the scaled operands; then, for the promoted constants c = m*2^e
    among them (an "any scale" constant does not count):
      - S = min(S, max(1, 2^e / tiny)), so that a small constant stays a normal number of the
        data dtype (a 1e-35 placed next to data at scale 2^14 is not flushed), but never
        below S_max / headroom (see `_headroom`), so that the other data cannot overflow;
      - S = max(S, min(2^e, 1)): a large constant (finfo.min of a mask) raises S at most to
        1, where it fits as in plain JAX, instead of dragging it to 2^127.
    Both bounds hold together: min(2^e, 1) <= 1 <= max(1, 2^e / tiny).
    """
    scaled = [x for x in xs if isinstance(x, ScaledArray)]
    consts = [x for x in scaled if isinstance(x, PromotedConstant) and x.placement is not None]
    others = [x for x in scaled if not isinstance(x, PromotedConstant)] or scaled
    out = None
    for x in others:
        s = arr(placement_scale(x))
        out = s if out is None or s is out else maximum(out, s)
    if not consts:
        return out
    dtype = others[0].dtype
    tiny = float(ml_dtypes.finfo(dtype).tiny)
    top = out
    for c in consts:
        out = minimum(out, maximum(div(arr(c.scale), np.asarray(tiny, np.float32).astype(top.dtype)), np.ones((), top.dtype)))
    out = maximum(out, div(top, np.asarray(_headroom(dtype), top.dtype)))
    for c in consts:
        out = maximum(out, arr(c.placement))
    return out


_LOCAL = threading.local()


@contextlib.contextmanager
def scale_cache():
    """Memoize scale arithmetic inside the block (the interpreter opens one per scalified
    call; nested blocks share the outermost one): `scale_exponent` of a scale built by
    `scale_from_exponent` returns the exponent it was built from, and `product_scale` of the
    same two scale objects returns the same result. An entry is used only under the JAX
    trace that made it (a rule tracing a sub-function, e.g. a `cond` branch, does not leak
    its values), and holds its keys, so an `id` is never reused while the block is open."""
    if getattr(_LOCAL, "memo", None) is not None:
        yield
        return
    _LOCAL.memo = {}
    try:
        yield
    finally:
        _LOCAL.memo = None


def memo_get(key, objs):
    """The value stored under `key` for the objects `objs` in the open `scale_cache` by the
    current JAX trace, else None."""
    memo = getattr(_LOCAL, "memo", None)
    entry = None if memo is None else memo.get(key)
    if entry is None or any(a is not b for a, b in zip(entry[0], objs)):
        return None
    if entry[1] != jex_core.get_opaque_trace_state():
        return None
    return entry[2]


def memo_put(key, objs, value) -> None:
    """Store `value` under `key` for `objs` (kept alive) in the open `scale_cache`."""
    memo = getattr(_LOCAL, "memo", None)
    if memo is not None:
        memo[key] = (objs, jex_core.get_opaque_trace_state(), value)


def known_max_abs(data):
    """max |data| (a float32 scalar) when a guard of the open `scale_cache` measured it, or
    derived it exactly from a measured one (see `note_max_abs`, `pass_max_abs`) under the
    current trace; else None. Derived maxima are computed here, when a guard first reads
    them (iteratively: a chain of exact maps can be thousands of ops long)."""
    key = ("max_abs", id(data))
    entry = memo_get(key, (data,))
    if not isinstance(entry, _Derived):
        return entry
    stack = [data]
    while stack:
        d = stack[-1]
        entry = memo_get(("max_abs", id(d)), (d,))
        if not isinstance(entry, _Derived):
            stack.pop()
            continue
        srcs, fn = entry
        pending = [x for x in srcs if isinstance(memo_get(("max_abs", id(x)), (x,)), _Derived)]
        if pending:
            stack.extend(pending)
            continue
        ms = [memo_get(("max_abs", id(x)), (x,)) for x in srcs]
        m = None if any(v is None for v in ms) else ms[0] if fn is None else astype(fn(*ms), np.float32)
        memo_put(("max_abs", id(d)), (d, *srcs), m)
        stack.pop()
    return memo_get(key, (data,))


class _Derived(tuple):
    """(srcs, fn): max |data| = fn(max |src| for src in srcs) (fn None: srcs[0]'s)."""


def note_max_abs(data, m) -> None:
    """Record m = max |data| (float32 scalar) for the guards that later read the same data:
    a max-reduction over a tensor whose maximum is known is not computed again."""
    if not is_static(data):
        memo_put(("max_abs", id(data)), (data,), astype(m, np.float32))


def derive_max_abs(out, srcs, fn=None) -> None:
    """Record max |out| = fn(max |src| for src in srcs) when every src's is known; computed
    only if a guard reads it (`known_max_abs`). `fn` must round as the data op does."""
    if is_static(out) or np.size(out) == 0 or any(out is x for x in srcs):  # a no-op map
        return
    if all(memo_get(("max_abs", id(x)), (x,)) is not None for x in srcs):
        memo_put(("max_abs", id(out)), (out, *srcs), _Derived((tuple(srcs), fn)))


def exact_in(data):
    """The narrowest float dtype every element of `data` is known to be exact in (its
    values were widened from it: `note_exact_in`), else None."""
    return memo_get(("exact_in", id(data)), (data,))


def note_exact_in(data, dtype) -> None:
    """Record that every element of `data` is a value of `dtype` (a widening conversion):
    narrowing it back to `dtype` rounds nothing, so the cast guard has nothing to do."""
    if not is_static(data):
        memo_put(("exact_in", id(data)), (data,), np.dtype(dtype))


def note_transpose(out, src) -> None:
    """Record that the 2-D `out` is `src` transposed (an FP8 cast that needs both layouts
    then reads `src`, `scalify.ops.cast_transpose`)."""
    if not is_static(out) and np.ndim(out) == 2:
        memo_put(("transpose_of", id(out)), (out, src), src)


def transpose_of(data):
    """The array `data` is the 2-D transpose of (`note_transpose`), else None."""
    return None if is_static(data) else memo_get(("transpose_of", id(data)), (data,))


def pass_max_abs(out, src, fn=None) -> None:
    """Record max |out| when `src`'s is known and `out` is `src` under an exact data map:
    a rearrangement (reshape, transpose, broadcast; `fn` None keeps the maximum) or a
    monotone elementwise map of |d| (a conversion, a product with a non-negative scalar),
    `fn` mapping max |src| to max |out|. Rounding is monotone, so the largest element maps
    to the largest one: `fn(m)` must round as the data op does (same op, same dtype).
    With `fn` None (the values' magnitudes kept), `exact_in` passes too."""
    if is_static(out) or np.size(out) == 0:
        return
    derive_max_abs(out, (src,), fn)
    if fn is None and (narrow := exact_in(src)) is not None:
        note_exact_in(out, narrow)


def seed_scale_barrier(scale) -> None:
    """Make the scale barrier's run-time one, `sqrt(convert(s0 > -inf))` with s0 the first
    element of `scale` (exactly 1 unless s0 is nan or -inf), for the current trace in the
    open `scale_cache`. The sqrt is an expensive operation to XLA: `one` is computed once,
    not re-made in every barrier's fusion, and `scale` should have no operation behind it
    (an argument's scale). lax ops, not tracer operators (each of those is a jitted jnp
    ufunc)."""
    s0 = jnp.asarray(scale)
    first = lax.reshape(lax.slice(s0, (0,) * s0.ndim, (1,) * s0.ndim), ()) if s0.ndim else s0
    sdtype = get_config().scale_dtype
    one = lax.sqrt(lax.convert_element_type(lax.gt(first, np.array(-np.inf, s0.dtype)), sdtype))
    memo_put(("barrier one", np.dtype(sdtype)), (), one)


def cut_scale(s):
    """`s / one` with the run-time one of `seed_scale_barrier` (`ScalifyConfig.scale_barrier`):
    the same value, but XLA does not duplicate a division into the fusions that consume it,
    so the operations behind `s` run once. `s` unchanged when the barrier is off, `s` is
    static or no one was seeded in this trace.

    `one` must not be a division itself: XLA rewrites `s / (a / b)` as `s * b / a`, and
    with `one = s / s` that is `s * s / s`, which overflows to inf/inf = NaN for any scale
    above 2^64."""
    if is_static(s) or not get_config().scale_barrier:
        return s
    one = memo_get(("barrier one", np.dtype(s.dtype)), ())
    if one is None:
        return s
    out = _divide_by_one(s, one)
    memo_put(("cut", id(out)), (out,), True)
    return out


def is_cut(s) -> bool:
    """Whether `s` is the output of `cut_scale` in this trace (it has no scale operation
    behind it that XLA would copy into its consumers)."""
    return not is_static(s) and memo_get(("cut", id(s)), (s,)) is not None


def _divide_by_one(x, one):
    """x / one, the 0-d run-time one broadcast to x's shape (converted to x's dtype)."""
    one = lax.convert_element_type(one, x.dtype)
    return lax.div(x, one if x.ndim == 0 else lax.broadcast(one, x.shape))


def cut_data(data, narrow_dtype, seed):
    """`data / one` (the run-time one of `seed_scale_barrier`, broadcast) when `data` is
    computed in a float dtype wider than `narrow_dtype`, the dtype it is cast to next; else
    `data` unchanged (static data, `ScalifyConfig.data_barrier` off). `seed`: a traced
    scale to make the one from if this trace has none yet (else `data` is left as is).

    The same values (x / 1 is exact). Why: a rule that rescales narrow data computes in
    float32, between a widening and a narrowing convert. XLA copies widening converts into
    every consumer for free (they read fewer bytes than they write), so a chain of such
    rules -- a residual stream and its gradient through every layer -- is re-computed inside
    every fusion that reads any value of it. XLA does not copy a float division into several
    consumers: the value is computed once, and the chain stops there. XLA:CPU does not copy
    bfloat16 chains (the compiled size is the same either way), so
    bfloat16 data are left as they are."""
    if is_static(data) or not get_config().data_barrier:
        return data
    narrow = np.dtype(narrow_dtype)
    if np.dtype(data.dtype).itemsize <= narrow.itemsize or narrow == jnp.bfloat16:
        return data
    key = ("barrier one", np.dtype(get_config().scale_dtype))
    if memo_get(key, ()) is None and not is_static(seed):
        seed_scale_barrier(seed)
    one = memo_get(key, ())
    return data if one is None else _divide_by_one(data, one)


def _np_exponent(scale):
    bits = np.asarray(scale).astype(np.float32).view(np.int32)
    return ((bits >> np.int32(23)) & np.int32(0xFF)) - np.int32(127)


def scale_exponent(scale):
    """Integer exponent k (int32) of a power-of-two scale 2^k, read from the float bits.

    Exact for normal float32 powers of two (every scale scalify makes); wider scale dtypes are
    read through float32, so their exponent must lie in float32's normal range. NumPy in,
    NumPy out; a scale built by `scale_from_exponent` in the open `scale_cache` gives back
    its exponent with no new operation.
    """
    if is_static(scale):
        return _np_exponent(scale)
    e = memo_get(("exponent", id(scale)), (scale,))
    if e is not None:
        return e
    bits = lax.bitcast_convert_type(astype(scale, jnp.float32), jnp.int32)
    i32 = np.int32
    return lax.sub(lax.bitwise_and(lax.shift_right_arithmetic(bits, i32(23)), i32(0xFF)), i32(127))


def exp2_int(k, dtype=jnp.float32, in_range: bool = False):
    """2^k for an integer array k clipped to float32's normal range, built from the bits
    (`in_range`: k is known to lie in [-126, 127] already; NumPy in, NumPy out)."""
    if is_static(k):
        k = np.clip(np.asarray(k).astype(np.int32), np.int32(-126), np.int32(127))
        return ((k + np.int32(127)) << np.int32(23)).astype(np.int32).view(np.float32).astype(dtype)
    k = astype(k, jnp.int32)
    if not in_range:
        k = lax.clamp(np.int32(-126), k, np.int32(127))
    bits = lax.shift_left(lax.add(k, np.int32(127)), np.int32(23))
    return astype(lax.bitcast_convert_type(bits, jnp.float32), dtype)


def scale_from_exponent(e, cdt=jnp.float32):
    """Split the power of two 2^e (e: int array) into (scale, factor) with scale = 2^e clipped
    to the scale dtype's normal range and factor = 2^(e - clipped) in `cdt`.

    The factor is 1 unless the scale would over- or underflow; multiplying data by it then
    gives what materialising would give (it is itself clipped to float32's range, so an
    exponent beyond +-252 saturates to inf / 0 instead of producing 0 * inf = NaN).
    """
    lo, hi = scale_exponent_range()
    sdtype = get_config().scale_dtype
    if is_static(e):
        e = np.asarray(e).astype(np.int32)
        clipped = np.clip(e, np.int32(lo), np.int32(hi))
        return exp2_int(clipped, sdtype), exp2_int(e - clipped, cdt)
    e = astype(e, jnp.int32)
    clipped = lax.clamp(np.int32(lo), e, np.int32(hi))
    scale = exp2_int(clipped, sdtype, in_range=True)
    memo_put(("exponent", id(scale)), (scale,), clipped)
    return scale, exp2_int(lax.sub(e, clipped), cdt)


def _is_unit(s) -> bool:
    return is_static(s) and np.size(s) == 1 and np.ndim(s) == 0 and float(s) == 1.0


def product_scale(sa, sb, divide: bool = False, times: float = 1.0):
    """The scale of `a * b` (or `a / b`) and the data factor that keeps it in range.
    `times`: a static power of two the product is also multiplied by (a contraction's
    sqrt(K)), in the same clamp and factor (`_product_times`).

    Returns (scale, factor): scale = sa*sb (sa/sb) clamped to the scale dtype's normal range,
    factor = (sa*sb)/scale, a power of two in float32 that is exactly 1 unless the product
    left the range; multiplying the data by it then gives what the plain value would be (0
    for an underflow), never the NaN of a zero or infinite scale.

    For two traced scales the scale is the float32 product clamped to [2^lo, 2^hi]: exact,
    because a product of powers of two is exact in range, and one beyond float32's range
    saturates to inf (or flushes below 2^-126) on the side the clamp then cuts. A quotient
    is computed on the bits, bits(sa) - bits(sb) clamped to [lo << 23, hi << 23] plus
    127 << 23 (XLA makes every float division a kernel of its own). A traced scale times a
    static power of two is `_times_static_pow2` (float ops only); otherwise the scale is
    built from the exponents. The factor is computed on
    the integer bits or exponents (XLA re-associates float `(sa/s)*sb` into `(sa*sb)/s`,
    which overflows): for two traced float32 scales `_range_factor`, four integer
    operations on the bits. It reaches only the data, so the float scale chains that
    consumers of the scale duplicate stay two operations per product.

    A static unit scale (a 0-d NumPy 1) leaves the other scale as it is (a normal power of
    two of the scale dtype, like every scale scalify makes: already in range), with a static
    factor 1; two static scales give static results.
    """
    if times != 1.0:
        return _product_times(sa, sb, times)
    sdtype = get_config().scale_dtype
    if _is_unit(sb) and astype(sa, sdtype) is sa:
        return sa, np.ones((), np.float32)
    if not divide and _is_unit(sa) and astype(sb, sdtype) is sb:
        return sb, np.ones((), np.float32)
    key = ("product", id(sa), id(sb), divide, sdtype)
    out = memo_get(key, (sa, sb))
    if out is not None:
        return out
    static_k, traced = None, None
    if not is_static(sa):
        static_k, traced = _static_exponent(sb, -1 if divide else 1), sa
    elif not divide and not is_static(sb):
        static_k, traced = _static_exponent(sa, 1), sb
    if static_k is not None:
        out = _times_static_pow2(traced, static_k)
        memo_put(key, (sa, sb), out)
        return out
    lo, hi = scale_exponent_range()
    if not is_static(sa) and not is_static(sb) and (lo, hi) == F32_RANGE:
        a32, b32 = astype(sa, jnp.float32), astype(sb, jnp.float32)
        if divide:  # on the bits: XLA makes every float division a kernel of its own
            diff = sub(lax.bitcast_convert_type(a32, jnp.int32), lax.bitcast_convert_type(b32, jnp.int32))
            diff = lax.clamp(np.int32(lo << 23), diff, np.int32(hi << 23))
            scale = astype(lax.bitcast_convert_type(lax.add(diff, np.int32(127 << 23)), jnp.float32), sdtype)
        else:
            scale = astype(lax.clamp(np.float32(2.0**lo), mul(a32, b32), np.float32(2.0**hi)), sdtype)
        out = scale, _range_factor(sa, sb, scale, divide)
        memo_put(key, (sa, sb), out)
        return out
    ea, eb = scale_exponent(sa), scale_exponent(sb)
    if is_static(ea) and is_static(eb):
        out = scale_from_exponent(ea - eb if divide else ea + eb)
    else:
        e = lax.sub(ea, eb) if divide else lax.add(ea, eb)
        clipped = lax.clamp(np.int32(lo), e, np.int32(hi))
        if is_static(sa) or is_static(sb):
            # XLA turns a division by a constant 2^k into a product with 2^-k, a subnormal
            # (flushed to 0) for k = 127: build the scale from the exponent.
            scale = exp2_int(clipped, sdtype, in_range=True)
        else:
            a32, b32 = astype(sa, jnp.float32), astype(sb, jnp.float32)
            p = div(a32, b32) if divide else mul(a32, b32)
            scale = astype(lax.clamp(np.float32(2.0**lo), p, np.float32(2.0**hi)), sdtype)
        memo_put(("exponent", id(scale)), (scale,), clipped)
        out = scale, exp2_int(lax.sub(e, clipped), jnp.float32)
    memo_put(key, (sa, sb), out)
    return out


F32_RANGE = (-126, 127)


def _product_times(sa, sb, r: float):
    """`product_scale` of sa * sb * r for a static power of two r: two traced float32 scales
    in float32's range give the float product clamped to [2^-126, 2^127] and the factor read
    off the bits (`_range_factor` with k = log2 r); otherwise two products."""
    if is_static(sa) or is_static(sb) or scale_exponent_range() != F32_RANGE \
            or jnp.result_type(sa) != np.float32 or jnp.result_type(sb) != np.float32:
        scale, f1 = product_scale(sa, sb)
        scale, f2 = product_scale(scale, np.asarray(r, np.float32))
        return scale, (f1 if _is_unit(f2) else f2 if _is_unit(f1) else mul(f1, f2))
    lo, hi = F32_RANGE
    scale = lax.clamp(np.float32(2.0**lo), mul(mul(sa, sb), np.float32(r)), np.float32(2.0**hi))
    return scale, _range_factor(sa, sb, scale, False, int(round(math.log2(r))))


def f32_bits(s):
    """The float32 bits of a scale as uint32 (NumPy for a NumPy scale)."""
    if is_static(s):
        return np.asarray(s, np.float32).view(np.uint32)
    return lax.bitcast_convert_type(astype(s, jnp.float32), jnp.uint32)


def _range_factor(sa, sb, scale, divide: bool, k: int = 0):
    """factor = (sa * sb) / scale (or (sa / sb) / scale) for normal float32 powers of two,
    read off the bits: the bits of a positive power of two 2^e are (e + 127) << 23, so the
    bits of 2^(ea + eb - es) are bits(sa) + bits(sb) - bits(scale), and those of
    2^(ea - eb - es) are bits(sa) - bits(sb) + (254 << 23) - bits(scale). Unsigned
    arithmetic wraps, so the intermediate sums need not fit; the result does: a scale
    clamped to [2^-126, 2^127] leaves a factor exponent in [-126, 127] (a quotient's 2^-127
    has biased exponent 0: the factor is 0, the value's float32 underflow). `k`: the scale
    is that of the product times the static 2^k (bits + (k << 23); exact unless the product
    exceeds 2^254)."""
    ab = sub(f32_bits(sa), f32_bits(sb)) if divide else add(f32_bits(sa), f32_bits(sb))
    if divide:
        ab = add(ab, np.asarray(254 << 23, np.uint32))
    if k:
        ab = add(ab, np.asarray((k << 23) % 2**32, np.uint32))
    return lax.bitcast_convert_type(sub(ab, f32_bits(scale)), jnp.float32)


def _static_exponent(s, sign: int):
    """k with s^sign = 2^k for a 0-d NumPy power of two s, when 2^k and the factor bounds of
    `_times_static_pow2` are normal float32 numbers; else None."""
    if not is_static(s) or np.ndim(s) != 0:
        return None
    lo, hi = scale_exponent_range()
    v = float(s)
    if not (v > 0 and np.isfinite(v)) or float(np_pow2_round(v)) != v:
        return None
    k = sign * int(round(np.log2(v)))
    return k if lo <= k <= hi else None


def _times_static_pow2(s, k: int):
    """(scale, factor) of a traced scale s in [2^lo, 2^hi] times the static 2^k, in float
    ops only. 2^k < 1 can only underflow: scale = max(s * 2^k, 2^lo) (exact in range; below
    it the float32 product flushes and the max cuts) and factor = (s * 2^k) / scale =
    min(s * 2^(k-lo), 1); 2^k > 1 can only overflow: scale = min(s * 2^k, 2^hi), factor =
    max(s * 2^(k-hi), 1). Both products are exact normal float32 numbers for k in
    [lo, hi]."""
    sdtype = get_config().scale_dtype
    if k == 0:
        return astype(s, sdtype), np.ones((), np.float32)
    lo, hi = scale_exponent_range()
    s32 = astype(s, jnp.float32)
    p = mul(s32, np.float32(2.0**k))
    if k < 0:
        scale = maximum(p, np.float32(2.0**lo))
        factor = minimum(mul(s32, np.float32(2.0 ** (k - lo))), np.float32(1))
    else:
        scale = minimum(p, np.float32(2.0**hi))
        factor = maximum(mul(s32, np.float32(2.0 ** (k - hi))), np.float32(1))
    return astype(scale, sdtype), factor


# The largest scale the drift guards leave on all-zero data: far below any value's scale a
# float16 or FP8 model meets (gradients of a loss times 2^-40 sit near 2^-50), and far enough
# above the bottom of float32's range (2^-126) that the product of such a scale with the
# scales of two other operands stays in it. (Products that leave the range are clamped, the
# rest going into the data: exact in float32 data, but a float16 output flushes to 0.)
ZERO_SCALE = 2.0**-64


def _np_split(c: float):
    """(exponent e, placement exponent) of a concrete finite non-zero constant c."""
    lo, hi = scale_exponent_range()
    pow2 = float(np_pow2_round(abs(c)))
    e = int(np.clip(np.round(np.log2(pow2)), lo, hi))
    return e, min(e, 0)


def promote(value, scalar, ref_scale, zeros_at_bottom: bool = False) -> ScaledArray:
    """Promote an unscaled float value to ScaledArray (see the module docstring).

    Args:
      value: the unscaled operand (an array or a NumPy scalar).
      scalar: its broadcast-scalar metadata: the 0-d constant it broadcasts (concrete or
        traced), or None for a general array.
      ref_scale: a thunk giving the scale of "any scale" values (0, inf, nan), or None.
      zeros_at_bottom: a concrete zero takes ZERO_SCALE instead (a loop's initial carry,
        which the body may multiply: `jnp.polyval`'s Horner scan).
    """
    sdtype = get_config().scale_dtype
    x = arr(value)
    if scalar is None:
        return ScaledArray(x, np.ones((), sdtype))
    cdt = compute_dtype(x.dtype, sdtype)
    if is_concrete(scalar):
        c = float(np.asarray(scalar, np.float64))
        if c == 0 and zeros_at_bottom:
            return PromotedConstant(x, np.asarray(ZERO_SCALE, sdtype), None, zero=True)
        if not (np.isfinite(c) and c != 0):
            return PromotedConstant(x, _any_scale(ref_scale(), x.shape), None, zero=c == 0)
        e, p = _np_split(c)
        scale = np.asarray(2.0**e, sdtype)
        placement = np.asarray(2.0**p, sdtype)
        if e == 0:
            return PromotedConstant(x, scale, placement)
        if is_concrete(value):
            data = np.asarray(np.asarray(value, np.float64) * 2.0**-e, x.dtype)
        else:
            data = astype(lax.mul(astype(x, cdt), np.asarray(2.0**-e, cdt)), x.dtype)
        return PromotedConstant(data, scale, placement)
    # A traced constant (e.g. a 0-d argument under jit): the same arithmetic as lax ops.
    pow2 = _traced_pow2(scalar)
    regular = lax.gt(pow2, np.float32(0))
    any_scale = _any_scale(ref_scale(), x.shape)
    scale = select(regular, astype(pow2, sdtype), any_scale)
    placement = select(regular, astype(minimum(pow2, np.float32(1)), sdtype), any_scale)
    data = astype(div(astype(x, cdt), astype(scale, cdt)), x.dtype)
    return PromotedConstant(data, scale, placement)


def _traced_pow2(scalar):
    """The power of two of a traced constant c: the rounded |c| clamped to [2^lo, 2^hi], 0
    for an "any scale" value (0, inf, nan). Computed once per constant in the open
    `scale_cache` and cut from the scale graph (`cut_scale`): the equations that use the
    constant (Adam's bias corrections: two per parameter) read it."""
    key = ("traced constant", id(scalar), get_config().rounding_mode)
    out = memo_get(key, (scalar,))
    if out is not None:
        return out
    lo, hi = scale_exponent_range()
    s = astype(scalar, jnp.float32)
    regular = lax.is_finite(s) & lax.ne(s, np.float32(0))
    if get_config().rounding_mode is Pow2RoundMode.DOWN:
        # 0, inf and nan (masked to inf) are not `regular`: no select before the rounding
        pow2 = clear_mantissa(lax.abs(s))
    else:
        pow2 = pow2_round(lax.abs(select(regular, s, np.float32(1))))
    pow2 = lax.clamp(np.float32(2.0**lo), pow2, np.float32(2.0**hi))
    out = cut_scale(select(regular, pow2, np.float32(0)))
    memo_put(key, (scalar,), out)
    return out


def is_zero_constant(x) -> bool:
    """Whether `x` is a promoted constant known at trace time to be all zeros."""
    return isinstance(x, PromotedConstant) and x.zero


def factor_scale(x):
    """The scale `x` brings to a product (`mul`, `div`): its own, or ZERO_SCALE for a zero
    constant (a zero has any scale; at its partner's, `zeros_like(x) * x` would be a zero
    at x's scale squared, whose common scale flushes what it is added to next)."""
    return np.asarray(ZERO_SCALE, get_config().scale_dtype) if is_zero_constant(x) else x.scale


def promote_inputs(invals, scalars) -> list:
    """The operands of a scale rule: each unscaled float value promoted (`promote`, with the
    largest scale of the scaled operands for "any scale" constants), others kept as they are."""
    scaled = [x for x in invals if isinstance(x, ScaledArray)]
    ref = (lambda: reference_scale(scaled)) if scaled else (lambda: None)
    return [promote(x, s, ref) if not isinstance(x, ScaledArray) and is_float(x) else x
            for x, s in zip(invals, scalars)]


def _any_scale(ref, shape):
    """The scale given to an "any scale" value: the reference scale if it broadcasts."""
    sdtype = get_config().scale_dtype
    if ref is None:
        return np.ones((), sdtype)
    if np.ndim(ref) > 0 and not broadcasts_to(np.shape(ref), shape):
        ref = jnp.max(ref)
    return astype(ref, sdtype)


def as_plain_scaled(x):
    """A rule output as a plain ScaledArray (a promoted constant returned by a rule loses its
    placement: it is an ordinary scaled value from then on)."""
    if type(x) is PromotedConstant:
        return unchecked_scaled(x.data, x.scale)
    return x


def conform_constant(x: ScaledArray) -> ScaledArray:
    """A promoted constant expressed at its placement scale (for loop carries and branch
    outputs, where the constant becomes a value that later operands are placed next to):
    `finfo.min` as a running-max initial value stays at scale 1 instead of 2^127."""
    if not isinstance(x, PromotedConstant) or x.placement is None:
        return as_plain_scaled(x)
    cdt = compute_dtype(x.dtype)
    ratio = div(astype(x.scale, cdt), astype(x.placement, cdt))
    data = astype(mul(astype(x.data, cdt), ratio), x.dtype)
    return unchecked_scaled(data, x.placement)
