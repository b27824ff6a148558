"""Candidate data paths of a scaled FP8 dot outside scalify, for benchmarks/fp8_gemm.py.

Each pattern computes `dot_general(a * sa, b * sb)` for FP8 operands `a`, `b` and runtime
float32 power-of-two scales `sa`, `sb`, with the signature
`fn(a, b, sa, sb, dimension_numbers, out_dtype)`; pass one as `pattern=` to
`scalify.ops.fp8.scaled_matmul` / `fp8_dot_general` / `scalify.nn.Dense` to measure it.
Which of them XLA fuses into one cuBLASLt FP8 GEMM on Hopper is the question the benchmark
answers; the library keeps the one that reaches the FP8 GEMM in every case,
`alpha_tn` = `scalify.ops.fp8.dot_scaled_tn`.
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jax import lax

from scalify.core.lax_utils import widen
from scalify.ops.fp8 import dot_scaled_tn

F32 = jnp.dtype(jnp.float32)


def _dot(a, b, dn, out_dtype):
    return lax.dot_general(a, b, dn, preferred_element_type=out_dtype)


def dot_dequant_f32(a, b, sa, sb, dn, out_dtype):
    """Upcast each operand to float32 and multiply by its scale, dot, cast the output.
    (XLA's FP8 recipe: fused into one cuBLASLt FP8 GEMM when the operands arrive in FP8.)"""
    a32 = widen(a, F32) * sa.astype(F32)
    b32 = widen(b, F32) * sb.astype(F32)
    return _dot(a32, b32, dn, F32).astype(out_dtype)


def dot_dequant_f32_lhs(a, b, sa, sb, dn, out_dtype):
    """As `dot_dequant_f32` with the product of the scales on the lhs only."""
    a32 = widen(a, F32) * (sa.astype(F32) * sb.astype(F32))
    return _dot(a32, widen(b, F32), dn, F32).astype(out_dtype)


def dot_dequant_bf16(a, b, sa, sb, dn, out_dtype):
    """Upcast to bfloat16 and multiply by the scale, dot (the older recipe; not fused)."""
    bf = jnp.bfloat16
    return _dot(widen(a, bf) * sa.astype(bf), widen(b, bf) * sb.astype(bf), dn, out_dtype)


def dot_alpha_f32(a, b, sa, sb, dn, out_dtype):
    """Raw low-precision dot accumulated in float32, times sa*sb, cast to the output."""
    return (_dot(a, b, dn, F32) * (sa.astype(F32) * sb.astype(F32))).astype(out_dtype)


def dot_alpha_out(a, b, sa, sb, dn, out_dtype):
    """Raw low-precision dot in the output dtype, times sa*sb in the output dtype."""
    return _dot(a, b, dn, out_dtype) * (sa.astype(F32) * sb.astype(F32)).astype(out_dtype)


def dot_raw(a, b, sa, sb, dn, out_dtype):
    """Raw low-precision dot in the output dtype, scales ignored (a reference: exact only
    for unit scales)."""
    del sa, sb
    return _dot(a, b, dn, out_dtype)


FP8_DOT_PATTERNS: dict[str, Callable] = {
    "dequant_f32": dot_dequant_f32,
    "dequant_f32_lhs": dot_dequant_f32_lhs,
    "dequant_bf16": dot_dequant_bf16,
    "alpha_f32": dot_alpha_f32,
    "alpha_out": dot_alpha_out,
    "alpha_tn": dot_scaled_tn,  # the library's data path (contracting-minor FP8 operands)
    "raw": dot_raw,
}
