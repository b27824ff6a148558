"""Fixtures of the end-to-end tests."""
import jax
import pytest


@pytest.fixture(scope="module")
def default_matmul_precision():
    """JAX's default: with the suite's "highest", XLA:CPU rejects jitted 16-bit dots (float32
    matmuls on CPU are the same either way). Module-scoped, so that module fixtures that
    compile 16-bit steps can use it."""
    old = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", None)
    yield
    jax.config.update("jax_default_matmul_precision", old)
