"""`experiments.nanogpt.scaling_bench --processes N`: the data-parallel step run as a
multi-process job (one CPU device per process, `jax.distributed` with gloo collectives)
gives the one-device losses and writes one record for the N-process run."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--model", "tiny", "--gpt", "n_layers=1,d_model=32,n_heads=2", "--seq-len", "16", "--batch-size", "8",
        "--configs", "fp8", "--steps", "1", "--warmup", "1", "--repeats", "1", "--loss-steps", "3"]


def _bench(out, *extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "experiments.nanogpt.scaling_bench", *ARGS, "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-4000:]}"


def test_two_process_data_parallel_step_matches_one_device(tmp_path):
    _bench(tmp_path, "--devices", "2", "--processes", "2", "--meshes", "dp:bfloat16")
    _bench(tmp_path, "--devices", "1")  # the reference, merged into the same records
    records = json.loads((tmp_path / "scaling.json").read_text())["results"]
    two = [r for r in records if r["devices"] == 2]
    assert len(two) == 1 and two[0]["processes"] == 2 and two[0]["mesh"] == "dp:bfloat16", two
    r = two[0]
    assert "error" not in r and r["loss_finite"] and len(r["losses"]) == 3
    # every dynamic scale is taken on the process's own batch: roundings differ, values agree
    assert r["loss_max_rel_diff"] <= 1e-4, r["losses"]
    assert r["comm"]["count"] == 1 and r["comm"]["by_op"].keys() == {"all-reduce"}, r["comm"]
    assert "2 (2 processes)" in (tmp_path / "scaling.md").read_text()
