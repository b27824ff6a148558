"""benchmarks/fp8_attention.py: a shape or kernel the backend refuses (every cuDNN
attention on a CPU) is reported with its error, not raised, and the table is written."""
import json

from benchmarks import fp8_attention


def test_refusals_are_records(tmp_path, monkeypatch):
    monkeypatch.setattr(fp8_attention, "SHAPES", (("mini", 1, 128, 2, 1, 128),))
    (rec,) = fp8_attention.main(["--out", str(tmp_path)])
    assert rec["shape"] == "mini" and rec["heads"] == 2 and rec["kv_heads"] == 1
    for label in ("bf16", "fp8"):
        assert (rec[f"{label}_ms"] is None) == (f"{label}_error" in rec)
    saved = json.loads((tmp_path / "fp8_attention.json").read_text())
    assert saved["records"] == [rec]
    assert "| mini |" in (tmp_path / "fp8_attention.md").read_text()
