"""FP8 matmuls: per-tensor scaling policies, the scaled FP8 `dot_general` and its data path.

A low-precision matmul `out = lhs @ rhs` (any `dot_general`) runs as

    forward:   q_l, s_l = quantize(lhs, E4M3)      q_r, s_r = quantize(rhs, E4M3)
               out      = dot(q_l, q_r) * (s_l * s_r)                    in bf16 / f32
    backward:  q_g, s_g = quantize(g, E5M2)
               d_lhs    = dot(q_g, q_r^T) * (s_g * s_r)    (E5M2 x E4M3)
               d_rhs    = dot(q_l^T, q_g) * (s_l * s_g)    (E4M3 x E5M2)

with `quantize(x) = saturating_cast(x / s)` and a power-of-two `s` chosen by the policy:

- `"jit"` (`JitScaling(margin)`): just-in-time per-tensor amax, the recipe of Perez et al.
  2023, "Training and inference of large language models using 8-bit floating point":
  `s = 2^margin / 2^floor(log2(fp8_max / amax(x)))`, so `amax(x)/s <= fp8_max / 2^margin`.
- `"delayed"` (`DelayedScaling(history_length, margin)`): the same formula on the largest
  amax of the previous steps (TransformerEngine's delayed scaling), kept in a Flax variable
  collection by `scalify.nn.Dense`; the current amax is recorded for the next step. An
  all-zero history (the first step) falls back to the current amax.
- `"static"` (`StaticScaling()`): no statistics. Inside `scalify` the tensor keeps the scale
  that scalify propagated (plus whatever sparse `dynamic_rescale_*` the model applies) and
  only its data is cast; outside `scalify` this is a plain saturating cast (scale 1).

Inside `scalify` every scale lives in the ScaledArray's scale ("scale land"): the data path
of the matmul is the raw FP8 `dot_general` (see `scalify.rules.linalg.scaled_dot_general`),
times at most a compile-time power of two, which is the pattern XLA turns into one
`__cublas$lt$matmul$f8` custom call. Outside `scalify` the per-tensor scales are runtime
values and the data path is `dot_scaled_tn` (the raw FP8 dot times the product of the
scales); `benchmarks/fp8_gemm.py` compares it with other candidates on Hopper
(`benchmarks/fp8_patterns.py`, passed as `pattern=`).

The pieces are primitives with scale rules, so one jaxpr serves both worlds:
`amax_p` (max |x| as a plain float32 value), `fp8_scale_p` (the policy formula),
`amax_history_p` (push an amax into a history), `quantize_p` (x / s cast to FP8) and
`scaled_matmul_p` (the dot of two quantised operands and their scales).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad, batching

from scalify.core.config import get_config
from scalify.core.pow2 import pow2_fit
from scalify.core.scaled_array import ScaledArray, has_float32_range
from scalify.core.registry import register_scale_rule
from scalify.ops._common import batch_scale_operand, define_primitive
from scalify.ops.casts import cast
from scalify.ops.scaling import as_scaled_value
from scalify.ops.cast_transpose import cast_transpose
from scalify.core.lax_utils import widen
from scalify.quant.formats import format_info, is_fp8, saturating_cast
from scalify.quant.mx import mx_dequantize, mx_quantize
from scalify.rules.common import materialize
from scalify.rules.linalg import fp8_operands_tn, scaled_dot_general

__all__ = [
    "E4M3",
    "E5M2",
    "JitScaling",
    "DelayedScaling",
    "StaticScaling",
    "ScalingPolicy",
    "scaling_policy",
    "amax",
    "fp8_scale",
    "update_amax_history",
    "quantize",
    "scaled_matmul",
    "fp8_dot_general",
    "init_amax_history",
    "dot_scaled_tn",
    "mx_quantize_scaled",
    "mx_dequantize_scaled",
    "amax_p",
    "fp8_scale_p",
    "amax_history_p",
    "quantize_p",
    "scaled_matmul_p",
]

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
_F32 = jnp.dtype(jnp.float32)


# ---------------------------------------------------------------------------------------
# Scaling policies
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StaticScaling:
    """Keep the propagated scale (inside scalify); scale 1 outside. No statistics."""

    name = "static"


@dataclasses.dataclass(frozen=True)
class JitScaling:
    """Just-in-time per-tensor scaling from the current amax (Perez et al. 2023).

    Attributes:
      margin: power-of-two headroom: `amax / s <= fp8_max / 2^margin`.
    """

    margin: int = 0
    name = "jit"


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Delayed per-tensor scaling from the largest amax of the last `history_length` steps.

    Attributes:
      history_length: steps of amax kept (most recent first).
      margin: power-of-two headroom, as in `JitScaling`.
    """

    history_length: int = 16
    margin: int = 0
    name = "delayed"

    def __post_init__(self):
        if self.history_length < 1:
            raise ValueError(f"history_length must be >= 1, got {self.history_length}.")


ScalingPolicy = Union[StaticScaling, JitScaling, DelayedScaling]
_POLICIES = {"static": StaticScaling, "jit": JitScaling, "delayed": DelayedScaling}


def scaling_policy(spec: str | ScalingPolicy | None) -> ScalingPolicy:
    """A policy from its name ("static", "jit", "delayed") or a policy instance (None: static)."""
    if spec is None:
        return StaticScaling()
    if isinstance(spec, (StaticScaling, JitScaling, DelayedScaling)):
        return spec
    if isinstance(spec, str) and spec in _POLICIES:
        return _POLICIES[spec]()
    raise ValueError(
        f"Unknown scaling policy {spec!r}: use 'static', 'jit', 'delayed' or an instance of "
        "StaticScaling, JitScaling(margin=...), DelayedScaling(history_length=..., margin=...)."
    )


# ---------------------------------------------------------------------------------------
# Statistics primitives: amax, the policy's scale, the amax history
# ---------------------------------------------------------------------------------------
def _scalar_aval(*_, **__):
    return jax.core.ShapedArray((), _F32)


def _amax_impl(x):
    return jnp.max(jnp.abs(x.astype(_F32)), initial=0.0)


amax_p = define_primitive("fp8_amax", _amax_impl, _scalar_aval)
batching.primitive_batchers[amax_p] = lambda args, dims: (jax.vmap(_amax_impl, dims)(*args), 0)
ad.defjvp(amax_p, None)  # statistics carry no gradient


@register_scale_rule(amax_p)
def _amax_rule(x: ScaledArray):
    """amax(x): the plain float32 value max |data| * scale (unscaled output: a statistic)."""
    s = jnp.asarray(x.scale).astype(_F32)
    if s.size == 1:
        return _amax_impl(x.data) * s.reshape(())
    return jnp.max(jnp.abs(x.data.astype(_F32)) * s, initial=0.0)


def amax(x):
    """max |x| as a float32 scalar (NaN if x holds NaN); a plain value inside scalify too."""
    return amax_p.bind(jnp.asarray(x))


def _fp8_scale_impl(amax_values, fallback, *, dtype, margin):
    a = jnp.max(amax_values.astype(_F32))
    a = jnp.where(a > 0, a, fallback.astype(_F32))  # empty history: use the current amax
    # s = 2^margin / 2^floor(log2(fmax / a)) = 2^ceil(log2(a / (fmax / 2^margin))), exact
    return pow2_fit(a, format_info(dtype).max * 2.0**-margin)


fp8_scale_p = define_primitive("fp8_scale", _fp8_scale_impl, _scalar_aval)
batching.primitive_batchers[fp8_scale_p] = lambda args, dims, **p: (
    jax.vmap(functools.partial(_fp8_scale_impl, **p), dims)(*args),
    0,
)
ad.defjvp(fp8_scale_p, None, None)


@register_scale_rule(fp8_scale_p)
def _fp8_scale_rule(amax_values: ScaledArray, fallback: ScaledArray, **params):
    """fp8_scale(amax): on the materialised float32 statistics; a plain power of two."""
    return fp8_scale_p.bind(materialize(amax_values, _F32), materialize(fallback, _F32), **params)


def fp8_scale(amax_values, dtype, margin: int = 0, fallback=None):
    """The power-of-two scale `s` with `max(amax_values) / s <= fmax(dtype) / 2^margin`.

    `s = 2^margin / 2^floor(log2(fmax / amax))` (Perez et al. 2023: the scaling bias is
    `floor(log2(fmax / amax)) - margin`). A zero amax uses `fallback` (default: none, so 1);
    a zero, inf or NaN amax gives 1. Returns a float32 scalar.
    """
    amax_values = jnp.asarray(amax_values, _F32)
    fallback = jnp.zeros((), _F32) if fallback is None else jnp.asarray(fallback, _F32)
    return fp8_scale_p.bind(amax_values, fallback, dtype=jnp.dtype(dtype), margin=int(margin))


def _history_impl(history, new_amax):
    return jnp.concatenate([new_amax.astype(history.dtype)[None], history[:-1]])


amax_history_p = define_primitive(
    "fp8_amax_history", _history_impl, lambda h, a: jax.core.ShapedArray(h.shape, h.dtype)
)
batching.primitive_batchers[amax_history_p] = lambda args, dims: (
    jax.vmap(_history_impl, dims)(*args),
    0,
)
ad.defjvp(amax_history_p, None, None)


@register_scale_rule(amax_history_p)
def _amax_history_rule(history: ScaledArray, new_amax: ScaledArray):
    """update_amax_history: on materialised float32 values; a plain history."""
    return amax_history_p.bind(materialize(history, history.dtype), materialize(new_amax, _F32))


def update_amax_history(history, new_amax):
    """`[new_amax, history[:-1]]` (most recent first), a plain array inside scalify too."""
    return amax_history_p.bind(jnp.asarray(history), jnp.asarray(new_amax, _F32))


def init_amax_history(length: int = 16):
    """An empty amax history (zeros: the first step falls back to the current amax)."""
    return jnp.zeros((int(length),), _F32)


# ---------------------------------------------------------------------------------------
# quantize: x / s cast to a low-precision format
# ---------------------------------------------------------------------------------------
def _cast_to(x, dtype):
    return saturating_cast(x, dtype) if is_fp8(dtype) else x.astype(dtype)


def _quantize_impl(x, s, *, dtype):
    return _cast_to(x.astype(_F32) / s.astype(_F32), dtype)


def _quantize_aval(x, s, *, dtype):
    return jax.core.ShapedArray(x.shape, dtype)


def _quantize_batch(args, dims, *, dtype):
    (x, s), (bx, bs) = args, dims
    size = x.shape[bx] if bx is not None else s.shape[bs]
    x = batching.bdim_at_front(x, bx, size)
    return quantize_p.bind(x, batch_scale_operand(s, bs, x.ndim - 1, size), dtype=dtype), 0


quantize_p = define_primitive("fp8_quantize", _quantize_impl, _quantize_aval)
batching.primitive_batchers[quantize_p] = _quantize_batch
# Straight-through in x (the tangent is divided by s and converted, never clipped); no
# gradient flows into the choice of s.
ad.defjvp(
    quantize_p,
    lambda t, x, s, *, dtype: (t.astype(_F32) / s.astype(_F32)).astype(dtype),
    None,
)


@register_scale_rule(quantize_p)
def _quantize_rule(x: ScaledArray, s: ScaledArray, *, dtype):
    """quantize(x, s) = x / s: output scale 1; data cast(x.data * x.scale / s) (saturating),
    computed in float32 (x.scale / s is a power of two, so only the cast rounds)."""
    ratio = jnp.asarray(x.scale).astype(_F32) / materialize(s, _F32)
    data = _cast_to(x.data.astype(_F32) * ratio, dtype)
    return ScaledArray(data, jnp.ones((), get_config().scale_dtype))


def quantize(x, scale, dtype):
    """`x / scale` cast to `dtype` (saturating for FP8, round-to-nearest-even).

    Args:
      x: float array.
      scale: float32 power of two, scalar or broadcasting to `x` (e.g. from `fp8_scale`).
      dtype: target dtype.
    Returns:
      The quantised array (its value is x / scale).
    """
    return quantize_p.bind(jnp.asarray(x), jnp.asarray(scale, _F32), dtype=jnp.dtype(dtype))


# ---------------------------------------------------------------------------------------
# The data path of a scaled low-precision dot outside scalify
# ---------------------------------------------------------------------------------------
def dot_scaled_tn(a, b, sa, sb, dn, out_dtype):
    """`dot_general(a * sa, b * sb)` as the raw low-precision dot times `sa * sb`, the FP8
    operands first laid out contracting-minor (cuBLASLt FP8's "TN" layout, as scalify's dot
    rule does: `ScalifyConfig.fp8_operand_layout`). The FP8 operands reach the dot as they
    are (no up-cast for XLA to fold), so operands quantised in the same jitted function
    still form the FP8 GEMM. The raw product (up to 448^2 * K) is written in the output
    dtype when that has float32's range (bfloat16, float32), else accumulated in float32 (in
    float16 it would overflow before the scales bring it back). Other formats (FP16/BF16
    matmuls) run the raw dot in the output dtype.

    The scales are applied as one run-time multiply in the dot's dtype, which XLA folds into
    the GEMM (cuBLASLt's operand scale: XLA folds a bfloat16 GEMM times one run-time scalar
    into the GEMM, but not a float32 GEMM cast to bfloat16).
    For FP8 operands into bfloat16 the product s = sa * sb is split as the constant
    2^-16 (the GEMM's alpha) times s * 2^16, so that every s in [2^-149, 2^111] is a
    bfloat16 value (bfloat16 holds powers of two from 2^-133): outputs in bfloat16's normal
    range are the float32 output rounded to bfloat16; below 2^-126 the raw dot's rounding
    and the subnormal one can differ by one subnormal step.
    """
    acc = out_dtype
    fp8 = is_fp8(a.dtype) and is_fp8(b.dtype)
    if fp8:
        a, b, dn = fp8_operands_tn(a, b, dn)
        if not has_float32_range(out_dtype):
            acc = _F32
    s = sa.astype(_F32) * sb.astype(_F32)
    out = lax.dot_general(a, b, dn, preferred_element_type=acc)
    if fp8 and jnp.dtype(acc).itemsize < 4:
        # Raw FP8 products are >= 2^-25 in magnitude (E5M2 x E4M3 subnormals), so the
        # constant step stays in bfloat16's normal range: exact.
        out = out * jnp.asarray(_SPLIT, acc)
        s = s * np.float32(1.0 / _SPLIT)
    return (out * s.astype(acc)).astype(out_dtype)


# The constant part of the scales of an FP8 GEMM written in bfloat16 (`dot_scaled_tn`).
_SPLIT = 2.0**-16


# On Hopper, `dot_scaled_tn` ("alpha_tn") forms the FP8 GEMM whether the operands arrive
# in FP8 or are quantised in the same jitted function; an up-cast-then-dot ("dequant_f32")
# forms it only for operands that arrive in FP8. The other candidate data paths live in
# benchmarks/fp8_patterns.py (pass one as `pattern=` to compare with benchmarks/fp8_gemm.py).


def _check_pattern(pattern) -> None:
    if pattern is not None and not callable(pattern):
        raise TypeError(
            f"pattern must be None (scalify's data path, `dot_scaled_tn`) or a function "
            f"fn(a, b, sa, sb, dimension_numbers, out_dtype), got {pattern!r}. The candidate "
            "data paths measured by benchmarks/fp8_gemm.py are in benchmarks/fp8_patterns.py."
        )


def _dn(dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    return (tuple(map(int, lc)), tuple(map(int, rc))), (tuple(map(int, lb)), tuple(map(int, rb)))


def _matmul_impl(a, b, sa, sb, *, dimension_numbers, preferred_element_type, pattern, unscaled_output):
    # A `pattern` applies to FP8 operands; other formats take scalify's own path.
    fn = pattern if pattern is not None and is_fp8(a.dtype) and is_fp8(b.dtype) else dot_scaled_tn
    return fn(a, b, sa, sb, dimension_numbers, preferred_element_type)


def _matmul_aval(a, b, sa, sb, *, dimension_numbers, preferred_element_type, pattern, unscaled_output):
    out = jax.eval_shape(
        lambda u, v: lax.dot_general(u, v, dimension_numbers),
        jax.ShapeDtypeStruct(a.shape, _F32),
        jax.ShapeDtypeStruct(b.shape, _F32),
    )
    return jax.core.ShapedArray(out.shape, preferred_element_type)


scaled_matmul_p = define_primitive("fp8_scaled_matmul", _matmul_impl, _matmul_aval)


@register_scale_rule(scaled_matmul_p)
def _scaled_matmul_rule(a, b, sa, sb, *, dimension_numbers, preferred_element_type, pattern,
                        unscaled_output):
    """scaled_matmul(a, b, sa, sb) = dot(a*sa, b*sb): the scales join the operands' scales
    (scale land) and `scaled_dot_general` computes the data: the raw low-precision dot times
    1/round_pow2(sqrt(K)), output scale a.scale*sa * b.scale*sb * round_pow2(sqrt(K)).
    `unscaled_output` (an output dtype of float32's range): the values themselves,
    `dot_scaled_tn(a.data, b.data, a.scale*sa, b.scale*sb)`, every scale applied in the GEMM
    (per-tensor scales; other scales: the scaled dot, materialised)."""
    def join(x: ScaledArray, s: ScaledArray) -> ScaledArray:
        scale = jnp.asarray(x.scale).astype(_F32) * materialize(s, _F32)
        return ScaledArray(x.data, scale.astype(get_config().scale_dtype))

    a, b = join(a, sa), join(b, sb)
    if unscaled_output and a.scale.size == 1 and b.scale.size == 1:
        return dot_scaled_tn(a.data, b.data, a.scale.reshape(()), b.scale.reshape(()), dimension_numbers,
                             preferred_element_type)
    out = scaled_dot_general(
        a,
        b,
        dimension_numbers=dimension_numbers,
        precision=None,
        preferred_element_type=preferred_element_type,
        out_sharding=None,
    )
    return materialize(out, preferred_element_type) if unscaled_output else out


def scaled_matmul(a, b, sa, sb, dimension_numbers, preferred_element_type, pattern=None,
                  unscaled_output=False):
    """`dot_general(a * sa, b * sb)` for quantised `a`, `b` and power-of-two scales.

    Outside scalify the data path is `dot_scaled_tn`, or `pattern(a, b, sa, sb,
    dimension_numbers, out_dtype)` for FP8 operands when given (benchmarks compare
    candidates with it). Inside scalify the scales are moved into the operands' ScaledArray
    scales and the raw dot runs (see the module docstring); with `unscaled_output` (for an
    output dtype of float32's range) the output is the values, every scale applied in the
    GEMM (`dot_scaled_tn`), with scale 1.
    """
    _check_pattern(pattern)
    if unscaled_output and not has_float32_range(preferred_element_type):
        raise ValueError(
            f"scaled_matmul: unscaled_output needs an output dtype with float32's exponent range "
            f"(bfloat16, float32), got {jnp.dtype(preferred_element_type)}: its values could leave "
            "the dtype's range without a scale."
        )
    return scaled_matmul_p.bind(
        a,
        b,
        jnp.asarray(sa, _F32),
        jnp.asarray(sb, _F32),
        dimension_numbers=_dn(dimension_numbers),
        preferred_element_type=jnp.dtype(preferred_element_type),
        pattern=pattern,
        unscaled_output=bool(unscaled_output),
    )


# ---------------------------------------------------------------------------------------
# The low-precision dot_general with its FP8 backward
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _DotConfig:
    dimension_numbers: tuple
    lhs_dtype: Any
    rhs_dtype: Any
    grad_dtype: Any
    out_dtype: Any
    lhs_primal_dtype: Any
    rhs_primal_dtype: Any
    policy: Any
    pattern: Optional[Callable]
    rhs_grad_dtype: Any = None
    unscaled_activations: bool = False
    recompute_rhs: bool = False


def _quantize_with(x, dtype, policy, history, promote: bool = False):
    """(q, s, new_history): x quantised to `dtype` with the policy's scale s. `promote`
    (static scaling): inside scalify an unscaled x is cast as a ScaledArray at scale 1, so
    that the cast's drift guard places it (`scalify.ops.casts.fp8_cast_window`)."""
    if isinstance(policy, StaticScaling):
        return cast(as_scaled_value(x) if promote else x, dtype), jnp.ones((), _F32), None
    a = amax(lax.stop_gradient(x))
    if isinstance(policy, JitScaling):
        s = fp8_scale(a, dtype, policy.margin)
        return quantize(x, s, dtype), s, None
    s = fp8_scale(history, dtype, policy.margin, fallback=a)
    return quantize(x, s, dtype), s, update_amax_history(history, a)


def _remaining(n, *removed):
    drop = set(int(i) for r in removed for i in r)
    return [i for i in range(n) if i not in drop]


def _transpose_lhs(cfg: _DotConfig, g, y, sg, sy, x_ndim, y_ndim, out_dtype, unscaled=False):
    """d(lhs) of dot_general(x, y) given the output cotangent g (JAX's transpose rule)."""
    (xc, yc), (xb, yb) = cfg.dimension_numbers
    x_kept = _remaining(x_ndim, xc, xb)
    y_kept = _remaining(y_ndim, yc, yb)
    nb = len(xb)
    ans_y = list(range(nb + len(x_kept), nb + len(x_kept) + len(y_kept)))
    ans_batch = list(range(nb))
    dims = ((tuple(ans_y), tuple(y_kept)), (tuple(ans_batch), tuple(yb)))
    xc_by_y = [xc[i] for i in np.argsort(yc)] if len(yc) else []
    out = scaled_matmul(g, y, sg, sy, dims, out_dtype, cfg.pattern, unscaled)
    perm = tuple(int(i) for i in np.argsort(list(xb) + x_kept + xc_by_y))
    return out if perm == tuple(range(len(perm))) else lax.transpose(out, perm)


def _transpose_rhs(cfg: _DotConfig, g, x, sg, sx, x_ndim, y_ndim, out_dtype, unscaled=False):
    """d(rhs) of dot_general(x, y), the weight gradient: dot(x, g) or dot(g, x), whichever
    has its output dims in y's order already, so that no transpose of the wide output is in
    the graph. Dense layers: an (in, out) kernel y (x: (..., K), y: (K, N)) gets dot(x, g)
    -> (K, N); an (out, in) kernel (`scalify.nn.Dense(kernel_layout="out_in")`) dot(g, x)
    -> (N, K). XLA still picks the physical
    layout: on Hopper, cuBLASLt's FP8 GEMM writes the E5M2 operand's (g's) free dims major,
    i.e. (N, K) memory order, which (out, in) kernels match."""
    (xc, yc), (xb, yb) = cfg.dimension_numbers
    x_kept = _remaining(x_ndim, xc, xb)
    y_kept = _remaining(y_ndim, yc, yb)
    nb = len(xb)
    ans_x = tuple(range(nb, nb + len(x_kept)))
    batch = tuple(range(nb))
    # Output dims of each order, named by y's dims: batch (yb), x's contracted dims in x's
    # order (their yc), y_kept.
    contracted = [yc[list(xc).index(d)] for d in sorted(xc)]
    x_first = list(yb) + contracted + y_kept
    g_first = list(yb) + y_kept + contracted
    if g_first == sorted(g_first) and x_first != sorted(x_first):
        return scaled_matmul(g, x, sg, sx, ((ans_x, tuple(x_kept)), (batch, tuple(xb))), out_dtype, cfg.pattern,
                             unscaled)
    out = scaled_matmul(x, g, sx, sg, ((tuple(x_kept), ans_x), (tuple(xb), batch)), out_dtype, cfg.pattern,
                        unscaled)
    perm = tuple(int(i) for i in np.argsort(x_first))
    return out if perm == tuple(range(len(perm))) else lax.transpose(out, perm)


def _weight_in_both_layouts(cfg: _DotConfig, rhs) -> bool:
    """Whether the forward reads a (K, N) matrix rhs as its transposed copy from
    `cast_transpose` (static scaling, FP8 rhs, `x @ w` dimension numbers): the FP8 GEMMs
    take their operands contracting-dim minor, (N, K) here and (K, N) for d(lhs)."""
    (_, rc), (lb, rb) = cfg.dimension_numbers
    return (isinstance(cfg.policy, StaticScaling) and is_fp8(cfg.rhs_dtype) and jnp.ndim(rhs) == 2
            and rc == (0,) and not lb and not rb and cfg.pattern is None)


def _lp_dot_fwd(cfg: _DotConfig, lhs, rhs, stats):
    hl, hr, hg = stats if isinstance(cfg.policy, DelayedScaling) else (None, None, None)
    plain = cfg.unscaled_activations
    ql, sl, new_hl = _quantize_with(lhs, cfg.lhs_dtype, cfg.policy, hl, plain)
    if _weight_in_both_layouts(cfg, rhs):
        # Both layouts of the weight in one pass: (N, K) for this GEMM, (K, N) saved for
        # d(lhs)'s, so that neither GEMM needs a transpose of its own. With `recompute_rhs`
        # rhs itself is saved and the backward casts the (K, N) copy again.
        qr, qr_t = cast_transpose(rhs, cfg.rhs_dtype, split=1)
        sr, new_hr = jnp.ones((), _F32), None
        (lc, _), batch = cfg.dimension_numbers
        out = scaled_matmul(ql, qr_t, sl, sr, ((lc, (1,)), batch), cfg.out_dtype, cfg.pattern, plain)
        if cfg.recompute_rhs:
            qr = rhs
    else:
        qr, sr, new_hr = _quantize_with(rhs, cfg.rhs_dtype, cfg.policy, hr, plain)
        out = scaled_matmul(ql, qr, sl, sr, cfg.dimension_numbers, cfg.out_dtype, cfg.pattern, plain)
    return out, (ql, qr, sl, sr, new_hl, new_hr, hg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lp_dot(cfg: _DotConfig, lhs, rhs, stats):
    return _lp_dot_fwd(cfg, lhs, rhs, stats)[0]


def _lp_dot_bwd(cfg: _DotConfig, res, g):
    ql, qr, sl, sr, new_hl, new_hr, hg = res
    if cfg.recompute_rhs and _weight_in_both_layouts(cfg, qr):
        # The forward's (K, N) copy, cast again from rhs: `cast` takes the drift guard that
        # `cast_transpose` took on the same value, so the copy has the same bits.
        qr = cast(qr, cfg.rhs_dtype)
    qg, sg, new_hg = _quantize_with(g, cfg.grad_dtype, cfg.policy, hg, cfg.unscaled_activations)
    if not is_fp8(cfg.grad_dtype):
        # A 16/32-bit gradient: the backward GEMMs run in its dtype, the saved FP8 operands
        # widened to it (exact), rather than as mixed-dtype dots.
        ql, qr = (q.astype(cfg.grad_dtype) if is_fp8(q.dtype) else q for q in (ql, qr))
    d_lhs = _transpose_lhs(cfg, qg, qr, sg, sr, ql.ndim, qr.ndim, cfg.lhs_primal_dtype, cfg.unscaled_activations)
    if cfg.rhs_grad_dtype is not None and is_fp8(qg.dtype) and is_fp8(ql.dtype):
        # The values, written by the FP8 GEMM in rhs_grad_dtype, widened to rhs's dtype (exact).
        d_rhs = _transpose_rhs(cfg, qg, ql, sg, sl, ql.ndim, qr.ndim, cfg.rhs_grad_dtype, unscaled=True)
        d_rhs = d_rhs.astype(cfg.rhs_primal_dtype)
    else:
        d_rhs = _transpose_rhs(cfg, qg, ql, sg, sl, ql.ndim, qr.ndim, cfg.rhs_primal_dtype)
        if cfg.rhs_grad_dtype is not None:  # 16-bit GEMM operands: the same rounding, after it
            d_rhs = d_rhs.astype(cfg.rhs_grad_dtype).astype(cfg.rhs_primal_dtype)
    # Delayed scaling: the "gradient" of the amax histories is their updated value (the
    # caller overwrites the histories with it, as Flax's OVERWRITE_WITH_GRADIENT does).
    stats_ct = (new_hl, new_hr, new_hg) if isinstance(cfg.policy, DelayedScaling) else ()
    return d_lhs, d_rhs, stats_ct


_lp_dot.defvjp(_lp_dot_fwd, _lp_dot_bwd)


def fp8_dot_general(
    lhs,
    rhs,
    dimension_numbers,
    *,
    lhs_dtype=E4M3,
    rhs_dtype=E4M3,
    grad_dtype=E5M2,
    preferred_element_type=None,
    scaling: str | ScalingPolicy = "static",
    amax_history=None,
    pattern: Callable | None = None,
    rhs_grad_dtype=None,
    unscaled_activations: bool = False,
    recompute_rhs: bool = False,
):
    """`lax.dot_general(lhs, rhs)` with low-precision operands and a low-precision backward.

    Forward: `lhs_dtype x rhs_dtype` (E4M3 x E4M3); backward: the output gradient in
    `grad_dtype` (E5M2) times the saved quantised operands: E5M2 x E4M3 for d(lhs) and
    E4M3 x E5M2 for d(rhs). Each operand is quantised with the `scaling` policy (see the
    module docstring). Any dtype works (FP16 or BF16 matmuls are the same code); gradients
    are returned in the primal dtypes, the output in `preferred_element_type`. With a
    16- or 32-bit `grad_dtype` the backward dots run in that dtype, the saved FP8 operands
    widened to it (exact): FP8 forward, e.g. bfloat16 backward.

    Args:
      lhs, rhs: float arrays (quantised here from their own dtype, e.g. float32 weights).
      dimension_numbers: as `lax.dot_general`.
      lhs_dtype, rhs_dtype, grad_dtype: formats of the two forward operands and of the
        output gradient.
      preferred_element_type: output dtype (default: the result type of lhs and rhs).
      scaling: "static", "jit", "delayed" or a policy instance.
      amax_history: with delayed scaling, a tuple of three float32 histories (lhs, rhs,
        output gradient), e.g. `(init_amax_history(16),) * 3`. Under `jax.grad` their
        gradient is their *updated value*: replace the histories with it after each step.
      pattern: data path of FP8 operands outside scalify, a function
        `fn(a, b, sa, sb, dimension_numbers, out_dtype)` (default: `dot_scaled_tn`).
      rhs_grad_dtype: dtype the GEMM of rhs's gradient writes (None: rhs's dtype). Given (a
        dtype of float32's range, e.g. bfloat16), rhs's gradient is rounded to it and
        widened back to rhs's dtype. With FP8 operands in that GEMM (`grad_dtype` and
        `lhs_dtype` FP8), the GEMM writes the values in it, every scale applied in the GEMM
        (`dot_scaled_tn`; inside scalify the gradient leaves unscaled): for a gradient that
        is rounded to that dtype next anyway (a bfloat16 gradient all-reduce) the values
        are the same and the pass that scales and casts them is gone. With 16-bit operands
        the float32 GEMM output is rounded after it (a mixed 16-bit dot writing bfloat16
        would round the accumulation differently).
      unscaled_activations: with static scaling inside scalify, for a product and an lhs of
        float32's exponent range (bfloat16): the product and lhs's gradient leave the GEMMs
        as plain values (every scale applied in the GEMM), and an unscaled operand or output
        gradient is quantised as a value at scale 1, placed by the FP8 cast's drift guard
        (`scalify.ops.casts.fp8_cast_window`). The values between the FP8 GEMMs then carry no
        scale, and none of the scale arithmetic of the ops between them. With FP8 `lhs_dtype`
        and `grad_dtype`, rhs's gradient of an rhs of float32's exponent range leaves its GEMM
        as values too, written in rhs's dtype (`rhs_grad_dtype` defaults to it): the rounding
        to rhs's dtype that the scaled gradient's data had, the scales applied in the GEMM.
      recompute_rhs: with static scaling and a 2-D rhs contracted on its first dim (a Dense
        kernel, cast in both layouts by `cast_transpose`): keep rhs for the backward pass
        and cast d(lhs)'s copy of it again there, instead of keeping the forward's FP8
        copy. The same bits; the values the VJP keeps hold one byte per rhs element less
        (rhs, which the caller holds anyway, replaces its copy), for one more read of rhs.
        Other cases keep the copy.
    Returns:
      The product in `preferred_element_type`.
    """
    policy = scaling_policy(scaling)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    out_dtype = jnp.result_type(lhs, rhs) if preferred_element_type is None else preferred_element_type
    if isinstance(policy, DelayedScaling):
        if amax_history is None or len(amax_history) != 3:
            raise ValueError(
                "Delayed scaling needs amax_history=(lhs_history, rhs_history, grad_history) "
                "(e.g. `(init_amax_history(16),) * 3`); scalify.nn.Dense keeps them in the "
                "'fp8_stats' variable collection."
            )
        stats = tuple(jnp.asarray(h, _F32) for h in amax_history)
    else:
        stats = ()
    if rhs_grad_dtype is not None:
        rhs_grad_dtype = jnp.dtype(rhs_grad_dtype)
        if not jnp.issubdtype(rhs_grad_dtype, jnp.floating) or not has_float32_range(rhs_grad_dtype):
            raise ValueError(
                f"rhs_grad_dtype must be a float dtype with float32's exponent range (bfloat16, "
                f"float32) or None, got {rhs_grad_dtype}: the weight gradient leaves the GEMM "
                "unscaled, and a narrower dtype (float16, FP8) could not hold its values. Use "
                "grad_dtype for the format of the GEMM operands."
            )
    if unscaled_activations and not (has_float32_range(out_dtype) and has_float32_range(lhs.dtype)):
        raise ValueError(
            f"unscaled_activations needs a product and an lhs of float32's exponent range (bfloat16, "
            f"float32), got {jnp.dtype(out_dtype)} and {lhs.dtype}: without a scale a narrower dtype "
            "(float16) could not hold their values."
        )
    if (unscaled_activations and rhs_grad_dtype is None and has_float32_range(rhs.dtype) and is_fp8(grad_dtype)
            and is_fp8(lhs_dtype)):
        rhs_grad_dtype = rhs.dtype  # the weight gradient leaves its GEMM as values too, in rhs's dtype
    cfg = _DotConfig(
        dimension_numbers=_dn(dimension_numbers),
        lhs_dtype=jnp.dtype(lhs_dtype),
        rhs_dtype=jnp.dtype(rhs_dtype),
        grad_dtype=jnp.dtype(grad_dtype),
        out_dtype=jnp.dtype(out_dtype),
        lhs_primal_dtype=lhs.dtype,
        rhs_primal_dtype=rhs.dtype,
        policy=policy,
        pattern=pattern,
        rhs_grad_dtype=rhs_grad_dtype,
        unscaled_activations=bool(unscaled_activations),
        recompute_rhs=bool(recompute_rhs),
    )
    _check_pattern(pattern)
    return _lp_dot(cfg, lhs, rhs, stats)


# ---------------------------------------------------------------------------------------
# MX block-scaled arrays (OCP Microscaling): a ScaledArray with one E8M0 scale per block
# ---------------------------------------------------------------------------------------
def mx_quantize_scaled(x, dtype=E4M3, block_size: int = 32, axis: int = -1, scale_dtype=_F32):
    """MX-quantise `x` into a ScaledArray whose scale is per block of `block_size`.

    The data is laid out with `axis` split into `(n // block_size, block_size)` and the
    scale has size 1 on the block axis, so `scale` broadcasts to `data` as ScaledArray
    requires; `mx_dequantize_scaled` undoes the layout. Scales are the E8M0 powers of two of
    `scalify.quant.mx_quantize` (OCP MX v1.0), stored as float32 (default) or as
    `float8_e8m0fnu` (`scale_dtype=scalify.quant.E8M0`, 1 byte per block).

    Args:
      x: float array with `x.shape[axis]` a multiple of `block_size`.
      dtype: element format (E4M3 or E5M2).
      block_size: elements per scale (32 in the MX spec).
      axis: the blocked axis.
      scale_dtype: float32 or float8_e8m0fnu.
    Returns:
      ScaledArray(data: dtype, shape with the split axis; scale: shape with 1 at the block).
    """
    x = jnp.asarray(x)
    axis = axis % x.ndim
    data, scales = mx_quantize(x, dtype, block_size, axis)
    n = x.shape[axis]
    blocked = x.shape[:axis] + (n // block_size, block_size) + x.shape[axis + 1 :]
    data = data.reshape(blocked)
    scales = jnp.expand_dims(scales, axis + 1).astype(jnp.float32).astype(scale_dtype)
    # A block holding inf/NaN has the NaN scale (MX spec): bypass ScaledArray's power-of-two
    # check, which would refuse it.
    return ScaledArray.tree_unflatten(None, (data, scales))


def mx_dequantize_scaled(x: ScaledArray, axis: int = -1, dtype=_F32):
    """The value of an MX ScaledArray from `mx_quantize_scaled`, in the original layout.

    `axis` is the blocked axis of the original array (the same `axis` given to
    `mx_quantize_scaled`, counted in the original rank).
    """
    orig_ndim = x.ndim - 1
    axis = axis % orig_ndim
    value = widen(x.data, _F32) * jnp.asarray(x.scale).astype(_F32)
    shape = x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2 :]
    return value.reshape(shape).astype(dtype)


def mx_roundtrip(x, dtype=E4M3, block_size: int = 32, axis: int = -1):
    """`mx_dequantize(*mx_quantize(x))`: the value MX quantisation keeps (for error studies)."""
    data, scales = mx_quantize(x, dtype, block_size, axis)
    return mx_dequantize(data, scales, block_size, axis, jnp.asarray(x).dtype)

