"""NanoGPT on 8 CPU devices with the explicit data-parallel step of
`experiments/nanogpt/parallel.py`: the whole shard_map is scalified and the gradients are
averaged by `scalify.distributed.scaled_pmean` in E5M2 (1-byte words on the wire)."""
import numpy as np
import pytest

from dist_testing import nanogpt_runs, plain_params, rel_err

FP8 = "dp:e5m2:auto:all_to_all"


def test_fp8_gradient_all_reduce(mesh8):
    """One test (the compiles dominate; pytest-xdist would repeat a shared fixture per
    worker). Reference: the single-device step without scalify (equal to the scalified one
    in float32, tests/e2e; three times faster to compile)."""
    runs = nanogpt_runs(mesh8, ("plain", FP8))
    ref, got = runs["plain"], runs[FP8]
    # The first loss is computed before any update: equal up to float32 summation order.
    np.testing.assert_allclose(got["losses"][0], ref["losses"][0], rtol=1e-6)
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-4)
    for a, b in zip(plain_params(got["state"]), plain_params(ref["state"])):
        # Biases start at 0, so after two steps they are -lr * (sum of gradients): an E5M2
        # gradient (2 mantissa bits) is within 12.5% of the float32 one.
        assert np.all(np.isfinite(np.asarray(a))) and rel_err(a, b) <= 0.125

    n_params = sum(int(np.prod(p.shape)) for p in plain_params(ref["state"]))
    stats = got["stats"]
    assert set(stats["by_dtype"]) == {"u8"}  # all large collectives move 1-byte words
    # all-to-all + all-gather of the 1-byte gradients: 2 * 7/8 bytes per parameter and device
    assert stats["wire_bytes"] == pytest.approx(2 * 7 / 8 * n_params, rel=0.05)
