"""`benchmarks/fp8_speedup_bound.py`: the FP8 step's transposes and copies read off a
compiled GPU program, and the Amdahl bounds from a bench pair."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from fp8_speedup_bound import bound, fp8_traffic, markdown  # noqa: E402

# The ENTRY computation of a compiled XLA:GPU step, as `bench --dump-hlo` writes it (cut down).
HLO = """HloModule jit_step

%fused_convert (p: f16[64,32]) -> f8e4m3fn[64,32] {
  %p = f16[64,32]{1,0} parameter(0)
  ROOT %c = f8e4m3fn[64,32]{1,0} convert(%p)
}

ENTRY %main.1 (x: f16[64,32], w: f8e5m2[16,64]) -> (f16[64,32], f32[]) {
  %x = f16[64,32]{1,0} parameter(0)
  %w = f8e5m2[16,64]{1,0} parameter(1)
  %loop_convert_fusion = f8e4m3fn[64,32]{1,0} fusion(%x), kind=kLoop, calls=%fused_convert
  %input_transpose_fusion = f8e4m3fn[32,64]{1,0} fusion(%loop_convert_fusion), kind=kInput, calls=%fused_convert
  %transpose.3 = f8e5m2[64,16]{1,0} transpose(%w), dimensions={1,0}
  %loop_add_fusion = f16[64,32]{1,0} fusion(%x, %x), kind=kLoop, calls=%fused_convert
  %multi = (f8e4m3fn[8], f16[8]) fusion(%x), kind=kLoop, calls=%fused_convert
  ROOT %t = (f16[64,32]{1,0}, f32[]) tuple(%loop_add_fusion, %loop_add_fusion)
}
"""


def test_fp8_traffic_counts_transposes_and_copies():
    t = fp8_traffic(HLO)
    # two FP8 transposes, each reading and writing its FP8 elements: 2 * 64 * 32 + 2 * 16 * 64
    assert (t["transpose_kernels"], t["transpose_bytes"]) == (2, 2 * 64 * 32 + 2 * 16 * 64)
    # FP8 copies: the cast (64 x 32) and the FP8 member of a multi-output fusion (8);
    # the float16 fusion writes no FP8
    assert (t["copy_kernels"], t["copy_bytes"]) == (2, 64 * 32 + 8)


def _bench(busy_b, gemm_b, busy_f, families_f, step_b=10.0, step_f=8.0):
    def row(config, busy, gemm, families, step):
        return {"config": config, "step_ms_pipelined": step,
                "profile": {"busy_us": busy, "by_category_us": {"gemm": gemm}, "families": families}}

    gemm_f = sum(f["us"] for f in families_f if f["kind"] == "gemm")
    return {"results": [row("bf16", busy_b, gemm_b, [], step_b), row("fp8", busy_f, gemm_f, families_f, step_f)]}


def test_bound_is_amdahl_on_the_gemms_run_in_fp8():
    fams = [{"family": "nvjet_sm90_qqtst_128x128", "kind": "gemm", "us": 200.0},  # FP8 (q: E4M3)
            {"family": "nvjet_sm90_qrtst_128x128", "kind": "gemm", "us": 100.0},  # FP8 (r: E5M2)
            {"family": "nvjet_sm90_tst_256x128", "kind": "gemm", "us": 250.0},    # bfloat16 head
            {"family": "loop_convert_fusion", "kind": "elementwise", "us": 999.0}]
    r = bound(_bench(busy_b=2000.0, gemm_b=850.0, busy_f=1800.0, families_f=fams),
              traffic=dict(transpose_kernels=1, transpose_bytes=2e6, copy_kernels=1, copy_bytes=1.35e6),
              bandwidth_tbs=3.35)
    # bf16 on the GEMMs FP8 runs: 850 - 250 = 600 us; FP8: 300 us; saved 300 us
    assert (r["gemm_baseline_us"], r["gemm_fp8_us"], r["wide_gemm_us"], r["saved_us"]) == (600, 300, 250, 300)
    assert r["bound_zero_overhead"] == pytest.approx(2000 / 1700)
    assert r["bound_all_gemms"] == pytest.approx(2000 / (1700 - 250 * 0.5))
    assert r["floor_us"] == pytest.approx(1.0)  # 3.35e6 bytes at 3.35 TB/s
    assert r["bound_with_traffic"] == pytest.approx(2000 / 1701)
    assert r["measured_busy"] == pytest.approx(2000 / 1800) and r["measured_pipelined"] == pytest.approx(1.25)
    table = markdown(r, "bf16", "fp8", 3.35)
    assert "| bound, zero overhead | 1.176x |" in table and "| bound with that traffic | 1.176x |" in table
