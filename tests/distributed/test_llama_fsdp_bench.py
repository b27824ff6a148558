"""benchmarks/llama_fsdp.py on 2 of the 8 CPU devices: a record per variant, the ratios
against bf16 and against one device, the collectives counted."""
import json

from benchmarks import llama_fsdp


def test_llama_fsdp_bench_writes_related_records(tmp_path, mesh8):
    common = ["--size", "tiny", "--batch", "4", "--warmup", "1", "--steps", "1", "--repeats", "1",
              "--out", str(tmp_path)]
    llama_fsdp.main(common + ["--variants", "bf16,fp8", "--devices", "2"])
    llama_fsdp.main(common + ["--variants", "bf16", "--devices", "1"])
    doc = json.loads((tmp_path / "llama_fsdp.json").read_text())
    by = {(r["variant"], r["devices"]): r for r in doc["records"]}
    assert set(by) == {("bf16", 2), ("fp8", 2), ("bf16", 1)}
    for r in by.values():
        assert r["loss_finite"] and r["step_ms"] > 0
    two = by[("bf16", 2)]
    assert two["comm"]["count"] > 0 and by[("bf16", 1)]["comm"]["count"] == 0
    assert abs(two["speedup"] - by[("bf16", 1)]["step_ms"] / two["step_ms"]) < 1e-9
    assert abs(by[("fp8", 2)]["vs_bf16"] - two["step_ms"] / by[("fp8", 2)]["step_ms"]) < 1e-9
    assert by[("fp8", 2)]["speedup"] is None  # no one-device fp8 record
    assert "| fp8 | 2 (1) |" in (tmp_path / "llama_fsdp.md").read_text()
