"""`benchmarks/collective_neighbours.py`: the kernels right before and after each large
collective of a compiled GPU step, read off cut-down HLO texts: a plain step all-reduces
what its GEMM wrote; a step that casts its values for the wire adds an elementwise pass on
each side."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from collective_neighbours import main, neighbours, summary  # noqa: E402

# The bfloat16 sum every all-reduce below applies, and the wire cast of a float32 gradient
# (times its scale, to bfloat16) that the scaled steps run before their collectives.
BF16_ADD = """%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %r = bf16[] add(%a, %b)
}
"""

TO_WIRE = """%fused_to_wire (p: f32[256,128], s: f32[]) -> bf16[256,128] {
  %p = f32[256,128]{1,0} parameter(0)
  %s = f32[] parameter(1)
  %b = f32[256,128]{1,0} broadcast(%s), dimensions={}
  %m = f32[256,128]{1,0} multiply(%p, %b)
  ROOT %c = bf16[256,128]{1,0} convert(%m)
}
"""

PLAIN = """HloModule jit_plain

%fused_adam (p: bf16[256,128], q: f32[256,128]) -> f32[256,128] {
  %p = bf16[256,128]{1,0} parameter(0)
  %q = f32[256,128]{1,0} parameter(1)
  %c = f32[256,128]{1,0} convert(%p)
  ROOT %s = f32[256,128]{1,0} subtract(%q, %c)
}

""" + BF16_ADD + """
ENTRY %main.1 (x: bf16[64,256], g: bf16[64,128], w: f32[256,128]) -> f32[256,128] {
  %x = bf16[64,256]{1,0} parameter(0)
  %g = bf16[64,128]{1,0} parameter(1)
  %w = f32[256,128]{1,0} parameter(2)
  %custom-call.1 = (bf16[256,128]{1,0}, s8[1024]{0}) custom-call(%x, %g), custom_call_target="__cublas$gemm"
  %get-tuple-element.1 = bf16[256,128]{1,0} get-tuple-element(%custom-call.1), index=0
  %all-reduce-start.1 = bf16[256,128]{1,0} all-reduce-start(%get-tuple-element.1), replica_groups={{0,1}}, to_apply=%add
  %all-reduce-done.1 = bf16[256,128]{1,0} all-reduce-done(%all-reduce-start.1)
  ROOT %loop_subtract_fusion = f32[256,128]{1,0} fusion(%all-reduce-done.1, %w), kind=kLoop, calls=%fused_adam
}
"""

SCALED = """HloModule jit_scaled

""" + TO_WIRE + """
%fused_from_wire (p: bf16[256,128]) -> f32[256,128] {
  %p = bf16[256,128]{1,0} parameter(0)
  %c = f32[256,128]{1,0} convert(%p)
  %h = f32[] constant(0.5)
  %b = f32[256,128]{1,0} broadcast(%h), dimensions={}
  ROOT %m = f32[256,128]{1,0} multiply(%c, %b)
}

%fused_adam (p: f32[256,128], q: f32[256,128]) -> f32[256,128] {
  %p = f32[256,128]{1,0} parameter(0)
  %q = f32[256,128]{1,0} parameter(1)
  ROOT %s = f32[256,128]{1,0} subtract(%q, %p)
}

""" + BF16_ADD + """
ENTRY %main.1 (x: f8e4m3fn[64,256], g: f8e5m2[64,128], s: f32[], w: f32[256,128]) -> f32[256,128] {
  %x = f8e4m3fn[64,256]{1,0} parameter(0)
  %g = f8e5m2[64,128]{1,0} parameter(1)
  %s = f32[] parameter(2)
  %w = f32[256,128]{1,0} parameter(3)
  %custom-call.1 = (f32[256,128]{1,0}, s8[1024]{0}) custom-call(%x, %g), custom_call_target="__cublas$lt$matmul$f8"
  %get-tuple-element.1 = f32[256,128]{1,0} get-tuple-element(%custom-call.1), index=0
  %loop_convert_fusion = bf16[256,128]{1,0} fusion(%get-tuple-element.1, %s), kind=kLoop, calls=%fused_to_wire
  %all-reduce-start.1 = bf16[256,128]{1,0} all-reduce-start(%loop_convert_fusion), replica_groups={{0,1}}, to_apply=%add
  %all-reduce-done.1 = bf16[256,128]{1,0} all-reduce-done(%all-reduce-start.1)
  %loop_multiply_fusion = f32[256,128]{1,0} fusion(%all-reduce-done.1), kind=kLoop, calls=%fused_from_wire
  %all-reduce.2 = f32[] all-reduce(%s), replica_groups={{0,1}}, to_apply=%add
  ROOT %loop_subtract_fusion = f32[256,128]{1,0} fusion(%loop_multiply_fusion, %w), kind=kLoop, calls=%fused_adam
}
"""

N = 256 * 128


def test_plain_all_reduce_reads_the_gemm_output_directly():
    rows = neighbours(PLAIN)
    assert [r["collective"] for r in rows] == ["all-reduce-start.1"]
    assert rows[0]["operand_bytes"] == 2 * N
    assert [k["kind"] for k in rows[0]["before"]] == ["gemm"]
    assert [k["name"] for k in rows[0]["after"]] == ["loop_subtract_fusion"]
    s = summary(rows)
    assert s["before"]["elementwise_bytes"] == 0


def test_wire_cast_shows_as_one_elementwise_pass_on_each_side():
    rows = neighbours(SCALED)
    assert [r["collective"] for r in rows] == ["all-reduce-start.1"]  # the scalar one is below the limit
    before, after = rows[0]["before"], rows[0]["after"]
    assert [(k["name"], k["kind"]) for k in before] == [("loop_convert_fusion", "fusion(convert,multiply)")]
    assert before[0]["read"] == 4 * N + 4 and before[0]["written"] == 2 * N
    assert [(k["name"], k["kind"]) for k in after] == [("loop_multiply_fusion", "fusion(convert,multiply)")]
    s = summary(rows)
    assert s["before"]["elementwise_bytes"] == 6 * N + 4
    assert s["after"]["elementwise_bytes"] == 6 * N
    assert len(neighbours(SCALED, min_elements=1)) == 2


def test_cli_prints_a_table_per_file(tmp_path, capsys):
    for name, text in (("plain.txt", PLAIN), ("scaled.txt", SCALED)):
        (tmp_path / name).write_text(text)
    out = main([str(tmp_path / "plain.txt"), str(tmp_path / "scaled.txt")])
    assert "| before | `gemm` | 1 |" in out
    assert "| after | `fusion(convert,multiply)` | 1 |" in out


BUCKET = """HloModule jit_bucket

""" + TO_WIRE + """
%wrapped_concatenate_computation (a: bf16[32768], b: bf16[32768]) -> bf16[65536] {
  %a = bf16[32768]{0} parameter(0)
  %b = bf16[32768]{0} parameter(1)
  ROOT %c = bf16[65536]{0} concatenate(%a, %b), dimensions={0}
}

%wrapped_slice_computation (p: bf16[65536]) -> bf16[32768] {
  %p = bf16[65536]{0} parameter(0)
  ROOT %s = bf16[32768]{0} slice(%p), slice={[0:32768]}
}

%wrapped_slice_computation.1 (p: bf16[65536]) -> bf16[32768] {
  %p = bf16[65536]{0} parameter(0)
  ROOT %s = bf16[32768]{0} slice(%p), slice={[32768:65536]}
}

""" + BF16_ADD + """
ENTRY %main.1 (x: f8e4m3fn[64,256], g: f8e5m2[64,128], s: f32[]) -> (bf16[32768], bf16[32768]) {
  %x = f8e4m3fn[64,256]{1,0} parameter(0)
  %g = f8e5m2[64,128]{1,0} parameter(1)
  %s = f32[] parameter(2)
  %custom-call.1 = (f32[256,128]{1,0}, s8[1024]{0}) custom-call(%x, %g), custom_call_target="__cublas$lt$matmul$f8"
  %get-tuple-element.1 = f32[256,128]{1,0} get-tuple-element(%custom-call.1), index=0
  %custom-call.2 = (f32[256,128]{1,0}, s8[1024]{0}) custom-call(%x, %g), custom_call_target="__cublas$lt$matmul$f8"
  %get-tuple-element.2 = f32[256,128]{1,0} get-tuple-element(%custom-call.2), index=0
  %loop_convert_fusion = bf16[256,128]{1,0} fusion(%get-tuple-element.1, %s), kind=kLoop, calls=%fused_to_wire
  %loop_convert_fusion.1 = bf16[256,128]{1,0} fusion(%get-tuple-element.2, %s), kind=kLoop, calls=%fused_to_wire
  %bitcast.1 = bf16[32768]{0} bitcast(%loop_convert_fusion)
  %bitcast.2 = bf16[32768]{0} bitcast(%loop_convert_fusion.1)
  %wrapped_concatenate = bf16[65536]{0} fusion(%bitcast.1, %bitcast.2), kind=kLoop, calls=%wrapped_concatenate_computation
  %all-reduce-start.1 = bf16[65536]{0} all-reduce-start(%wrapped_concatenate), replica_groups={{0,1}}, to_apply=%add
  %all-reduce-done.1 = bf16[65536]{0} all-reduce-done(%all-reduce-start.1)
  %wrapped_slice = bf16[32768]{0} fusion(%all-reduce-done.1), kind=kLoop, calls=%wrapped_slice_computation
  %wrapped_slice.1 = bf16[32768]{0} fusion(%all-reduce-done.1), kind=kLoop, calls=%wrapped_slice_computation.1
  ROOT %tuple = (bf16[32768]{0}, bf16[32768]{0}) tuple(%wrapped_slice, %wrapped_slice.1)
}
"""


def test_combined_bucket_lists_the_concatenation_and_the_wire_casts_behind_it():
    """XLA's collective combiner packs several gradients into one concatenated buffer: the
    wire casts sit behind that concatenation, and the slices after the collective read
    only their part of it."""
    (row,) = neighbours(BUCKET)
    assert [(k["name"], k["kind"]) for k in row["before"]] == [
        ("loop_convert_fusion", "fusion(convert,multiply)"),
        ("loop_convert_fusion.1", "fusion(convert,multiply)"),
        ("wrapped_concatenate", "fusion(concatenate)"),
    ]
    assert all(k["read"] == 4 * N + 4 and k["written"] == 2 * N for k in row["before"][:2])
    assert [(k["kind"], k["read"], k["written"]) for k in row["after"]] == [("fusion(slice)", 2 * N, 2 * N)] * 2
    s = summary([row])
    assert s["before"]["elementwise_bytes"] == 2 * (6 * N + 4) + 8 * N  # two casts, the concatenation
    assert s["after"]["elementwise_bytes"] == 8 * N
