"""Run the 8-device tests of this directory in a subprocess when this process has fewer
devices (see conftest.py), so that a whole-suite run really runs them, in groups that
pytest-xdist's workers run side by side."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_testing import FLAG, have_devices

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# Groups of similar length, paired for workers (xdist hands out tests in chunks).
GROUPS = {
    "nanogpt": ["test_dist_nanogpt.py"],
    "api": ["test_dist_api.py", "test_dist_sharding.py"],
    "nanogpt_fp8": ["test_dist_nanogpt_fp8.py"],
    "collectives": ["test_dist_collectives.py", "test_dist_scalify_inside.py"],
    "budget": ["test_collective_budget.py"],
}


@pytest.mark.parametrize("group", list(GROUPS))
def test_8_device_tests_in_subprocess(group):
    if have_devices():
        pytest.skip("this process has 8 devices: the tests ran in it")
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FLAG).strip()
    env["JAX_PLATFORMS"] = "cpu"  # 8 host devices, also on a machine with fewer accelerators
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider", "-p", "no:randomly",
           *[str(HERE / f) for f in GROUPS[group]]]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{out[-6000:]}"
    assert "needs 8 devices" not in out, f"the subprocess did not get 8 devices:\n{out[-3000:]}"
