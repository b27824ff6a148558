"""benchmarks/llama_memory.py on the `tiny` Llama: the memory line from two compiled
sizes predicts the depth, and that depth trains on a state made in its storage formats."""
import gzip
import json

import jax
import numpy as np
import pytest

import scalify.inspect
from benchmarks import llama_memory


def test_deepest_predicts_from_the_memory_line_and_trains(default_matmul_precision):
    size = lambda n: llama_memory._size("tiny", n)  # noqa: E731
    (m1, _), (m2, deep) = (llama_memory.xla_memory("bf16", size(n), None) for n in (1, 2))
    per_layer = m2 - m1
    assert per_layer > 0
    limit = int(m1 + 2.5 * per_layer)  # room for 3 layers, not 4
    rec = llama_memory.deepest("bf16", "tiny", None, (1, 2), steps=2, tries=1, limit=limit)
    assert rec["per_layer_bytes"] == pytest.approx(per_layer) and rec["predicted_layers"] == 3
    (attempt,) = rec["attempts"]
    assert attempt["trained"] and len(attempt["losses"]) == 2 and np.all(np.isfinite(attempt["losses"]))
    assert rec["layers"] == 3 and rec["parameters"] == attempt["parameters"] > 0
    # What holds the temporaries at the peak: the probe's and each attempt's, the largest
    # rows first; the table shows the deepest step's.
    assert rec["probe_peak"] == dict(deep, layers=2) and deep["bytes"] > 0
    sizes = [row[3] for row in attempt["peak"]["live"]]
    assert sizes == sorted(sizes, reverse=True) and all(b >= 0.01 * attempt["peak"]["bytes"] for b in sizes)
    table = llama_memory.markdown([rec], {"preset": "tiny", "batch": 2, "seq": 32, "device_kind": "cpu",
                                          "jax": jax.__version__, "bytes_limit": limit})
    assert "| bf16 |" in table and "| 3 | 3 |" in table
    assert "bf16 at 3 layers: temporaries at their peak" in table


def test_materialized_state_has_the_storage_formats(default_matmul_precision):
    """The FP8 recipe's state, made leaf by leaf: the dtypes and shapes of `init`'s, with
    NaN (no record) statistics, and a step on it gives a finite loss."""
    size = llama_memory._size("tiny", 1)
    model, init, step, batch = llama_memory._parts("fp8-fp16-state", size, None)
    abstract = llama_memory._abstract_state(model, init, size, batch)
    state = llama_memory._materialize(abstract)
    kinds = lambda tree: [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]  # noqa: E731
    assert jax.tree.structure(state) == jax.tree.structure(abstract) and kinds(state) == kinds(abstract)
    assert np.all(np.isnan(np.asarray(state.statistics)))
    _, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))


def test_a_given_depth_skips_the_probes_and_the_file_keeps_every_row(tmp_path, default_matmul_precision):
    """``--layers``: the first attempt at that depth, no probe; the JSON written after each
    attempt holds the earlier variants' rows too. ``--hlo-dir``: the compiled step's text,
    whose replay is the recorded peak."""
    rows = llama_memory.main(["--preset", "tiny", "--limit-gb", "1", "--recipes", "bf16,bf16", "--layers", "1",
                              "--tries", "1", "--out", str(tmp_path), "--hlo-dir", str(tmp_path / "hlo")])
    assert [r["layers"] for r in rows] == [1, 1] and all("probe" not in r for r in rows)
    saved = json.loads((tmp_path / "llama_memory.json").read_text())
    assert len(saved["records"]) == 2
    assert "| bf16 | not probed | - | 1 |" in (tmp_path / "llama_memory.md").read_text()
    with gzip.open(tmp_path / "hlo" / "bf16_1.hlo.gz", "rt") as f:
        assert scalify.inspect.peak_temporaries(f.read()).bytes == rows[0]["attempts"][0]["peak"]["bytes"] > 0


def test_compiler_options_reach_every_compile_and_the_meta(tmp_path, default_matmul_precision):
    """``--compiler-options``: an XLA option (here one that XLA:CPU rejects) reaches the
    probes' compile; a valid one is recorded in the JSON's meta, and a non-object is refused."""
    with pytest.raises(Exception, match="no_such_xla_option"):
        llama_memory.main(["--preset", "tiny", "--limit-gb", "1", "--recipes", "bf16", "--tries", "1",
                           "--compiler-options", '{"no_such_xla_option": true}'])
    llama_memory.main(["--preset", "tiny", "--limit-gb", "1", "--recipes", "bf16", "--layers", "1", "--tries", "1",
                       "--compiler-options", '{"xla_disable_hlo_passes": "algsimp"}', "--out", str(tmp_path)])
    meta = json.loads((tmp_path / "llama_memory.json").read_text())["meta"]
    assert meta["compiler_options"] == {"xla_disable_hlo_passes": "algsimp"}
    with pytest.raises(SystemExit, match="JSON object"):
        llama_memory.main(["--preset", "tiny", "--limit-gb", "1", "--compiler-options", "[1]"])
