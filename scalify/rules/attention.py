"""Scale rules of fused attention: `jax.nn.dot_product_attention(..., implementation="cudnn")`.

Attention is `O = softmax(c * Q K^T + bias) V` (`c` the static `scale=` argument, 1/sqrt(H)
by default; masks enter as a large negative bias or as the kernel's mask type). With
`Q = dq * sq`, `K = dk * sk`, `V = dv * sv` (power-of-two scales):

- logits: `c * Q K^T = c * (dq a)(dk b)^T` for any `a * b = sq * sk`. The rule splits the
  exponent of `sq * sk` in halves, `a = 2^floor(e/2)`, `b = 2^(e - floor(e/2))`, and calls the
  kernel on `q' = dq * a`, `k' = dk * b` with the user's `c`, mask and options unchanged (the
  kernel's `scale` is a static parameter, scales are traced values: the powers of two go into
  the data, exactly unless `q'`/`k'` under- or overflow, which needs logits beyond the
  dtype's range). Softmax rows sum to 1, so `O = (softmax @ dv) * sv`: the output takes v's
  scale. The softmax statistics (log-sum-exp of the true logits) are unscaled.
- backward, with the output cotangent `dO = g * sg` and the saved output `O = o * so`: the
  kernel is called on `q'`, `k'`, `dv`, `o * so/sv` (the output at v's scale, as the kernel
  pairs it with `dv`) and `g`; its gradients are those of the true ones divided by known
  powers of two: `dQ = dQ' * sg sv sk / b`, `dK = dK' * sg sv sq / a`, `dV = dV' * sg`,
  `dbias = dbias' * sg sv`.

`jax.nn.dot_product_attention` with implementation None or "xla" traces to ordinary
primitives (dot_general, exp, reduce_max, ...) whose rules already propagate the scales
(the output takes v's scale there too); only the cuDNN path binds primitives of its own.
Both cuDNN primitives are JAX internals (`jax._src.cudnn.fused_attention_stablehlo`); they
are registered when that module is importable. The FP8 cuDNN variant is not reachable from
`jax.nn.dot_product_attention` and has no rule.
"""
from __future__ import annotations

from jax import lax
import numpy as np

from scalify.core.lax_utils import astype, mul
from scalify.core.registry import register_scale_rule
from scalify.core.scale_flow import exp2_int, scale_exponent, scale_from_exponent
from scalify.core.scale_flow import unchecked_scaled as _scaled
from scalify.core.scaled_array import ScaledArray, compute_dtype
from scalify.rules.common import align_scale, materialize, scalar_of, scalar_scale

try:  # JAX internals: the primitives cuDNN attention binds (absent on some builds)
    from jax._src.cudnn import fused_attention_stablehlo as _cudnn_attention

    fwd_p = _cudnn_attention._dot_product_attention_fwd_p_wrapper
    bwd_p = _cudnn_attention._dot_product_attention_bwd_p_wrapper
except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX build
    fwd_p = bwd_p = None

__all__ = ["fwd_p", "bwd_p"]

def _scalar_scaled(x: ScaledArray) -> ScaledArray:
    """`x` (a rule's operand: promoted, so scaled) with a single scale: a per-element/row
    scale is folded into the data at the largest scale of its non-zero elements
    (`align_scale`; exact unless the smaller entries underflow)."""
    if scalar_scale(x):
        return _scaled(x.data, scalar_of(x.scale))
    data, top = align_scale(x, range(x.ndim))
    return _scaled(data, top.reshape(()))


def _times(data, factor):
    """`data * factor` (a power of two) in data's dtype, computed in float32 or wider."""
    cdt = compute_dtype(data.dtype)
    return astype(mul(astype(data, cdt), astype(factor, cdt)), data.dtype)


def _with_exponent(data, e) -> ScaledArray:
    """ScaledArray of value `data * 2^e` (int32 e): scale 2^e clamped to the scale dtype's
    range, the rest (a factor exactly 1 unless clamped) multiplied into the data."""
    scale, factor = scale_from_exponent(e)
    return _scaled(_times(data, factor), scale)


def _folded_qk(q: ScaledArray, k: ScaledArray):
    """(q', k', ea, eb): the kernel's query dq * 2^ea and key dk * 2^eb, where ea + eb is the
    exponent of sq * sk split in halves (ea = floor(e / 2))."""
    eq, ek = scale_exponent(q.scale), scale_exponent(k.scale)
    e = lax.add(eq, ek)
    ea = lax.shift_right_arithmetic(e, np.int32(1))
    eb = lax.sub(e, ea)
    return _times(q.data, exp2_int(ea)), _times(k.data, exp2_int(eb)), ea, eb


def _plain(x):
    """An operand other than q/k/v/output/cotangent (bias, softmax statistics, sequence
    lengths, unused placeholders) as a plain value: `data * scale` in its own dtype."""
    return materialize(x, x.dtype) if isinstance(x, ScaledArray) else x


def _attention_fwd_rule(q, k, v, *rest, **params):
    """cuDNN attention forward: kernel on q' = dq*a, k' = dk*b (a*b = sq*sk, the exponent
    split in halves) and dv with the same static scale, masks and options; output scale sv
    (softmax rows sum to 1); the softmax statistics (log-sum-exp of the true logits) are
    unscaled."""
    q, k, v = (_scalar_scaled(x) for x in (q, k, v))
    qd, kd, _, _ = _folded_qk(q, k)
    outs = fwd_p.bind(qd, kd, v.data, *(_plain(x) for x in rest), **params)
    return [_scaled(outs[0], v.scale), *outs[1:]]


def _attention_bwd_rule(q, k, v, *rest, **params):
    """cuDNN attention backward: kernel on q', k', dv (as forward), the output o*so/sv and the
    cotangent g (scale sg); gradients dQ' sg sv sk/b, dK' sg sv sq/a, dV' sg, dbias' sg sv."""
    q, k, v = (_scalar_scaled(x) for x in (q, k, v))
    *middle, stats, out, g = rest
    out, g = _scalar_scaled(out), _scalar_scaled(g)
    qd, kd, ea, eb = _folded_qk(q, k)
    eg, ev = scale_exponent(g.scale), scale_exponent(v.scale)
    if out.scale is v.scale:
        od = out.data
    else:  # the output at v's scale: the kernel pairs it with dv (rowsum(dO * O))
        od = _times(out.data, exp2_int(lax.sub(scale_exponent(out.scale), ev)))
    grads = bwd_p.bind(qd, kd, v.data, *(_plain(x) for x in middle),
                       _plain(stats), od, g.data, **params)
    egv = lax.add(eg, ev)
    dq = _with_exponent(grads[0], lax.sub(lax.add(egv, scale_exponent(k.scale)), eb))
    dk = _with_exponent(grads[1], lax.sub(lax.add(egv, scale_exponent(q.scale)), ea))
    dv = _scaled(grads[2], g.scale)
    dbias = [_with_exponent(d, egv) for d in grads[3:]]
    return [dq, dk, dv, *dbias]


if fwd_p is not None:
    register_scale_rule(fwd_p)(_attention_fwd_rule)
    register_scale_rule(bwd_p)(_attention_bwd_rule)
