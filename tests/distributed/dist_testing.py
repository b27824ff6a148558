"""Shared helpers of the 8-device tests (a module with a unique name: test directories are
not packages, so `import conftest` could find another directory's conftest)."""
import jax

N_DEVICES = 8
FLAG = f"--xla_force_host_platform_device_count={N_DEVICES}"
SKIP_REASON = (f"needs {N_DEVICES} devices; JAX was initialised before tests/distributed/conftest.py "
               "could set XLA_FLAGS, so test_dist_subprocess.py runs these tests in a subprocess")


def have_devices() -> bool:
    return jax.device_count() >= N_DEVICES
