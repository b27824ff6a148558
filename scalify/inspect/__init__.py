"""Inspecting what scalify produced: the scale health of a step (`scalify.inspect.health`)
and compiled XLA programs (`scalify.inspect.hlo`)."""
from scalify.inspect.health import EquationHealth, ScaleHealth, scale_health
from scalify.inspect.hlo import (
    FP8_GEMM_TARGET,
    CollectiveOp,
    collective_bytes,
    count_fp8_gemms,
    hlo_instruction_count,
    hlo_op_kinds,
    hlo_op_sources,
    PeakTemporaries,
    peak_temporaries,
    runs_fp8_gemms,
    source_label,
    xla_memory,
)

__all__ = [
    "EquationHealth",
    "ScaleHealth",
    "scale_health",
    "FP8_GEMM_TARGET",
    "CollectiveOp",
    "collective_bytes",
    "count_fp8_gemms",
    "hlo_instruction_count",
    "hlo_op_kinds",
    "hlo_op_sources",
    "PeakTemporaries",
    "peak_temporaries",
    "runs_fp8_gemms",
    "source_label",
    "xla_memory",
]
