"""XLA options for compiling a scalified program:

    step = jax.jit(scalify.scalify(update), compiler_options=scalify.compiler_options())

Per program (``jax.jit``'s ``compiler_options``), not process-wide like ``XLA_FLAGS``: the
plain programs of the same process keep XLA's defaults.

``xla_gpu_enable_triton_gemm=False``. A scalified step's weight-gradient matmuls end in
their scale arithmetic (the gradient's power-of-two scale, its guards), and XLA:GPU's
Triton GEMM emitter fuses that scalar epilogue into the GEMM fusion. The epilogues differ
in their parameters from layer to layer, so every layer's fusion is a new autotuning
problem, and XLA compiles many candidate kernels for each. Without Triton GEMMs the
matmuls go to cuBLAS(Lt), which the FP8 GEMMs use anyway: the step compiles in a fraction
of the time. Plain programs gain nothing from the option and keep XLA's default.

``xla_allow_excess_precision=False``. By default XLA may keep a value in a wider type
than the program asks for: it drops a float32 -> float16 -> float32 convert pair, so a
float16 tensor of a scalified step (the residual stream, its gradient) is stored and read
as float32, twice the bytes, when a later rule widens it again for its arithmetic. With
the option off every tensor is stored in the dtype the program gives it, as the scale
rules assume (a float16 value is rounded to float16 once).

XLA reads `xla_gpu_enable_triton_gemm` only on GPU.
"""
from __future__ import annotations

__all__ = ["compiler_options"]


def compiler_options() -> dict[str, bool]:
    """The XLA options for ``jax.jit(..., compiler_options=...)`` of a scalified program
    (a new dict each call)."""
    return {"xla_gpu_enable_triton_gemm": False, "xla_allow_excess_precision": False}
