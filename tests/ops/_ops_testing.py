"""Helpers shared by the tests of scalify/ops."""
from __future__ import annotations

import numpy as np
import pytest

import scalify


def requires(*prims):
    """Skip a test until the scale rules of `prims` are registered (other families)."""
    rules = scalify.registered_rules()
    missing = sorted(p.name for p in prims if p not in rules)
    return pytest.mark.skipif(
        bool(missing), reason=f"scale rules not registered yet for: {', '.join(missing)}"
    )


def data(shape, seed=0, special=False, dtype=np.float32, scale=1.0):
    """Standard normal values (times `scale`), with 0/inf/-inf/nan planted if `special`."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float64) * scale
    if special and x.size >= 8:
        flat = x.reshape(-1)
        flat[[1, 3, 5, 7]] = [0.0, np.inf, -np.inf, np.nan]
    return x.astype(dtype)


def assert_close(got, want, rtol=1e-6, atol=0.0):
    """Relative comparison with the same special values (nan, +-inf, 0) in the same places."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    ok = np.isfinite(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=rtol, atol=atol)
