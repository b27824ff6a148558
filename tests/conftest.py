"""Suite-wide settings.

The CPU backend gets 8 host devices (XLA_FLAGS), so the multi-device tests run in the
suite's own processes.

Model-invariance tests compare scalified and plain float32 results to ~1e-6: matmuls must
run in full float32 precision. GPUs default to TF32 for float32 matmuls (10-bit mantissa),
which makes any two differently-shaped or differently-fused computations disagree at
~1e-3; "highest" is a no-op on CPU.
"""
import os

# Eight CPU devices for the multi-device tests (tests/distributed), set before JAX creates
# its CPU backend; single-device computations are unchanged (they run on device 0).
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import pytest  # noqa: E402

import scalify  # noqa: E402


@pytest.fixture
def arguments_as_given():
    """For tests that place data at a chosen scale to check a rule's scale arithmetic: the
    input guard (`ScalifyConfig.input_drift_window`) would first move drifted arguments to
    unit data (same values, other scales)."""
    with scalify.ScalifyConfig(input_drift_window=None):
        yield
