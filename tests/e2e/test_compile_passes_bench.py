"""benchmarks/compile_passes.py on the `tiny` Llama (CPU): a record per variant and depth,
XLA's host events of the compile summed by name, the table and the JSON."""
import json

from benchmarks import compile_passes


def test_records_hold_the_compile_events_and_the_table_each_row(tmp_path, default_matmul_precision):
    rows = compile_passes.main(["--preset", "tiny", "--variants", "bf16", "--layers", "1,2", "--min-s", "0",
                                "--out", str(tmp_path)])
    assert [(r["variant"], r["layers"]) for r in rows] == [("bf16", 1), ("bf16", 2)]
    for r in rows:
        assert r["compile_s"] > 0 and r["trace_lower_s"] > 0
        # the backend's compile is an event of the profile, inside the measured wall time
        backend = r["events"]["backend_compile_and_load"]
        assert backend["n"] == 1 and 0 < backend["s"] <= r["compile_s"]
        assert not any(name.startswith("$") for name in r["events"])  # Python frames left out
    assert rows[1]["hlo_instructions"] > rows[0]["hlo_instructions"]
    saved = json.loads((tmp_path / "compile_passes.json").read_text())
    assert saved["records"] == json.loads(json.dumps(rows))
    table = (tmp_path / "compile_passes.md").read_text()
    assert table.count("\n| bf16 | ") == 2 and "multi_output_fusion s" in table
