"""`experiments.nanogpt.scaling_bench` writes each record as soon as it is measured: a
command stopped during a later measurement (a timeout's kill) keeps the earlier ones in
OUT/scaling.json and OUT/scaling.md."""
import json

import pytest

from experiments.nanogpt import scaling_bench as B

ARGS = ["--model", "tiny", "--gpt", "n_layers=1,d_model=32,n_heads=2", "--seq-len", "16", "--batch-size", "4",
        "--configs", "fp32,bf16", "--devices", "1", "--steps", "1", "--warmup", "1", "--repeats", "1",
        "--loss-steps", "1"]


def test_a_command_stopped_during_its_second_measurement_keeps_the_first(tmp_path, monkeypatch):
    real, calls = B.run_one, []

    def stopped_on_second_call(config, *args):
        calls.append(config)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a kill leaves: no `except Exception` catches it
        return real(config, *args)

    monkeypatch.setattr(B, "run_one", stopped_on_second_call)
    with pytest.raises(KeyboardInterrupt):
        B.main([*ARGS, "--out", str(tmp_path)])
    assert calls == ["fp32", "bf16"]
    records = json.loads((tmp_path / "scaling.json").read_text())["results"]
    assert [(r["config"], r["devices"]) for r in records] == [("fp32", 1)]
    assert records[0]["step_ms"] > 0 and len(records[0]["losses"]) == 1
    assert "| fp32 | none | 1 |" in (tmp_path / "scaling.md").read_text()
