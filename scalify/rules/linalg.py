"""Scale rules of contractions: dot_general and conv_general_dilated.

Unit-scaling rule (Blake et al. 2023): a sum of K products of independent unit-variance
values has variance K, so

    out_scale = round_pow2(sa * sb * sqrt(K)),   out_data = dot(a.data, b.data) * (sa*sb/out_scale)

with K the product of the contracting dimension sizes (for a convolution: input channels
per group x window size). Because sa and sb are powers of two, round_pow2 commutes with
them: `out_scale = sa * sb * r` with the static power of two `r = round_pow2(sqrt(K))`, and
the data factor is the compile-time constant `1/r`. The data path is therefore exactly

    dot_general(a.data, b.data, <same params>) * (1/r)

one multiply of the dot's output by a constant, which XLA fuses into the dot's epilogue.
The output scale is clamped to float32's normal range [2^-126, 2^127] (`product_scale` with `times=r`):
operands at scales 2^-70 multiply to 2^-140, which float32 flushes to a zero scale. The
rest of the product then goes into the data, one multiply by a run-time power of two that
is 1 unless the product left the range (XLA fuses it into the output's consumers), so the
value is kept where plain float32 would flush it or overflow.

FP8: `scaled_dot_general` is the single place where the data
computation is written, and `_fp8_dot_data` is its FP8 path. The scales never touch the
data (they are in the ScaledArray scales), so with a wide output (bf16, f16, f32) the data
path is the raw FP8 dot times the constant 1/r, the raw `dot_general(e4m3, e4m3,
preferred_element_type=bf16)` that XLA turns into one `__cublas$lt$matmul$f8` call on
Hopper (the constant goes to the GEMM's alpha). An FP8 output is accumulated in float32,
multiplied by 1/r, clamped to the format's max (no NaN on E4M3 overflow) and converted,
the pattern cuBLASLt fuses as its output scale and saturation.
`benchmarks/fp8_gemm.py` checks both on the device (cases `const_out`, `raw`, `scalify`).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify.core import statistics
from scalify.core.config import get_config
from scalify.core.pow2 import clear_mantissa, np_pow2_round
from scalify.core.lax_utils import astype
from scalify.core.scale_flow import cut_scale, product_scale
from scalify.core.guards import rebalance_drift
from scalify.core.scaled_array import ScaledArray, has_float32_range
from scalify.core.registry import register_scale_rule
from scalify.quant.formats import is_fp8, saturating_cast
from scalify.rules.common import (
    align_scale,
    place_measured,
    scalar_of,
    scalar_scale,
    scale_ratio,
    times_factor,
)

__all__ = ["scaled_dot_general", "scaled_conv_general_dilated", "contraction_scale_factor"]


# -- helpers ------------------------------------------------------------------------------
def contraction_scale_factor(k: int) -> float:
    """`round_pow2(sqrt(K))`: the static growth factor of a sum of K unit-variance products
    (active ScalifyConfig rounding mode). K = 0 (empty contraction) gives 1."""
    return float(np_pow2_round(math.sqrt(max(int(k), 1))))


def _drift_guarded(out: ScaledArray, a_data, b_data) -> ScaledArray:
    """`out` through the drift guard (`ScalifyConfig.dot_drift_window`) when it is a float32
    contraction of float32 operands."""
    w = get_config().dot_drift_window
    f32 = np.dtype(np.float32)
    if w is None or out.dtype != f32 or a_data.dtype != f32 or b_data.dtype != f32:
        return out
    return rebalance_drift(out, w)


def _as_scaled(x) -> ScaledArray:
    if isinstance(x, ScaledArray):
        return x
    # Only reachable for non-float operands, which ScaledArray refuses: keep a (data, 1) pair.
    obj = object.__new__(ScaledArray)
    obj.data, obj.scale = x, jnp.ones((), get_config().scale_dtype)
    return obj


def _keep_only(x: ScaledArray, keep_dims) -> tuple[ScaledArray, jnp.ndarray]:
    """Make x's scale constant on every dim not in `keep_dims` (`align_scale`: the largest
    scale among non-zero elements, data rescaled, zeros kept). Returns (x, its scale at the
    data's rank). Zeros do not count: the stacked per-step gradients of a scan keep, on a
    step whose gradient is exactly zero (a masked time step), the scale the zero started
    with, and the largest scale of all would flush every other step of a float16
    contraction over time."""
    data, s = align_scale(x, [d for d in range(x.ndim) if d not in keep_dims])
    return (x if data is x.data else ScaledArray(data, s)), s


def _canonical_precision(precision):
    """`precision` as `lax.dot_general` binds it: None means the
    `jax_default_matmul_precision` setting (None where unset: the backend's default, TF32
    for float32 on NVIDIA GPUs), strings and single values become per-operand pairs.
    Binding `dot_general_p` with a raw None would skip that setting. A dot algorithm the
    default backend cannot compile (`F16_F16_F32` on CPU, which `jax.nn.dot_product_attention`
    asks for and drops where it fails) becomes None, as JAX's own fallback does."""
    if isinstance(precision, lax.DotAlgorithmPreset) and not _algorithm_compiles(precision, jax.default_backend()):
        precision = None
    try:
        from jax._src.lax.lax import canonicalize_precision  # internal; lax.dot_general's own
    except ImportError:  # pragma: no cover - a JAX without it: bind what was given
        return precision
    return canonicalize_precision(precision)


@functools.lru_cache(maxsize=None)
def _algorithm_compiles(preset, backend: str) -> bool:
    """Whether a dot with algorithm `preset` compiles on the default backend, `backend`
    (a 2x2 probe, once per preset and backend)."""
    dtype = (preset.supported_lhs_types or (jnp.float32,))[0]
    out = preset.accumulation_type or dtype
    x = jax.ShapeDtypeStruct((2, 2), dtype)

    def probe(a, b):
        return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=preset, preferred_element_type=out)

    try:
        jax.jit(probe).lower(x, x).compile()
    except Exception:  # noqa: BLE001 - any refusal means "not on this backend"
        return False
    return True


def _scale_data(out, r: float):
    """`out * (1/r)` in out's dtype: exact (a power of two), one fusible multiply."""
    if r == 1.0:
        return out
    return out * jnp.asarray(1.0 / r, out.dtype)


def _dot_data(a_data, b_data, r: float, factor=None, **params):
    """The data computation of a scaled dot: `dot_general(a, b) * (1/r)` (a constant: the
    GEMM's alpha), then times the range factor of `product_scale` (a traced power of two,
    1 unless the output scale left the scale range; skipped when None)."""
    if is_fp8(a_data.dtype) or is_fp8(b_data.dtype):
        out = _fp8_dot_data(a_data, b_data, r, **params)
    else:
        out = _scale_data(lax.dot_general_p.bind(a_data, b_data, **params), r)
    return times_factor(out, factor)


def _minor_contracting(x, batch, contracting, mode: str):
    """x transposed to (batch..., free..., contracting...) (cuBLASLt FP8's "TN" operand
    layout: contracting dims minor) and the new (batch, contracting) dim numbers."""
    free = tuple(d for d in range(x.ndim) if d not in batch and d not in contracting)
    perm = tuple(batch) + free + tuple(contracting)
    nb, nf = len(batch), len(free)
    dims = tuple(range(nb)), tuple(range(nb + nf, x.ndim))
    if mode == "none" or perm == tuple(range(x.ndim)):
        return x, (tuple(batch), tuple(contracting))
    xt = lax.transpose(x, perm)
    return (lax.optimization_barrier(xt) if mode == "barrier" else xt), dims


def fp8_operands_tn(a, b, dimension_numbers, mode: str | None = None):
    """FP8 operands with their contracting dims minor, and the matching dimension numbers.
    The dot's output is unchanged: batch, lhs free and rhs free dims keep their order.
    `mode`: "barrier", "transpose" or "none" (default: `ScalifyConfig.fp8_operand_layout`)."""
    mode = get_config().fp8_operand_layout if mode is None else mode
    (ca, cb), (ba, bb) = dimension_numbers
    a, (ba2, ca2) = _minor_contracting(a, ba, ca, mode)
    b, (bb2, cb2) = _minor_contracting(b, bb, cb, mode)
    return a, b, ((ca2, cb2), (ba2, bb2))


def _fp8_dot_data(a_data, b_data, r: float, **params):
    """FP8 data path. Operands are first laid out with their contracting dims minor (see
    `ScalifyConfig.fp8_operand_layout`). Wide output: the raw dot times the constant 1/r. FP8 output (e.g.
    `preferred_element_type=None` with FP8 operands): dot accumulated in float32, times
    1/r, saturating cast (clamp to +-max, round to nearest even) to the FP8 dtype."""
    if is_fp8(a_data.dtype) and is_fp8(b_data.dtype):
        a_data, b_data, dn = fp8_operands_tn(a_data, b_data, params["dimension_numbers"])
        params = {**params, "dimension_numbers": dn}
    out = jax.eval_shape(
        lambda u, v: lax.dot_general_p.bind(u, v, **params),
        jax.ShapeDtypeStruct(a_data.shape, a_data.dtype),
        jax.ShapeDtypeStruct(b_data.shape, b_data.dtype),
    )
    if not is_fp8(out.dtype):
        return _scale_data(lax.dot_general_p.bind(a_data, b_data, **params), r)
    acc = lax.dot_general_p.bind(a_data, b_data, **{**params, "preferred_element_type": jnp.dtype(jnp.float32)})
    return saturating_cast(_scale_data(acc, r), out.dtype)


def _output_dtype(a_data, b_data, params):
    """The dot's output dtype: `preferred_element_type`, else the operands' promoted dtype."""
    out = params.get("preferred_element_type")
    return jnp.dtype(out) if out is not None else jnp.result_type(a_data.dtype, b_data.dtype)


def _narrow_output(a_data, b_data, params) -> bool:
    """Whether the dot's output dtype has a narrower exponent range than float32 (float16;
    not bfloat16, not FP8): for FP8 operands always (their raw product overflows it), for
    others when `ScalifyConfig.narrow_dot_rescale`."""
    out = _output_dtype(a_data, b_data, params)
    if is_fp8(out) or not jnp.issubdtype(out, jnp.floating):
        return False
    if has_float32_range(out):
        return False
    fp8 = is_fp8(a_data.dtype) and is_fp8(b_data.dtype)
    return fp8 or get_config().narrow_dot_rescale


# log2 of the bound on a float16 dot output's data under "bound" placement: data <= 2^8
# leaves float16 2^8 of headroom (its max is 2^16) for the unit-scaling rules downstream
# (an add of two such outputs, a residual stream), as unit max-abs data leaves 2^16.
NARROW_DOT_TOP = 8


def _contracted_norm_max(x, contracting):
    """max over the free and batch dims of the L2 norm over the contracting dims, in
    float32 (one reduction pass over x; squares of float16 and FP8 values are exact)."""
    sq = jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(contracting))
    return jnp.sqrt(jnp.max(sq, initial=np.float32(0.0)))


def _narrow_factor_bound(a_data, b_data, r: float, params):
    """f = 2^(floor(log2 x) + 1) > x = max|a_i| max|b_j| / (r 2^NARROW_DOT_TOP), the L2 norms
    taken over the contracting dims (Cauchy-Schwarz: |sum_k a_ik b_kj| <= |a_i| |b_j|), so
    that |dot(a, b)| / (r f) < 2^NARROW_DOT_TOP for every output: the output cannot
    overflow, whatever the correlation of the operands. f = 1 for zero or non-finite norms."""
    (ca, cb), _ = params["dimension_numbers"]
    x = _contracted_norm_max(a_data, ca) * _contracted_norm_max(b_data, cb)
    x = x * np.float32(1.0 / (r * 2.0**NARROW_DOT_TOP))
    f = clear_mantissa(jnp.where(jnp.isfinite(x) & (x > 0), x, 0.5)) * np.float32(2.0)
    return lax.clamp(np.float32(2.0**-126), f, np.float32(2.0**126))


def _place_by_bound(a_data, b_data, params) -> bool:
    """`ScalifyConfig.narrow_dot_placement`: "bound", "measure", or "auto": "bound" when the
    output has more elements than the two operands together (its reductions read the
    operands, "measure"'s reads the output). Under delayed statistics
    (`scalify.core.statistics`), "measure": its decision comes from the previous step."""
    if statistics.active() is not None:
        return False
    mode = get_config().narrow_dot_placement
    if mode != "auto":
        return mode == "bound"
    (ca, _), (ba, _) = params["dimension_numbers"]
    k = int(np.prod([a_data.shape[d] for d in ca], dtype=np.int64))
    batch = int(np.prod([a_data.shape[d] for d in ba], dtype=np.int64))
    # output = batch x (a's free elements) x (b's free elements)
    out_size = (a_data.size // max(k, 1)) * (b_data.size // max(k * batch, 1))
    return out_size > a_data.size + b_data.size


def _dot_narrow_output(a_data, b_data, r: float, scale, **params) -> ScaledArray:
    """A float16 output from operands whose raw product may not fit it: the dot accumulates
    in float32 (FP8 operands: in `ScalifyConfig.narrow_dot_accumulator`), is divided by
    r f (f a power of two) in one multiply-and-cast pass and leaves in float16 with scale
    sa sb r f. The raw product of FP8 data (up to 448^2 * K) would overflow float16 before
    any static scale brings it back; for float16 operands the static scale drifts where
    operands are correlated. `ScalifyConfig.narrow_dot_placement` picks f:

    - "bound": f from the operands (`_narrow_factor_bound`): the L2 norms of a's rows and
      b's columns over the contracting dims bound every output, so data < 2^8 for any
      operands. One reduction over each operand (bytes of the inputs, not of the output).
    - "measure": f = 2^floor(log2 max|acc / r|) (one max-reduction over the accumulator):
      data at unit max-abs.

    `scale` = sa * sb is a float32 product: below float32's range it flushes to 0 and the
    data factor base / new_scale (computed on the bits, `scale_ratio`) is 0, the plain
    product's flush; new_scale is clamped to the range either way."""
    out_dtype = _output_dtype(a_data, b_data, params)
    base = jnp.asarray(scale, jnp.float32) * np.float32(r)
    acc_dtype = jnp.dtype(jnp.float32)
    if is_fp8(a_data.dtype) and is_fp8(b_data.dtype):  # bfloat16 by default
        acc_dtype = jnp.dtype(get_config().narrow_dot_accumulator)
    if _place_by_bound(a_data, b_data, params):
        f = cut_scale(_narrow_factor_bound(a_data, b_data, r, params))
        new_scale = lax.clamp(np.float32(2.0**-126), base * f, np.float32(2.0**127))
        # one multiply of the accumulator by a run-time power of two
        factor = scale_ratio(base, new_scale) * np.float32(1.0 / r)
        acc = _dot_data(a_data, b_data, 1.0, **{**params, "preferred_element_type": acc_dtype})
        data = (acc * factor.astype(acc_dtype)).astype(out_dtype)
        return ScaledArray(data, new_scale.astype(get_config().scale_dtype))
    acc = _dot_data(a_data, b_data, r, **{**params, "preferred_element_type": acc_dtype})
    return place_measured(acc, base, out_dtype)


# -- dot_general --------------------------------------------------------------------------
def scaled_dot_general(
    a,
    b,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
    **params,
) -> ScaledArray:
    """Scaled `lax.dot_general`: out_scale = sa * sb * round_pow2(sqrt(K)), clamped to
    float32's range [2^-126, 2^127] with the rest multiplied into the data (a float16
    output of the narrow placement below: flushed to 0 below the range, as plain float16).

    K is the product of the contracting dimension sizes. The data is
    `dot_general(a.data, b.data, same params) * (1/round_pow2(sqrt(K)))` in the output dtype
    (`preferred_element_type` if given, e.g. bf16 data with a float32 output).

    Non-scalar scales: a scale that varies along contracting dims is first made constant on
    them (its largest value, data rescaled); the remaining batch/free-dim scales of a and b
    are laid out like the output (batch dims, a's free dims, b's free dims) and multiplied:
    per-row x per-column scales give a per-element output scale, exactly.

    Args:
      a, b: ScaledArray operands (plain arrays are taken as scale 1).
      dimension_numbers, precision, preferred_element_type, out_sharding, **params: as
        `lax.dot_general`; passed through unchanged, except that `precision` is
        canonicalised as `lax.dot_general` does (None: `jax_default_matmul_precision`).
    Returns:
      ScaledArray of the dot's shape and dtype.
    """
    a, b = _as_scaled(a), _as_scaled(b)
    (ca, cb), (ba, bb) = dimension_numbers
    ca, cb, ba, bb = map(tuple, (ca, cb, ba, bb))
    r = contraction_scale_factor(np.prod([a.shape[d] for d in ca], dtype=np.int64))
    params = dict(
        dimension_numbers=dimension_numbers,
        precision=_canonical_precision(precision),
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
        **params,
    )
    sdtype = get_config().scale_dtype
    if scalar_scale(a) and scalar_scale(b):
        if _narrow_output(a.data, b.data, params):
            scale = scalar_of(a.scale) * scalar_of(b.scale)
            return _dot_narrow_output(a.data, b.data, r, scale, **params)
        scale, factor = product_scale(scalar_of(a.scale), scalar_of(b.scale), times=r)
        data = _dot_data(a.data, b.data, r, factor, **params)
        return _drift_guarded(ScaledArray(data, astype(scale, sdtype)), a.data, b.data)

    fa = tuple(d for d in range(a.ndim) if d not in ca and d not in ba)
    fb = tuple(d for d in range(b.ndim) if d not in cb and d not in bb)
    a, sa = _keep_only(a, ba + fa)
    b, sb = _keep_only(b, bb + fb)
    # Lay the scales out like the output: (batch..., a free..., b free...).
    sa = lax.transpose(sa, ba + fa + ca).reshape(
        [sa.shape[d] for d in ba + fa] + [1] * len(fb)
    )
    sb = lax.transpose(sb, bb + fb + cb).reshape(
        [sb.shape[d] for d in bb] + [1] * len(fa) + [sb.shape[d] for d in fb]
    )
    scale, factor = product_scale(sa, sb, times=r)
    scale = astype(scale, sdtype)
    if scale.size == 1:
        scale, factor = scale.reshape(()), jnp.reshape(factor, ())
    return ScaledArray(_dot_data(a.data, b.data, r, factor, **params), scale)


@register_scale_rule(lax.dot_general_p)
def _dot_general_rule(a: ScaledArray, b: ScaledArray, **params):
    """dot_general(a, b): scale sa*sb*round_pow2(sqrt(K)), K = prod(contracting sizes),
    clamped to float32's range (the rest times the data); data dot(a.data, b.data) /
    round_pow2(sqrt(K)). A float16 output of FP8 (or, with
    `narrow_dot_rescale`, float16) operands: times a power of two from the operands'
    Cauchy-Schwarz bound or the output's max (`ScalifyConfig.narrow_dot_placement`). See
    `scaled_dot_general`."""
    return scaled_dot_general(a, b, **params)


# -- conv_general_dilated -------------------------------------------------------------------
def _conv_specs(dimension_numbers, ndim):
    if dimension_numbers is None:
        default = tuple(range(ndim))
        return default, default, default
    return dimension_numbers.lhs_spec, dimension_numbers.rhs_spec, dimension_numbers.out_spec


def scaled_conv_general_dilated(lhs, rhs, **params) -> ScaledArray:
    """Scaled `lax.conv_general_dilated`: out_scale = sl * sr * round_pow2(sqrt(K)), clamped
    to float32's range like `scaled_dot_general`'s.

    K = (input channels per feature group) x (kernel window size) = the number of kernel
    elements per output feature: `rhs.size / rhs.shape[out_feature_dim]` (also right with
    `feature_group_count` and `batch_group_count`). Borders with padding sum fewer terms;
    the rule uses the interior count, as unit scaling does. Data: conv of the data (same
    params) times the constant 1/round_pow2(sqrt(K)).

    Non-scalar scales are kept along lhs's batch dim (when `batch_group_count == 1`) and
    rhs's output-feature dim (per-channel weight scales), made constant on the other dims
    (largest value, data rescaled), and laid out on the output's batch/feature dims.
    """
    lhs, rhs = _as_scaled(lhs), _as_scaled(rhs)
    lhs_spec, rhs_spec, out_spec = _conv_specs(params.get("dimension_numbers"), lhs.ndim)
    k = int(np.prod(rhs.shape, dtype=np.int64)) // max(rhs.shape[rhs_spec[0]], 1)
    r = contraction_scale_factor(k)
    sdtype = get_config().scale_dtype
    if scalar_scale(lhs) and scalar_scale(rhs):
        scale, factor = product_scale(scalar_of(lhs.scale), scalar_of(rhs.scale), times=r)
        data = times_factor(_scale_data(lax.conv_general_dilated_p.bind(lhs.data, rhs.data, **params), r), factor)
        return _drift_guarded(ScaledArray(data, astype(scale, sdtype)), lhs.data, rhs.data)

    keep_batch = params.get("batch_group_count", 1) == 1
    lhs, sl = _keep_only(lhs, (lhs_spec[0],) if keep_batch else ())
    rhs, sr = _keep_only(rhs, (rhs_spec[0],))
    out_ndim = lhs.ndim
    shape_l, shape_r = [1] * out_ndim, [1] * out_ndim
    shape_l[out_spec[0]] = sl.shape[lhs_spec[0]]
    shape_r[out_spec[1]] = sr.shape[rhs_spec[0]]
    scale, factor = product_scale(sl.reshape(shape_l), sr.reshape(shape_r), times=r)
    scale = astype(scale, sdtype)
    if scale.size == 1:
        scale, factor = scale.reshape(()), jnp.reshape(factor, ())
    data = times_factor(_scale_data(lax.conv_general_dilated_p.bind(lhs.data, rhs.data, **params), r), factor)
    return ScaledArray(data, scale)


@register_scale_rule(lax.conv_general_dilated_p)
def _conv_general_dilated_rule(lhs: ScaledArray, rhs: ScaledArray, **params):
    """conv_general_dilated(lhs, rhs): like dot_general with K = in-channels per group x
    window size (scale clamped to float32's range, the rest times the data). See `scaled_conv_general_dilated`."""
    return scaled_conv_general_dilated(lhs, rhs, **params)
