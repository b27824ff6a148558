"""Scale rules of elementwise primitives.

Unit-scaling assumption (Blake et al. 2023): inputs are independent with unit-variance
data, so a rule picks the output scale that keeps the output data near unit variance.
Every output scale is a power of two: either exact scale arithmetic (mul, sqrt,
integer_pow, ...) or rounded with `round_scale` (ScalifyConfig rounding mode).

With float32 data and power-of-two scales every rule here gives the value plain JAX gives
(model invariance): multiplying by a power of two commutes with IEEE rounding, so rules
either work on data at a common scale or on the materialised value in float32 or wider.
Functions with a bounded or unscaled output (exp, tanh, erf, ...) and comparisons output
scale 1 / plain arrays. Special values (0, inf, nan, -inf masks) pass through data as they
would in plain JAX; their scale never makes a NaN.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.extend.core import primitives as jprims

from scalify.core.config import Pow2RoundMode, get_config
from scalify.core.lax_utils import arr, astype, clip, is_static, maximum, mul, select
from scalify.core.registry import register_scale_rule
from scalify.core.scaled_array import ScaledArray, compute_dtype, is_concrete
from scalify.core.scale_flow import (
    cut_data, derive_max_abs, exact_in, factor_scale, exp2_int, known_max_abs, note_exact_in,
    note_max_abs, note_transpose, pass_max_abs, product_scale, scale_exponent, transpose_of,
    scale_exponent_range as _scale_exponent_range, scale_from_exponent,
)
from scalify.core import statistics
from scalify.core.guards import rebalance_drift
from scalify.quant.formats import saturating_cast
from scalify.rules.common import (
    is_one,
    named_rule,
    out_shape,
    rescale,
    times_factor,
    to_common,
    materialize,
    narrow_range,
    pow2_floor_of_max,
    place_measured,
    round_scale,
    unit_scale_like,
    with_scale,
)

# ---------------------------------------------------------------------------------------
# Additive
# ---------------------------------------------------------------------------------------
def _make_additive(prim):
    def rule(a: ScaledArray, b: ScaledArray, **params):
        sa, sb = arr(a.scale), arr(b.scale)
        hi = maximum(sa, sb)
        mode = get_config().rounding_mode
        # sa, sb are powers of two, so hi*sqrt(1+(lo/hi)^2) lies in [hi, sqrt(2)*hi] and
        # reaches sqrt(2)*hi only when lo == hi: rounding down gives hi, rounding to nearest
        # gives 2*hi exactly when the scales are equal (closed forms, no rounding ops).
        if mode is Pow2RoundMode.DOWN:
            scale = sa if sa is sb else hi  # x + 0: the zero takes x's scale
        elif mode is Pow2RoundMode.NEAREST:
            scale = select(sa == sb, hi * 2, hi)
        else:
            lo = jnp.minimum(sa, sb)
            scale = round_scale(hi * jnp.sqrt(1 + (lo / hi) ** 2))
        shape = out_shape([a, b])
        # Rescale and add in float32 (or wider), cast once: the smaller-scale operand must
        # not underflow in FP8/FP16 before it is added.
        cdt = compute_dtype(a.dtype)
        # scale >= sa, sb in every rounding mode
        da, db = rescale(a, scale, shape, cdt, down=True), rescale(b, scale, shape, cdt, down=True)
        # Computed once, not in every consumer fusion (see cut_data).
        out = cut_data(prim.bind(da, db, **params), a.dtype, seed=scale)
        return with_scale(out.astype(a.dtype), scale)

    doc = (
        f"{prim.name}(a, b): scale s = sqrt(sa^2 + sb^2), computed as max*sqrt(1+(min/max)^2) "
        "(the std of a sum of independent unit-variance terms) and rounded to a power of two; "
        f"data = {prim.name}(a.data*(sa/s), b.data*(sb/s)) in float32 or wider, cast once."
    )
    return named_rule(prim, rule, doc)


for _p in (lax.add_p, lax.sub_p, jprims.add_jaxvals_p):
    register_scale_rule(_p)(_make_additive(_p))


# ---------------------------------------------------------------------------------------
# Multiplicative
# ---------------------------------------------------------------------------------------
def _unbounded_product(a: ScaledArray, b: ScaledArray) -> bool:
    """Whether `a * b` (or `a / b`) has narrow-range data (float16, FP8) that no rule can
    bound: both operands are tensors (a product of two activations, a gate, their
    backward), so the data of the result can be as large as the product of their maxima.
    A product with a scalar is bounded by the tensor's own data."""
    return narrow_range(a.dtype) and np.size(a.data) > 1 and np.size(b.data) > 1


def _placed_product(a, b, scale, factor, op) -> ScaledArray:
    """op(a.data, b.data) computed in float32, times the range factor, placed at unit
    max-abs data in the operands' dtype (`place_measured`): never an overflow or a flush
    where float32 holds the value."""
    acc = times_factor(op(a.data.astype(jnp.float32), b.data.astype(jnp.float32)), factor)
    return place_measured(acc, scale, a.dtype)


def _abs0(c):
    """|c| of a one-element array, 0-d."""
    return lax.abs(jnp.reshape(arr(c), ()))


def _gated_product(x: ScaledArray, gate: ScaledArray, bound: float) -> ScaledArray:
    """x * gate with |gate| <= bound (a static power of two): scale sx * bound, data
    x.data * (gate / bound) computed in float32, |data| <= |x.data|: no overflow, no
    measurement."""
    g = gate.data.astype(jnp.float32) * (astype(gate.scale, jnp.float32) / np.float32(bound))
    scale, factor = product_scale(factor_scale(x), astype(np.float32(bound), get_config().scale_dtype))
    return with_scale(times_factor((x.data.astype(jnp.float32) * g).astype(x.dtype), factor), scale)


@register_scale_rule(lax.mul_p, value_bounds=True)
def _mul_rule(a: ScaledArray, b: ScaledArray, value_bounds=(None, None), **params):
    """a * b: scale sa*sb (exact; clamped to the scale range, the rest multiplied into the
    data); data a.data * b.data. Two float16 or FP8 tensors: if one of them has a static
    bound |gate| <= B (a bounded function such as GELU's or SiLU's gate), the product is
    placed at the other's scale times B (`_gated_product`); otherwise it is computed in
    float32 and placed at unit max-abs data (scale sa*sb*2^floor(log2 max|a.data*b.data|)).
    `x * x` is a square: the drift guard of powers applies
    (`ScalifyConfig.power_drift_window`)."""
    if a is b:
        a = b = rebalance_drift(a, get_config().power_drift_window)
    if _unbounded_product(a, b):
        bound_a, bound_b = value_bounds
        if bound_b:
            return _gated_product(a, b, bound_b)
        if bound_a:
            return _gated_product(b, a, bound_a)
    scale, factor = product_scale(factor_scale(a), factor_scale(b))
    if _unbounded_product(a, b):
        return _placed_product(a, b, scale, factor, lax.mul)
    data = lax.mul_p.bind(a.data, b.data, **params)
    for x, c in ((a, b), (b, a)):  # times a scalar c: max |d c| = max |d| |c| (monotone rounding)
        if np.size(c.data) == 1 and np.size(x.data) > 1:  # |c| made only if a guard reads it
            pass_max_abs(data, x.data, lambda m, c=c: astype(lax.mul(astype(m, data.dtype), _abs0(c.data)), np.float32))
    return with_scale(times_factor(data, factor), scale)


@register_scale_rule(lax.div_p)
def _div_rule(a: ScaledArray, b: ScaledArray, **params):
    """a / b: scale sa/sb (exact; clamped like mul's); data a.data / b.data (x/0 = inf,
    0/0 = nan as in JAX). Two float16 or FP8 tensors: computed in float32 and placed at
    unit max-abs data, as mul."""
    scale, factor = product_scale(factor_scale(a), b.scale, divide=True)
    if _unbounded_product(a, b):
        return _placed_product(a, b, scale, factor, lax.div)
    data = lax.div_p.bind(a.data, b.data, **params)
    if np.size(b.data) == 1 and np.size(a.data) > 1:  # max |d / c| = max |d| / |c|
        pass_max_abs(data, a.data, lambda m: astype(lax.div(astype(m, data.dtype), _abs0(b.data)), np.float32))
    return with_scale(times_factor(data, factor), scale)


# ---------------------------------------------------------------------------------------
# Same scale: sign, magnitude, precision
# ---------------------------------------------------------------------------------------
def _make_same_scale(prim):
    def rule(x: ScaledArray, **params):
        data = prim.bind(x.data, **params)
        pass_max_abs(data, x.data)  # |-d| = ||d|| = |d|
        return ScaledArray(data, x.scale)

    doc = f"{prim.name}(x): scale unchanged; data {prim.name}(x.data)."
    return named_rule(prim, rule, doc)


for _p in (lax.neg_p, lax.abs_p):  # copy is in structural.py
    register_scale_rule(_p)(_make_same_scale(_p))


@register_scale_rule(lax.reduce_precision_p)
def _reduce_precision_rule(x: ScaledArray, **params):
    """reduce_precision(x): applied to data, scale unchanged.

    Mantissa rounding commutes with the power-of-two scale, so it is exactly the plain op;
    the exponent range is that of the data, i.e. the scale extends it (a value that plain
    reduce_precision would flush or saturate is kept when data is in range)."""
    return ScaledArray(lax.reduce_precision_p.bind(x.data, **params), x.scale)


@register_scale_rule(lax.stop_gradient_p)
def _stop_gradient_rule(x: ScaledArray, **params):
    """stop_gradient(x): scale unchanged; stop_gradient on both data and scale."""
    return ScaledArray(
        lax.stop_gradient_p.bind(x.data, **params), lax.stop_gradient_p.bind(jnp.asarray(x.scale))
    )


@register_scale_rule(lax.sign_p)
def _sign_rule(x: ScaledArray, **params):
    """sign(x): scale 1; data sign(x.data) (the scale is positive)."""
    return unit_scale_like(lax.sign_p.bind(x.data, **params))


@register_scale_rule(lax.is_finite_p)
def _is_finite_rule(x: ScaledArray, **params):
    """is_finite(x): on data (a finite scale never changes finiteness); unscaled bool."""
    return lax.is_finite_p.bind(x.data, **params)


# ---------------------------------------------------------------------------------------
# Largest input scale: max, min, select_n, clamp, rem, nextafter
# ---------------------------------------------------------------------------------------
def _make_common_scale(prim):
    def rule(*xs, **params):
        datas, scale = to_common(xs)
        out = prim.bind(*datas, **params)
        if prim is lax.select_n_p and np.ndim(datas[0]) == 0:  # one case for the whole array
            pred = arr(datas[0])
            derive_max_abs(out, datas[1:], lambda *ms: lax.select_n(pred, *ms))
        return with_scale(out, scale)

    doc = (
        f"{prim.name}: scale = largest input scale S; each input's data rescaled to S "
        "(exact power-of-two ratio); integer/bool operands (select_n's predicate) unchanged."
    )
    return named_rule(prim, rule, doc)


for _p in (lax.max_p, lax.min_p, lax.select_n_p, lax.clamp_p):
    register_scale_rule(_p)(_make_common_scale(_p))


@register_scale_rule(lax.rem_p)
def _rem_rule(a: ScaledArray, b: ScaledArray, **params):
    """rem(a, b): rem(a/S, b/S) * S = rem(a, b) exactly for a power of two S; S = largest
    input scale."""
    (da, db), scale = to_common([a, b])
    return with_scale(lax.rem_p.bind(da, db, **params), scale)


@register_scale_rule(lax.nextafter_p)
def _nextafter_rule(a: ScaledArray, b: ScaledArray, **params):
    """nextafter(a, b) on data at the largest scale S: the float grid scales with S, so it is
    the plain op's result (in the data's dtype) unless data are subnormal."""
    (da, db), scale = to_common([a, b])
    return with_scale(lax.nextafter_p.bind(da, db, **params), scale)


# ---------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------
def _make_compare(prim):
    def rule(a, b, **params):
        # At least float32: rescaling the smaller-scale operand must not underflow to a
        # tie, and never materialise data*scale (that can overflow).
        dtype = compute_dtype(jnp.result_type(a.data if isinstance(a, ScaledArray) else a))
        (da, db), _ = to_common([a, b], dtype)
        return prim.bind(da, db, **params)

    doc = (
        f"{prim.name}(a, b): bool output; both data rescaled to the largest scale (in at "
        "least float32) and compared; positive power-of-two scaling preserves order."
    )
    return named_rule(prim, rule, doc)


for _p in (
    lax.eq_p,
    lax.ne_p,
    lax.lt_p,
    lax.le_p,
    lax.gt_p,
    lax.ge_p,
    lax.eq_to_p,
    lax.le_to_p,
    lax.lt_to_p,
):
    register_scale_rule(_p)(_make_compare(_p))


# ---------------------------------------------------------------------------------------
# Powers and roots: exact scale arithmetic on exponents
# ---------------------------------------------------------------------------------------
def _make_root(prim, n: int, sign: int):
    def rule(x: ScaledArray, **params):
        if n == 2 and not is_static(x.scale):
            return _sqrt_on_bits(prim, sign, x, **params)
        e = scale_exponent(x.scale)
        if is_static(e):
            k = np.floor_divide(e, np.int32(n))
            r, sk = e - np.int32(n) * k, np.int32(sign) * k
        else:
            # floor(e / 2) is an arithmetic shift; jnp.floor_divide emits a dozen ops.
            k = lax.shift_right_arithmetic(e, np.int32(1)) if n == 2 else jnp.floor_divide(e, n)
            r = lax.sub(e, lax.mul(k, np.int32(n)))  # in {0, .., n-1}
            sk = k if sign > 0 else lax.neg(k)
        cdt = compute_dtype(x.dtype)
        data = astype(x.data, cdt)
        factor = exp2_int(r, cdt, in_range=True)
        if not is_one(factor):
            data = mul(data, factor)
        out = astype(prim.bind(data, **params), x.dtype)
        return with_scale(out, exp2_int(sk, get_config().scale_dtype))

    doc = (
        f"{prim.name}(x): with s = 2^({n}k + r), r in [0, {n}): "
        f"{prim.name}(d*s) = {prim.name}(d*2^r) * 2^({'-' if sign < 0 else ''}k). "
        "Exact output scale; data computed in float32 or wider (the 2^r factor is exact)."
    )
    return named_rule(prim, rule, doc)


def _sqrt_on_bits(prim, sign: int, x: ScaledArray, **params):
    """sqrt / rsqrt of x with a traced scale s = 2^e, on the float32 bits of s: with
    k = floor(e / 2) and r = e - 2k, bits(2^k) = ((bits(s) + (127 << 23)) >> 1) & 0x7F800000
    (the biased exponent (e + 127 + 127) / 2 rounded down), bits(2^-k) = (254 << 23) -
    bits(2^k) and bits(2^r) = bits(s) - 2 bits(2^k) + (254 << 23), in uint32 (wrapping).
    k lies in [-63, 63] and r in {0, 1}: every value is a normal float32."""
    u32 = np.uint32
    bits = lax.bitcast_convert_type(astype(x.scale, jnp.float32), jnp.uint32)
    half = lax.bitwise_and(lax.shift_right_logical(lax.add(bits, u32(127 << 23)), u32(1)), u32(0x7F800000))
    out_bits = half if sign > 0 else lax.sub(u32(254 << 23), half)
    factor = lax.bitcast_convert_type(lax.add(lax.sub(bits, lax.shift_left(half, u32(1))), u32(254 << 23)), jnp.float32)
    cdt = compute_dtype(x.dtype)
    data = mul(astype(x.data, cdt), astype(factor, cdt))
    out = astype(prim.bind(data, **params), x.dtype)
    return with_scale(out, lax.bitcast_convert_type(out_bits, jnp.float32))


register_scale_rule(lax.sqrt_p)(_make_root(lax.sqrt_p, 2, 1))
register_scale_rule(lax.rsqrt_p)(_make_root(lax.rsqrt_p, 2, -1))
register_scale_rule(lax.cbrt_p)(_make_root(lax.cbrt_p, 3, 1))


# A cube or higher power of float16 data is placed with its largest element at about
# 2^POWER_TOP rather than 1 (see `_spread_power_input`).
POWER_TOP = 8


def _spread_power_input(x: ScaledArray, y: int) -> ScaledArray:
    """x at the same value with its largest data at 2^floor(POWER_TOP / y), when that
    maximum is known (the drift guard measured it): x^y then has its largest data near
    2^POWER_TOP, and the elements far below the largest keep normal float16 data.

    At unit scale the cube of data spanning 10 binades spans 30, and its small elements
    fall into float16's subnormals (or to zero); a sum with the cube then flushes the
    other operand at the cube's scale (the tanh GELU's `x + 0.044715 * x**3`). 2^8 leaves
    2^7 of headroom above for the sums that follow."""
    m = known_max_abs(x.data)
    if m is None or y < 3 or not narrow_range(x.dtype) or np.size(x.data) <= 1:
        return x
    # a power of two: the move is exact
    ratio = np.float32(2.0 ** (POWER_TOP // y)) / pow2_floor_of_max(jnp.asarray(m, jnp.float32))
    data = (x.data.astype(jnp.float32) * ratio).astype(x.dtype)
    scale = jnp.asarray(x.scale, jnp.float32) / ratio
    return with_scale(data, astype(scale, get_config().scale_dtype))


def _int_power(x: ScaledArray, y: int, compute):
    """x^y for an integer y: scale s^y = 2^(e*y) exact; data d^y (in float32 or wider), after
    the drift guard on x (`ScalifyConfig.power_drift_window`); a cube or higher power of
    float16 or FP8 data spreads its input first (`_spread_power_input`)."""
    x = _spread_power_input(rebalance_drift(x, get_config().power_drift_window, y), y)
    cdt = compute_dtype(x.dtype)
    data = compute(astype(x.data, cdt))
    if 1 <= y <= 4 and cdt == np.float32:  # float scale chains (see product_scale)
        scale, factors = _power_scale(x.scale, y)
    else:
        e = scale_exponent(x.scale)
        scale, factor = scale_from_exponent(e * np.int32(y) if is_static(e) else lax.mul(e, np.int32(y)), cdt)
        factors = [factor]
    for factor in factors:
        if not is_one(factor):
            data = mul(data, factor)
    return with_scale(astype(data, x.dtype), scale)


def _power_scale(s, y: int):
    """(scale, factors) of s^y for a small y >= 1 by products (`product_scale`):
    s^y = s^(y-1) * s, two float operations per step on the scale. The data is multiplied
    by each step's range factor in turn (their product could overflow to inf where a data
    value is 0); the factors all lie on the same side of 1 (that of s), so an overflow of
    the value overflows the data as the plain value would."""
    scale, factors = s, []
    for _ in range(y - 1):
        scale, factor = product_scale(scale, s)
        factors.append(factor)
    return scale, factors


@register_scale_rule(lax.integer_pow_p)
def _integer_pow_rule(x: ScaledArray, *, y, **params):
    """integer_pow(x, y): scale s^y = 2^(e*y) (exact); data d^y, computed in float32 or wider.

    Where 2^(e*y) would over/underflow the scale dtype, the scale is clipped and the rest
    multiplied into data (what materialising would give). y = 1 is x itself (no guard: the
    data are not raised to a power)."""
    if y == 1:
        return x
    return _int_power(x, y, lambda d: lax.integer_pow_p.bind(d, y=y, **params))


@register_scale_rule(lax.square_p)
def _square_rule(x: ScaledArray, **params):
    """square(x): scale s^2 (exact, clipped like integer_pow); data d^2."""
    return _int_power(x, 2, lambda d: lax.square_p.bind(d, **params))


def _uniform_value(y):
    """The single value of a concrete array whose elements are all equal (else None)."""
    if not is_concrete(y):
        return None
    arr = np.asarray(y)
    if arr.size == 0:
        return None
    v = arr.reshape(-1)[0]
    return float(v) if np.isfinite(v) and np.all(arr == v) else None


@register_scale_rule(lax.pow_p)
def _pow_rule(x: ScaledArray, y, **params):
    """pow(x, y): computed on the materialised values in float32 or wider (bit-identical to
    plain JAX in float32).

    Output scale: when y is one value c (a scalar operand such as the literal of `x ** 2.5`,
    or a concrete uniform array), s' = 2^floor(e*c) ~ s^c keeps data in range and data =
    x^c / s' (an exact division); otherwise the output has scale 1."""
    m = materialize(x)
    yv = materialize(y) if isinstance(y, ScaledArray) else jnp.asarray(y)
    out = lax.pow_p.bind(m, yv, **params)
    if np.size(yv) == 1:
        c = jnp.reshape(yv, ()).astype(jnp.float32)
    else:
        c = _uniform_value(yv)
        if c is None:
            return unit_scale_like(out.astype(x.dtype))
    lo, hi = _scale_exponent_range()
    t = scale_exponent(x.scale).astype(jnp.float32) * c
    # t <= 126: XLA turns the division by 2^t into a product with 2^-t, which is 0 (a
    # flushed subnormal) for t = 127, and an overflowed inf times 0 is NaN
    t = clip(select(jnp.isfinite(t), jnp.floor(t), 0.0), lo, min(hi, 126)).astype(jnp.int32)
    scale = exp2_int(t, get_config().scale_dtype)
    return with_scale((out / exp2_int(t, out.dtype)).astype(x.dtype), scale)


# ---------------------------------------------------------------------------------------
# Unscaled-output functions: computed on the materialised value
# ---------------------------------------------------------------------------------------
def make_unscaled_rule(prim):
    def rule(*xs, **params):
        args = [materialize(x) if isinstance(x, ScaledArray) else x for x in xs]
        out = prim.bind(*args, **params)
        dtype = next(x.dtype for x in xs if isinstance(x, ScaledArray))
        return unit_scale_like(out.astype(dtype))

    doc = (
        f"{prim.name}: computed on the materialised value (data*scale in float32 or wider); "
        "output scale 1 (bounded or unscaled output)."
    )
    return named_rule(prim, rule, doc)


_UNSCALED = [
    "exp", "exp2", "log1p", "expm1", "tanh", "logistic", "erf", "erfc", "erf_inv",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh",
    "lgamma", "digamma", "bessel_i0e", "bessel_i1e", "igamma", "igammac", "igamma_grad_a",
    "polygamma", "zeta", "regularized_incomplete_beta",
    "one_minus_square",  # 1 - x^2 (jax >= 0.11: tanh's derivative)
]  # fmt: skip
for _name in _UNSCALED:
    _p = getattr(lax, f"{_name}_p", None) or getattr(jprims, f"{_name}_p", None)
    if _p is not None:  # some are missing in older/newer JAX versions
        register_scale_rule(_p)(make_unscaled_rule(_p))


@register_scale_rule(lax.log_p)
def _log_rule(x: ScaledArray, **params):
    """log(x): scale 1; log(d*s) in float32 or wider, and log(d) + log2(s)*ln2 where d*s is
    not a normal float there (underflow to 0/subnormal, or overflow), which keeps e.g.
    float32 data at scale 2^-120 accurate. Equal to plain JAX wherever plain JAX is exact;
    log(0) = -inf, log(<0) = nan as usual."""
    cdt = compute_dtype(x.dtype)
    m = materialize(x)
    direct = lax.log_p.bind(m, **params)
    tiny = jnp.finfo(cdt).tiny
    normal = (jnp.abs(m) >= tiny) & jnp.isfinite(m)
    split = lax.log_p.bind(x.data.astype(cdt), **params) + scale_exponent(x.scale).astype(
        cdt
    ) * np.asarray(math.log(2.0), cdt)
    return unit_scale_like(select(normal, direct, split).astype(x.dtype))


@register_scale_rule(lax.atan2_p)
def _atan2_rule(a: ScaledArray, b: ScaledArray, **params):
    """atan2(a, b): scale-invariant, so computed on data at the common (largest) scale in
    float32 or wider, never materialising; output scale 1."""
    dtype = compute_dtype(a.dtype)
    (da, db), _ = to_common([a, b], dtype)
    return unit_scale_like(lax.atan2_p.bind(da, db, **params).astype(a.dtype))


# ---------------------------------------------------------------------------------------
# Rounding to integers
# ---------------------------------------------------------------------------------------
def _make_rounding(prim):
    def rule(x: ScaledArray, **params):
        cdt = compute_dtype(x.dtype)
        s = jnp.asarray(x.scale).astype(cdt)
        d = x.data.astype(cdt)
        m = d * s  # may overflow to inf: then `integral` selects the other branch
        out_scale = jnp.maximum(s, 1)
        nmant = jnp.finfo(x.dtype).nmant
        integral = ~(jnp.abs(m) < 2.0**nmant)  # already an integer (or inf/nan)
        data = select(integral, d * jnp.minimum(s, 1), prim.bind(m, **params) / out_scale)
        return with_scale(data.astype(x.dtype), out_scale)

    doc = (
        f"{prim.name}(x): on the materialised value m = d*s in float32 or wider; output "
        f"scale max(s, 1), data {prim.name}(m)/max(s, 1). The integer {prim.name}(m) has no "
        "more significant bits than d, so the data is exact in its dtype (no overflow of "
        "float16 data at large scales); |m| >= 2^nmant is already integral and kept as is."
    )
    return named_rule(prim, rule, doc)


for _p in (lax.floor_p, lax.ceil_p, lax.round_p):
    register_scale_rule(_p)(_make_rounding(_p))


# ---------------------------------------------------------------------------------------
# Conversions
# ---------------------------------------------------------------------------------------
def _cast_window(src, dst) -> tuple[int, int] | None:
    """The drift window (lo, hi) (`ScalifyConfig.cast_drift_window`) of a float
    conversion: float16 targets from a dtype of wider exponent range, data max-abs below
    2^-lo (4 by default) or at least 2^16 (beyond float16's max); None (no guard)
    otherwise. Data placed near float16's max on purpose (a quantiser's top binade) stay."""
    w = get_config().cast_drift_window
    if w is None or jnp.dtype(dst) != jnp.float16:
        return None
    if jnp.finfo(src).maxexp <= jnp.finfo(jnp.float16).maxexp:
        return None
    return (4 if w == "auto" else w, 15)


def _values_fit(src, dst) -> bool:
    """Every value of float dtype `src` is a value of `dst` (no rounding, no overflow)."""
    a, b = ml_dtypes.finfo(src), ml_dtypes.finfo(dst)
    return (a.maxexp <= b.maxexp and a.nmant <= b.nmant
            and float(a.smallest_subnormal) >= float(b.smallest_subnormal))


@register_scale_rule(lax.convert_element_type_p)
def _convert_element_type_rule(x: ScaledArray, *, new_dtype, **params):
    """convert(x): float -> float keeps the scale and converts data (this is how data
    becomes FP8/FP16; to float16 from float32/bfloat16, data whose max-abs is below 2^-4
    or beyond float16's range first go to unit max-abs: `ScalifyConfig.cast_drift_window`;
    under delayed statistics that guard places from the previous record, and values beyond
    the target's range, inf too, saturate at its largest value); float -> int/bool
    materialises first (the output is unscaled)."""
    if jnp.issubdtype(new_dtype, jnp.floating):
        narrow = exact_in(x.data) or x.dtype
        saturate = False
        if not _values_fit(narrow, new_dtype):  # values from float16 go back unguarded
            x = rebalance_drift(x, _cast_window(x.dtype, new_dtype))
            # Under delayed statistics the guard placed the data from the previous step's
            # record (none at the first step): data beyond new_dtype's range saturate.
            saturate = statistics.active() is not None
        if saturate:
            data = saturating_cast(x.data, new_dtype, inf_saturates=True)
        else:
            data = lax.convert_element_type_p.bind(x.data, new_dtype=new_dtype, **params)
        m = known_max_abs(x.data)
        if m is not None:  # rounding is monotonic: the largest element rounds to the maximum
            note_max_abs(data, astype(astype(m, new_dtype), np.float32))
        if _values_fit(narrow, new_dtype):
            note_exact_in(data, narrow)
            if (src := transpose_of(x.data)) is not None:  # the same values, transposed
                note_transpose(data, src)
        return ScaledArray(data, x.scale)
    return lax.convert_element_type_p.bind(materialize(x), new_dtype=new_dtype, **params)


# ---------------------------------------------------------------------------------------
# Complex numbers: complex data is not scaled
# ---------------------------------------------------------------------------------------
@register_scale_rule(lax.complex_p)
def _complex_rule(a: ScaledArray, b: ScaledArray, **params):
    """complex(a, b) = a + i b, returned as a plain (unscaled) complex array.

    ScaledArray data is real floating point, so complex values are not scaled: each input
    is materialised in its own dtype, `a.data * a.scale` (computed in float32 or wider, one
    rounding), and the primitive is bound on the values. With float32 data and power-of-two
    scales this is exactly plain JAX's result. `real`, `imag`, `abs`, ... of the complex
    result then run as in plain JAX (no scaled input).
    """
    return lax.complex_p.bind(materialize(a, a.dtype), materialize(b, b.dtype), **params)


@register_scale_rule(lax.conj_p)
def _conj_rule(x: ScaledArray, **params):
    """conj(x) of a real scaled x: the complex value x + 0i (plain, complex data is not
    scaled), bound on the materialised value `x.data * x.scale` as plain JAX would."""
    return lax.conj_p.bind(materialize(x, x.dtype), **params)
