"""scalify.inspect.hlo: reading compiled programs."""
import jax
import jax.numpy as jnp

from scalify.inspect import count_fp8_gemms, hlo_instruction_count, hlo_op_kinds

HLO = """HloModule m, entry_computation_layout={(f32[8,4]{1,0})->f32[4,8]{1,0}}

FileLocations
1 {file_name_id=1 function_name_id=1 line=2 end_line=2 column=2 end_column=67}

%fused_reduce (p: f32[8,4]) -> f32[] {
  %p = f32[8,4]{1,0} parameter(0)
  %c = f32[] constant(0)
  ROOT %r = f32[] reduce(%p, %c), dimensions={0,1}, to_apply=%max
}
%fused_scale (a: f32[]) -> f32[] {
  ROOT %a = f32[] parameter(0)
}
%fused_mul (a: f32[8,4]) -> f32[128,4] {
  ROOT %a = f32[128,4]{1,0} parameter(0)
}
ENTRY %main (x: f32[8,4]) -> f32[8,4] {
  %x = f32[8,4]{1,0} parameter(0)
  %amax = f32[] fusion(%x), kind=kInput, calls=%fused_reduce
  %s = f32[] fusion(%amax), kind=kLoop, calls=%fused_scale
  %m = f32[128,4]{1,0} fusion(%x), kind=kLoop, calls=%fused_mul
  %g = (f32[8,8]{1,0}, s8[0]{0}) custom-call(%x, %x), custom_call_target="__cublas$lt$matmul$f8"
  %h = (f32[8,8]{1,0}, s8[0]{0}) custom-call(%x, %x), custom_call_target="__cublas$gemm"
  %gemm_fusion_dot.3 = f32[128,4]{1,0} fusion(%x, %m), kind=kCustom, calls=%fused_mul, backend_config={"kind":"__triton_gemm"}
  ROOT %t = f32[4,8]{1,0} transpose(%m), dimensions={1,0}
}
"""


def test_hlo_op_kinds_classifies_each_instruction():
    kinds = hlo_op_kinds(HLO)
    assert kinds == {"amax": "reduce", "s": "scalar", "m": "elementwise", "g": "gemm-fp8",
                     "h": "gemm", "t": "copy", "gemm_fusion_dot.3": "gemm"}


def test_count_fp8_gemms():
    assert count_fp8_gemms(HLO) == 1
    assert count_fp8_gemms('custom_call_target="__cublas$gemm"') == 0


def test_hlo_instruction_count_of_text_and_compiled():
    # 3 + 1 + 1 + 8 instruction lines; headers, the module line and metadata tables are not.
    assert hlo_instruction_count(HLO) == 13
    assert hlo_instruction_count(HLO.replace("%", "")) == 13  # newer XLA prints no '%'
    x = jnp.ones((4, 8))
    small = jax.jit(lambda x: x + 1).lower(x).compile()
    big = jax.jit(lambda x: jnp.sin(x) * 2 + jnp.sum(x)).lower(x).compile()
    assert hlo_instruction_count(small) == hlo_instruction_count(small.as_text()) >= 2
    assert hlo_instruction_count(big) > hlo_instruction_count(small)
