"""Tests of scalify across devices, on 8 CPU devices.

XLA reads `--xla_force_host_platform_device_count` when JAX first creates its CPU backend;
tests/conftest.py sets it for the whole suite (and this file when it is collected first).
Where the default backend has fewer than 8 devices anyway (a machine with one GPU), the
tests needing 8 devices skip here and `test_dist_subprocess.py` runs them in a subprocess
on 8 CPU devices; where this process has them, the subprocess runner is deselected (the
tests ran here).
"""
import os
import sys

FLAG = "--xla_force_host_platform_device_count=8"

if "jax" not in sys.modules and FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from dist_testing import N_DEVICES, SKIP_REASON, have_devices  # noqa: E402


@pytest.fixture(scope="session")
def mesh8():
    """Mesh ("data",) over 8 devices."""
    if not have_devices():
        pytest.skip(SKIP_REASON)
    return Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))


@pytest.fixture(scope="session")
def mesh42():
    """Mesh ("data", "model") of shape (4, 2)."""
    if not have_devices():
        pytest.skip(SKIP_REASON)
    return Mesh(np.array(jax.devices()[:N_DEVICES]).reshape(4, 2), ("data", "model"))


def pytest_collection_modifyitems(config, items):
    """Run the 8-device tests once: here when this process has 8 devices, else in the
    subprocess runner."""
    if not have_devices():
        return
    runner = [it for it in items if it.nodeid.split("::")[0].endswith("test_dist_subprocess.py")]
    if runner:
        config.hook.pytest_deselected(items=runner)
        items[:] = [it for it in items if it not in runner]
