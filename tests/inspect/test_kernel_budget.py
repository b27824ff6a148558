"""`benchmarks/kernel_budget.py`: a scalified step's kernels beyond its plain step's, by
class, and the floors (plain kernels + one kernel per dynamic scale measurement, with and
without the FP8 layout transposes), read off compiled GPU programs (cut-down HLO texts)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from kernel_budget import budget, count, report  # noqa: E402

PLAIN = """HloModule jit_plain

%fused_reduce (p: f32[64,32]) -> f32[] {
  %p = f32[64,32]{1,0} parameter(0)
  %z = f32[] constant(0)
  ROOT %r = f32[] reduce(%p, %z), dimensions={0,1}, to_apply=%add
}

%fused_mul (p: f32[64,32]) -> f32[64,32] {
  %p = f32[64,32]{1,0} parameter(0)
  ROOT %m = f32[64,32]{1,0} multiply(%p, %p)
}

ENTRY %main.1 (x: f32[64,32]) -> (f32[64,32], f32[]) {
  %x = f32[64,32]{1,0} parameter(0)
  %loop_multiply_fusion = f32[64,32]{1,0} fusion(%x), kind=kLoop, calls=%fused_mul
  %input_reduce_fusion = f32[] fusion(%loop_multiply_fusion), kind=kInput, calls=%fused_reduce
  %custom-call.1 = (f32[64,64]{1,0}, s8[1024]{0}) custom-call(%x, %x), custom_call_target="__cublas$lt$matmul"
  ROOT %t = (f32[64,32]{1,0}, f32[]) tuple(%loop_multiply_fusion, %input_reduce_fusion)
}
"""

SCALED = """HloModule jit_scaled

%fused_reduce (p: f32[64,32]) -> f32[] {
  %p = f32[64,32]{1,0} parameter(0)
  %z = f32[] constant(0)
  ROOT %r = f32[] reduce(%p, %z), dimensions={0,1}, to_apply=%max
}

%fused_chain (p: f32[], q: f32[]) -> (s32[], f32[]) {
  %p = f32[] parameter(0)
  %q = f32[] parameter(1)
  %b = s32[] bitcast(%p)
  %m = f32[] multiply(%p, %q)
  ROOT %t = (s32[], f32[]) tuple(%b, %m)
}

%fused_convert (p: f16[64,32]) -> f8e4m3fn[64,32] {
  %p = f16[64,32]{1,0} parameter(0)
  ROOT %c = f8e4m3fn[64,32]{1,0} convert(%p)
}

ENTRY %main.2 (x: f16[64,32], s: f32[]) -> (f16[64,32], f32[]) {
  %x = f16[64,32]{1,0} parameter(0)
  %s = f32[] parameter(1)
  %loop_convert_fusion = f8e4m3fn[64,32]{1,0} fusion(%x), kind=kLoop, calls=%fused_convert
  %input_transpose_fusion = f8e4m3fn[32,64]{1,0} fusion(%loop_convert_fusion), kind=kInput, calls=%fused_convert
  %input_reduce_fusion = f32[] fusion(%x), kind=kInput, calls=%fused_reduce
  %input_reduce_fusion.1 = f32[] fusion(%x), kind=kInput, calls=%fused_reduce
  %input_reduce_fusion.2 = f32[] fusion(%x), kind=kInput, calls=%fused_reduce
  %loop_chain_fusion = (s32[], f32[]) fusion(%input_reduce_fusion, %s), kind=kLoop, calls=%fused_chain
  %custom-call.1 = (f16[64,64]{1,0}, s8[1024]{0}) custom-call(%loop_convert_fusion, %input_transpose_fusion), custom_call_target="__cublas$lt$matmul$f8"
  ROOT %t = (f16[64,32]{1,0}, f32[]) tuple(%x, %input_reduce_fusion)
}
"""


def test_count_classifies_the_kernels_of_the_entry_computation():
    p, s = count(PLAIN), count(SCALED)
    assert (p.total, p.fp8_transposes, p.scalar_reductions, p.scalar_chains) == (3, 0, 1, 0)
    # 7 kernels: the FP8 cast, its transpose, 3 scalar reductions, a scalar (tuple) chain, the GEMM
    assert (s.total, s.fp8_transposes, s.scalar_reductions, s.scalar_chains) == (7, 1, 3, 1)


def test_budget_floors_keep_plain_kernels_and_one_kernel_per_measurement():
    b = budget(count(PLAIN), count(SCALED))
    assert b["extra"] == 4
    # the plain step's own scalar reduction is not charged to the scalified step
    assert (b["fp8_transposes"], b["scale_measurements"], b["scale_chains"]) == (1, 2, 1)
    assert b["rest"] == 0  # the FP8 cast stands in for the plain multiply: same count
    assert (b["floor"], b["floor_tn"]) == (3 + 2, 3 + 2 + 1)
    text = report("scaled", b, goal=1.2)
    assert "| floor: plain + measurements | 5 | 1.67x |" in text
    assert "| floor with the FP8 transposes | 6 | 2.00x |" in text
    assert "the 1.2x goal leaves -2 kernels for the 1 scale chains, the 0 other extra kernels and the 1 FP8 transposes." in text
