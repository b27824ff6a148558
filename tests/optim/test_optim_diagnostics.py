"""Bytes per parameter of every variant (exact, from the storage layout) and the
quantisation-error diagnostic."""
import jax
import jax.numpy as jnp
import optax
import pytest

import scalify.optim as so

PARAMS = {
    "w": jax.random.normal(jax.random.key(0), (64, 128)),  # 8192: 4 blocks of 2048, 64 groups
    "b": jnp.zeros((128,)),  # below the 8-bit min_size (4096): float32 moments
    "emb": jax.random.normal(jax.random.key(1), (256, 64)),  # 16384: 8 blocks, 128 groups
}
N = 8192 + 128 + 16384
GRADS = jax.tree.map(lambda p: 1e-3 * jax.random.normal(jax.random.key(2), p.shape), PARAMS)

# name: (transformation, exact state bytes, documented bytes/param)
CASES = {
    "adamw_f32": (lambda: optax.adamw(1e-3), 8 * N + 4, 8.0),
    "fp16_scaled": (lambda: so.scaled_state(optax.adamw(1e-3)), 2 * (2 * N + 3 * 4) + 4, 4.0),
    "fp8lm": (lambda: so.adamw_fp8lm(1e-3), (N + 3 * 4) + (2 * N + 3 * 4) + 4, 3.0),
    "8bit": (lambda: so.adamw_8bit(1e-3), 2 * (24576 + 4 * 12) + 2 * 4 * 128 + 4, 2.0),
    "coat": (lambda: so.adamw_coat(1e-3), 2 * (N + 8 * (64 + 1 + 128)) + 4, 2.0 + 16 / 128),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bytes_per_parameter(name):
    make, exact, documented = CASES[name]
    # The layout (shapes, dtypes) is fixed at init: measured abstractly, no compile.
    state = jax.eval_shape(make().init, PARAMS)
    assert so.tree_nbytes(state) == exact
    assert so.parameter_count(PARAMS) == N
    bpp = so.bytes_per_parameter(state, PARAMS)
    assert bpp == pytest.approx(exact / N)
    assert bpp == pytest.approx(documented, abs=0.05)


def test_bytes_per_parameter_of_master_weights():
    assert so.bytes_per_parameter(PARAMS, PARAMS) == pytest.approx(4.0)
    p16 = so.scaled_params(PARAMS, jnp.float16)
    assert so.bytes_per_parameter(p16, PARAMS) == pytest.approx((2 * N + 12) / N)
    assert so.parameter_count(p16) == N
    with pytest.raises(ValueError, match="no array leaves"):
        so.bytes_per_parameter(p16, {})


def test_quantization_error_and_dequantize_state():
    ref_tx, tx = optax.adamw(1e-3), so.adamw_fp8lm(1e-3)
    ref_update = jax.jit(ref_tx.update)
    ref = ref_update(GRADS, ref_tx.init(PARAMS), PARAMS)[1]
    state = jax.jit(tx.update)(GRADS, jax.jit(tx.init)(PARAMS), PARAMS)[1]
    deq = so.dequantize_state(state)
    assert jax.tree.structure(deq) == jax.tree.structure(ref)
    err = so.quantization_error(state, ref)
    assert 0 < err.rel_l2 < 0.05 and err.max_abs > 0
    assert set(err.per_leaf) == {f"[0].{m}['{k}']" for m in ("mu", "nu") for k in PARAMS}
    assert so.quantization_error(ref, ref).rel_l2 == 0.0
    with pytest.raises(ValueError, match="different structures"):
        so.quantization_error(state, ref[0])
    later = ref_update(GRADS, ref, PARAMS)[1]
    with pytest.raises(ValueError, match="not at the same step"):
        so.quantization_error(state, later)
