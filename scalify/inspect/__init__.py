"""Inspecting what scalify produced: compiled XLA programs (`scalify.inspect.hlo`)."""
from scalify.inspect.hlo import (
    FP8_GEMM_TARGET,
    CollectiveOp,
    collective_bytes,
    count_fp8_gemms,
    hlo_instruction_count,
    hlo_op_kinds,
)

__all__ = [
    "FP8_GEMM_TARGET",
    "CollectiveOp",
    "collective_bytes",
    "count_fp8_gemms",
    "hlo_instruction_count",
    "hlo_op_kinds",
]
