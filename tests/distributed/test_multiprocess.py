"""The NanoGPT example as a multi-process job (`--processes N`: one CPU device per process,
`jax.distributed` with gloo collectives): `scaling_bench` gives the one-device losses and
writes one record for the N-process run; `train` with the FSDP step, stopped and resumed
from its checkpoint across processes, logs the losses of one process over the same devices.

The commands with `--processes N` run their `main` in this process, which starts the N
processes (`parallel.launch`, as the command's own process does) with the environment
`_env` sets; a command of one process runs here (the one-device reference) or, where it
needs another device count, in a subprocess of its own."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from experiments.nanogpt import scaling_bench
from experiments.nanogpt import train as T

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--model", "tiny", "--gpt", "n_layers=1,d_model=32,n_heads=2", "--seq-len", "16", "--batch-size", "8",
        "--configs", "fp8", "--steps", "1", "--warmup", "1", "--repeats", "1", "--loss-steps", "3"]


def _env(environ):
    """The environment of the processes a command starts: CPU, and the suite's compilation
    cache (conftest.py), so that a run that compiles what an earlier one did (the resumed
    run) loads its executables."""
    env = dict(environ, JAX_PLATFORMS="cpu")
    env.pop("PYTEST_XDIST_WORKER", None)
    if os.environ.get("SCALIFY_TESTS_XLA_CACHE"):
        env.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["SCALIFY_TESTS_XLA_CACHE"])
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def _launching(monkeypatch):
    """This process's environment as `_env` makes it and the checkout as its directory, for
    the processes that `main` starts with `--processes N` (restored after the test)."""
    monkeypatch.chdir(ROOT)
    env = _env(os.environ)
    for name in set(os.environ) - set(env):
        monkeypatch.delenv(name)
    for name, value in env.items():
        if os.environ.get(name) != value:
            monkeypatch.setenv(name, value)


def _run(module, args, devices):
    """`python -m module *args` with `devices` simulated CPU devices, the suite's other XLA
    flags kept."""
    env = _env(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    cmd = [sys.executable, "-m", module, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-4000:]}"


def _bench(out, *extra):
    return scaling_bench.main([*ARGS, "--out", str(out), *extra])


def test_two_process_data_parallel_step_matches_one_device(tmp_path, monkeypatch):
    _launching(monkeypatch)
    _bench(tmp_path, "--devices", "2", "--processes", "2", "--meshes", "dp:bfloat16",
           "--comm-min-elements", "2")
    # the reference, merged into the same records; JAX's default matmul precision, as the
    # command's own process has it (tests/conftest.py asks for "highest")
    with jax.default_matmul_precision(None):
        _bench(tmp_path, "--devices", "1")
    records = json.loads((tmp_path / "scaling.json").read_text())["results"]
    two = [r for r in records if r["devices"] == 2]
    assert len(two) == 1 and two[0]["processes"] == 2 and two[0]["mesh"] == "dp:bfloat16", two
    r = two[0]
    assert "error" not in r and r["loss_finite"] and len(r["losses"]) == 3
    # every dynamic scale is taken on the process's own batch: roundings differ, values agree
    assert r["loss_max_rel_diff"] <= 1e-4, r["losses"]
    # the compiled step's collectives of 2 elements or more: its one gradient all-reduce
    assert r["comm"]["count"] == 1 and r["comm"]["by_op"].keys() == {"all-reduce"}, r["comm"]
    assert "2 (2 processes)" in (tmp_path / "scaling.md").read_text()


TRAIN = ["--config", "fp8", "--steps", "4", "--batch-size", "4", "--seq-len", "16",
         "--gpt", "n_layers=1,d_model=32,n_heads=2", "--tokenizer", "byte", "--eval-every", "2", "--eval-batches", "1",
         "--log-every", "1", "--mesh", "fsdp:e4m3:bfloat16", "--no-progress", "--no-plots", "--no-scales"]


def _rows(out):
    return [json.loads(line) for line in (out / "fp8" / "metrics.jsonl").read_text().splitlines()]


def test_train_two_processes_fsdp_resumed_logs_the_losses_of_one_process(tmp_path, monkeypatch):
    multi, single = tmp_path / "multi", tmp_path / "single"
    _launching(monkeypatch)
    T.main([*TRAIN, "--processes", "2", "--stop-at", "2", "--out", str(multi)])
    T.main([*TRAIN, "--processes", "2", "--resume", "--out", str(multi)])
    _run("experiments.nanogpt.train", [*TRAIN, "--out", str(single)], devices=2)
    a, b = _rows(multi), _rows(single)
    assert [(r["step"], r["split"]) for r in a] == [(r["step"], r["split"]) for r in b]
    assert len(a) == 6  # 4 train rows, 2 evaluations
    # The same program over the same two devices, the state gathered and restored exactly;
    # but the gloo all-reduce of two processes sums the two devices' float32 partial sums in
    # another order than XLA's in-process all-reduce, so a loss may differ by float32
    # rounding (a few ulps: 5.537832260 against 5.537832737 is one). rtol 1e-6 is about 8
    # ulps of float32 (2^-23 = 1.2e-7), far below any difference a wrong state would make.
    np.testing.assert_allclose([r["loss"] for r in a], [r["loss"] for r in b], rtol=1e-6, atol=0)
    summary = json.loads((multi / "fp8" / "summary.json").read_text())
    assert (summary["processes"], summary["devices"]) == (2, 2)
    assert "--process-id" not in summary["command"]
