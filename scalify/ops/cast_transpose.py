"""An FP8 cast and its transposed copy, written in one pass.

    q, q_t = cast_transpose(x, float8_e4m3fn, split=1)   # x: (K, N) -> q: (K, N), q_t: (N, K)

`q = saturating_cast(x, dtype)` (`scalify.quant.formats`: round-to-nearest-even, clamped at
the format's max) and `q_t = transpose(q)` with the first `split` dims of `x` moved last:
`q_t.shape == x.shape[split:] + x.shape[:split]`. An FP8 matmul needs both layouts of its
weight (cuBLASLt's FP8 GEMM on Hopper takes its operands contracting-dim minor only: the
forward GEMM reads the weight one way, the backward GEMM of the input gradient the other).

On a CUDA GPU, for formats without infinities (E4M3) and 2-D views whose sides are
multiples of a tile, a Pallas kernel reads each tile of `x` once and writes it cast in
both layouts: one read of `x`, two writes of one byte per element. Elsewhere (CPU, E5M2,
other shapes) it is XLA's cast then transpose. The values are the same.

Inside `scalify` the rule casts the data and keeps the scale, as `cast` does (with the
same drift guard for bfloat16 and float32 sources); data known to be exact in a narrower
dtype (the float32 view of float16 master weights, `scale_flow.exact_in`) reach the kernel
in that dtype, so the narrow array is read rather than a widened copy.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad, batching, mlir

from scalify.core.guards import rebalance_drift
from scalify.core.registry import register_scale_rule
from scalify.core.scale_flow import exact_in, transpose_of
from scalify.core.scaled_array import ScaledArray
from scalify.ops._common import define_primitive
from scalify.ops.casts import fp8_cast_window
from scalify.rules.common import scalar_scale, scale_at_rank
from scalify.quant.formats import format_info, is_fp8, saturating_cast

__all__ = ["cast_transpose", "cast_transpose_p"]

# Tiles of the 2-D view (rows, cols) the kernel tries, in order: the first that divides it.
TILES = ((64, 256), (64, 128), (32, 128), (32, 64))


def _perm(ndim: int, split: int) -> tuple[int, ...]:
    return tuple(range(split, ndim)) + tuple(range(split))


def _xla_impl(x, *, dtype, split):
    q = saturating_cast(x, dtype)
    return q, lax.transpose(q, _perm(x.ndim, split))


def _tile(rows: int, cols: int):
    return next(((r, c) for r, c in TILES if rows % r == 0 and cols % c == 0), None)


def _pallas_2d(x2, dtype, tile, interpret: bool = False):
    """(cast(x2), cast(x2).T) of a 2-D array, one Pallas program per tile (`interpret`:
    Pallas's interpreter, for tests on CPU)."""
    from jax.experimental import pallas as pl  # GPU lowering only: imported when used

    rows, cols = x2.shape
    r, c = tile

    top = float(format_info(dtype).max)

    def kernel(x_ref, q_ref, qt_ref):
        # `saturating_cast` for a format without inf: clamp at +-max, NaN kept (Triton's
        # min/max would return the other operand for a NaN).
        x = x_ref[...].astype(jnp.float32)
        q = jnp.where(x != x, x, jnp.minimum(jnp.maximum(x, -top), top)).astype(dtype)
        q_ref[...] = q
        qt_ref[...] = q.T

    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((rows, cols), dtype), jax.ShapeDtypeStruct((cols, rows), dtype)),
        grid=(rows // r, cols // c),
        in_specs=[pl.BlockSpec((r, c), lambda i, j: (i, j))],
        out_specs=(pl.BlockSpec((r, c), lambda i, j: (i, j)), pl.BlockSpec((c, r), lambda i, j: (j, i))),
        interpret=interpret,
    )(x2)


def _cuda_impl(x, *, dtype, split):
    rows, cols = math.prod(x.shape[:split]), math.prod(x.shape[split:])
    tile = _tile(rows, cols)
    if tile is None or not is_fp8(dtype) or format_info(dtype).has_inf:
        # E5M2 keeps +-inf in `saturating_cast`; the kernel's conversion would saturate it.
        return _xla_impl(x, dtype=dtype, split=split)
    q2, qt2 = _pallas_2d(x.reshape(rows, cols), dtype, tile)
    return q2.reshape(x.shape), qt2.reshape(x.shape[split:] + x.shape[:split])


def _abstract_eval(x, *, dtype, split):
    shape_t = x.shape[split:] + x.shape[:split]
    return jax.core.ShapedArray(x.shape, dtype), jax.core.ShapedArray(shape_t, dtype)


cast_transpose_p = define_primitive("fp8_cast_transpose", _xla_impl, _abstract_eval, multiple_results=True)
mlir.register_lowering(cast_transpose_p, mlir.lower_fun(_cuda_impl, multiple_results=True), platform="cuda")


def _jvp(primals, tangents, *, dtype, split):
    (x,), (t,) = primals, tangents
    outs = cast_transpose_p.bind(x, dtype=dtype, split=split)
    if type(t) is ad.Zero:
        return outs, [ad.Zero.from_primal_value(o) for o in outs]
    tq = lax.convert_element_type(t, dtype)  # straight through, as `cast`
    return outs, [tq, lax.transpose(tq, _perm(x.ndim, split))]


ad.primitive_jvps[cast_transpose_p] = _jvp


def _batch(args, dims, *, dtype, split):
    (x,), (b,) = args, dims
    x = jnp.moveaxis(x, b, 0)
    q = saturating_cast(x, dtype)
    perm = (0,) + tuple(1 + d for d in _perm(x.ndim - 1, split))
    return [q, lax.transpose(q, perm)], [0, 0]


batching.primitive_batchers[cast_transpose_p] = _batch


def _narrowed(data):
    """`data` in the narrowest dtype its values are exact in (XLA folds the widening and
    this inverse, so the narrow array is what is read)."""
    narrow = exact_in(data)
    if narrow is not None and jnp.dtype(narrow).itemsize < data.dtype.itemsize:
        return data.astype(narrow)
    return data


@register_scale_rule(cast_transpose_p)
def _cast_transpose_rule(x: ScaledArray, *, dtype, split):
    """cast_transpose(x): the data cast as `cast` casts it (drift guard included), the
    scale kept (transposed alike for q_t when it is not a single value). Data exact in a
    narrower dtype are read in it; data that are the transpose of a 2-D array (a kernel
    stored as (out, in), `scalify.recipes.kernel_layout`) are read as that array, the two
    outputs swapped, so that no transposed copy of the source is made first."""
    x = rebalance_drift(x, fp8_cast_window(exact_in(x.data) or x.dtype, dtype))
    src = transpose_of(x.data) if x.ndim == 2 else None
    if src is not None:
        qt, q = cast_transpose_p.bind(_narrowed(src), dtype=dtype, split=1)
    else:
        q, qt = cast_transpose_p.bind(_narrowed(x.data), dtype=dtype, split=split)
    if scalar_scale(x):
        return [ScaledArray(q, x.scale), ScaledArray(qt, x.scale)]
    return [ScaledArray(q, x.scale), ScaledArray(qt, lax.transpose(scale_at_rank(x), _perm(x.ndim, split)))]


def cast_transpose(x, dtype, split: int = 1):
    """`(saturating_cast(x, dtype), its transpose)`, the first `split` dims moved last.

    Args:
      x: float array or ScaledArray (its data is cast, its scale kept: transposed alike
        for `q_t` when it is not a single value).
      dtype: the target format (FP8 formats take the fused kernel on a CUDA GPU).
      split: how many leading dims of `x` form the rows of the 2-D view: `q_t` has shape
        `x.shape[split:] + x.shape[:split]`.
    Returns:
      `(q, q_t)`.
    """
    dtype = jnp.dtype(dtype)
    if isinstance(x, ScaledArray):
        q, qt = cast_transpose(x.data, dtype, split)
        scale_t = x.scale if scalar_scale(x) else lax.transpose(scale_at_rank(x), _perm(x.ndim, split))
        return ScaledArray(q, x.scale), ScaledArray(qt, scale_t)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"cast_transpose casts floating-point arrays, got dtype {x.dtype}.")
    if not 0 < split < x.ndim:
        raise ValueError(
            f"cast_transpose: split must be between 1 and x.ndim - 1 = {x.ndim - 1} (how many "
            f"leading dims become the minor ones), got {split} for shape {x.shape}."
        )
    return tuple(cast_transpose_p.bind(x, dtype=dtype, split=int(split)))
