"""`benchmarks/collective_overlap.py`: where each large asynchronous collective of a
scheduled GPU step starts, how many GEMMs run while it is in flight, and which kernels feed
more than one collective, read off a cut-down HLO text."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from collective_overlap import main, overlap  # noqa: E402

# Two weight-gradient GEMMs; one multi-output fusion casts a small gradient of each layer
# (it reads both layers' reductions), and each layer's bucket concatenates its GEMM output
# with one output of that fusion: both buckets wait for it. The first bucket's all-reduce
# is in flight while the second GEMM runs.
HLO = """HloModule jit_step

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %r = bf16[] add(%a, %b)
}

%fused_casts (p: f32[1024], q: f32[1024]) -> (bf16[1024], bf16[1024]) {
  %p = f32[1024]{0} parameter(0)
  %q = f32[1024]{0} parameter(1)
  %c = bf16[1024]{0} convert(%p)
  %d = bf16[1024]{0} convert(%q)
  ROOT %t = (bf16[1024]{0}, bf16[1024]{0}) tuple(%c, %d)
}

%wrapped_concatenate_computation (p: bf16[262144], q: bf16[1024]) -> bf16[263168] {
  %p = bf16[262144]{0} parameter(0)
  %q = bf16[1024]{0} parameter(1)
  ROOT %c = bf16[263168]{0} concatenate(%p, %q), dimensions={0}
}

ENTRY %main.1 (x: f8e4m3fn[64,512], g: f8e5m2[64,512], r1: f32[1024], r2: f32[1024]) -> (bf16[263168], bf16[263168]) {
  %x = f8e4m3fn[64,512]{1,0} parameter(0)
  %g = f8e5m2[64,512]{1,0} parameter(1)
  %r1 = f32[1024]{0} parameter(2)
  %r2 = f32[1024]{0} parameter(3)
  %loop_convert_fusion = (bf16[1024]{0}, bf16[1024]{0}) fusion(%r1, %r2), kind=kLoop, calls=%fused_casts
  %get-tuple-element.1 = bf16[1024]{0} get-tuple-element(%loop_convert_fusion), index=0
  %get-tuple-element.2 = bf16[1024]{0} get-tuple-element(%loop_convert_fusion), index=1
  %cublas-gemm.1 = (bf16[512,512]{1,0}, s8[1024]{0}) custom-call(%x, %g), custom_call_target="__cublas$lt$matmul$f8"
  %get-tuple-element.3 = bf16[512,512]{1,0} get-tuple-element(%cublas-gemm.1), index=0
  %bitcast.1 = bf16[262144]{0} bitcast(%get-tuple-element.3)
  %wrapped_concatenate = bf16[263168]{0} fusion(%bitcast.1, %get-tuple-element.1), kind=kLoop, calls=%wrapped_concatenate_computation
  %all-reduce-start = bf16[263168]{0} all-reduce-start(%wrapped_concatenate), replica_groups={{0,1}}, to_apply=%add
  %cublas-gemm.2 = (bf16[512,512]{1,0}, s8[1024]{0}) custom-call(%x, %g), custom_call_target="__cublas$lt$matmul$f8"
  %get-tuple-element.4 = bf16[512,512]{1,0} get-tuple-element(%cublas-gemm.2), index=0
  %bitcast.2 = bf16[262144]{0} bitcast(%get-tuple-element.4)
  %wrapped_concatenate.1 = bf16[263168]{0} fusion(%bitcast.2, %get-tuple-element.2), kind=kLoop, calls=%wrapped_concatenate_computation
  %all-reduce-done = bf16[263168]{0} all-reduce-done(%all-reduce-start)
  %all-reduce-start.1 = bf16[263168]{0} all-reduce-start(%wrapped_concatenate.1), replica_groups={{0,1}}, to_apply=%add
  %all-reduce-done.1 = bf16[263168]{0} all-reduce-done(%all-reduce-start.1)
  ROOT %t = (bf16[263168]{0}, bf16[263168]{0}) tuple(%all-reduce-done, %all-reduce-done.1)
}
"""


def test_gemms_in_flight_and_shared_feeders():
    s = overlap(HLO, min_elements=1 << 16)
    assert s["gemms"] == 2
    rows = {r["name"]: r for r in s["collectives"]}
    assert set(rows) == {"all-reduce-start", "all-reduce-start.1"}
    first, second = rows["all-reduce-start"], rows["all-reduce-start.1"]
    assert (first["gemms_before"], first["gemms_in_flight"]) == (1, 1)
    assert (second["gemms_before"], second["gemms_in_flight"]) == (2, 0)
    # The multi-output cast fusion feeds both buckets; each GEMM and concatenation one.
    assert first["feeders_shared"] == second["feeders_shared"] == ["loop_convert_fusion"]


def test_size_limit_and_report(tmp_path):
    assert overlap(HLO, min_elements=1 << 20)["collectives"] == []
    path = tmp_path / "step.txt"
    path.write_text(HLO)
    text = main([str(path), "--min-elements", "1024"])
    assert "2 GEMM kernels" in text and "1 of them with GEMMs in flight" in text
    assert "the first starts after 1 of the GEMMs" in text and "`loop_convert_fusion`" in text
