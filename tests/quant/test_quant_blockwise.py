import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalify.quant import (
    blockwise_dequantize,
    blockwise_quantize,
    dynamic_dequantize,
    dynamic_map,
    dynamic_quantize,
    linear_dequantize,
    linear_map,
    linear_quantize,
    quantize_to_codebook,
)


def adam_moments(seed=0, shape=(256, 512), steps=10, b1=0.9, b2=0.999):
    """Adam first/second moments after a few steps on heavy-tailed random gradients
    whose scale varies per row and column (as across the units of a layer)."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.standard_normal((shape[0], 1))) * np.exp(rng.standard_normal((1, shape[1])))
    m = np.zeros(shape)
    v = np.zeros(shape)
    for _ in range(steps):
        g = rng.standard_t(3, shape) * scale * 1e-3
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
    return m.astype(np.float32), v.astype(np.float32)


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_properties(signed):
    q = np.asarray(dynamic_map(signed))
    assert q.shape == (256,) and q.dtype == np.float32
    assert len(np.unique(q)) == 256
    assert np.all(np.diff(q) > 0)
    assert q.min() >= -1 and q.max() == 1.0 and 0.0 in q
    if signed:
        # bitsandbytes: 127 negative, 0, 128 positive values (including 1.0)
        assert (q < 0).sum() == 127 and np.isclose(q.min(), -0.99296875)
        assert np.isclose(np.abs(q[q != 0]).min(), 5.5e-7)
    else:
        assert q.min() == 0.0 and np.isclose(q[1], 3.25e-7)


def test_dynamic_map_matches_bitsandbytes_construction():
    """Spot values of bnb.functional.create_dynamic_map(signed=True): the 10^0 decade
    holds midpoints of linspace(0.1, 1, 65), the 10^-6 decade the single value 0.55e-6."""
    q = np.asarray(dynamic_map(True))
    b = np.linspace(0.1, 1, 65, dtype=np.float32)
    top = (b[:-1] + b[1:]) / 2
    np.testing.assert_array_equal(q[-65:-1], top)
    assert q[127] == 0.0
    np.testing.assert_allclose([q[126], q[128]], [-0.55e-6, 0.55e-6], rtol=1e-6)


def test_linear_map():
    q = np.asarray(linear_map(True))
    assert q.shape == (256,) and q[0] == -1 and q[-1] == 1 and np.all(np.diff(q) >= 0)
    u = np.asarray(linear_map(False))
    np.testing.assert_allclose(np.diff(u), 1 / 255, rtol=1e-4)


def test_quantize_to_codebook_is_nearest():
    q = dynamic_map(True)
    x = np.random.default_rng(0).uniform(-1, 1, 5000).astype(np.float32)
    x[:10] *= 1e-5  # exercise the small decades
    codes = np.asarray(quantize_to_codebook(x, q))
    brute = np.abs(x[:, None] - np.asarray(q)[None, :]).argmin(1)
    qn = np.asarray(q)
    # Same value (ties may pick either neighbour at identical distance).
    np.testing.assert_allclose(np.abs(qn[codes] - x), np.abs(qn[brute] - x), atol=1e-7)


def test_codebook_validation():
    with pytest.raises(ValueError, match="sorted ascending"):
        quantize_to_codebook(np.zeros(3, np.float32), jnp.array([1.0, 0.0]))
    with pytest.raises(ValueError, match="1-D"):
        blockwise_quantize(np.zeros(3, np.float32), jnp.zeros((2, 2)))


@pytest.mark.parametrize(
    "shape, block_size", [((4096,), 2048), ((3, 1000), 2048), ((7, 33), 64), ((5,), 256)], ids=str
)
def test_blockwise_round_trip(shape, block_size):
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    codes, absmax = blockwise_quantize(x, dynamic_map(True), block_size)
    assert codes.dtype == jnp.uint8 and codes.shape == x.shape
    nb = -(-x.size // block_size)
    assert absmax.shape == (nb,) and absmax.dtype == jnp.float32
    flat = np.pad(x.ravel(), (0, nb * block_size - x.size)).reshape(nb, block_size)
    np.testing.assert_array_equal(np.asarray(absmax), np.abs(flat).max(1))
    y = np.asarray(blockwise_dequantize(codes, absmax, dynamic_map(True), block_size))
    assert y.shape == x.shape
    # Dynamic map: relative step <= 1/64 around the largest decade, so for |x| > 0.1*absmax
    # the error is < ~2% of |x|; overall relative L2 error ~1%.
    assert np.linalg.norm(y - x) / np.linalg.norm(x) < 0.02
    blk_max = np.repeat(np.asarray(absmax), block_size)[: x.size].reshape(shape)
    big = np.abs(x) > 0.1 * blk_max
    assert np.all(np.abs(y - x)[big] <= 0.015 * blk_max[big])


def test_blockwise_unsigned_for_second_moment():
    _, v = adam_moments()
    q = dynamic_map(False)
    codes, absmax = blockwise_quantize(v, q, 2048)
    y = np.asarray(blockwise_dequantize(codes, absmax, q, 2048))
    assert np.all(y >= 0)
    assert np.linalg.norm(y - v) / np.linalg.norm(v) < 0.01


def test_blockwise_zero_block_and_jit():
    x = np.zeros((4096,), np.float32)
    x[2048:] = np.linspace(-3, 3, 2048)
    codes, absmax = jax.jit(blockwise_quantize)(x)
    assert float(absmax[0]) == 0.0
    y = np.asarray(blockwise_dequantize(codes, absmax))
    np.testing.assert_array_equal(y[:2048], 0.0)
    with pytest.raises(ValueError, match="same block_size"):
        blockwise_dequantize(codes, absmax, block_size=1024)


def test_tensor_quantizers_round_trip():
    x = np.random.default_rng(2).standard_normal((64, 64)).astype(np.float32)
    for q, dq in [(linear_quantize, linear_dequantize), (dynamic_quantize, dynamic_dequantize)]:
        codes, absmax = q(x)
        assert codes.dtype == jnp.uint8 and codes.shape == x.shape and absmax.shape == ()
        y = np.asarray(dq(codes, absmax))
        assert np.linalg.norm(y - x) / np.linalg.norm(x) < 0.03


@pytest.mark.parametrize("sample", ["adam_m", "student_t", "normal_x_lognormal"])
def test_error_ordering_blockwise_dynamic_linear(sample):
    """Dettmers et al. 2022: block-wise dynamic < dynamic < linear quantisation error on
    heavy-tailed optimizer-state-like tensors."""
    rng = np.random.default_rng(3)
    if sample == "adam_m":
        x, _ = adam_moments(4)
    elif sample == "student_t":
        x = rng.standard_t(3, (256, 512)).astype(np.float32)
    else:
        x = (rng.standard_normal((256, 512)) * np.exp(2 * rng.standard_normal((256, 512)))).astype(np.float32)

    def mae(y):
        return float(np.mean(np.abs(np.asarray(y) - x)))

    e_block = mae(blockwise_dequantize(*blockwise_quantize(x, dynamic_map(True), 2048), dynamic_map(True), 2048))
    e_dyn = mae(dynamic_dequantize(*dynamic_quantize(x)))
    e_lin = mae(linear_dequantize(*linear_quantize(x)))
    assert e_block < e_dyn < e_lin, (e_block, e_dyn, e_lin)
