"""`fp8_dot_general(recompute_rhs=True)`: the weight's FP8 copy for d(input)'s GEMM is cast
again in the backward pass from the weight, not kept from the forward. The property: the
same bits as keeping it (outputs and both gradients), eagerly and under jit, outside and
inside scalify, at weights across float32's range; and the FP8 copy is no longer among the
values the VJP keeps (the weight is, which the caller holds anyway)."""
from __future__ import annotations

import contextlib
import io

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest

import scalify
from scalify.ops.fp8 import fp8_dot_general

K, N = 64, 128
DN = (((1,), (0,)), ((), ()))


def _operands(scale, dtype):
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (16, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (K, N), jnp.float32) * scale).astype(dtype)
    return x, w


def _loss(recompute, out_dtype=jnp.bfloat16):
    def loss(x, w):
        y = fp8_dot_general(x, w, DN, scaling="static", preferred_element_type=out_dtype,
                            recompute_rhs=recompute)
        return jnp.sum(jnp.square(y.astype(jnp.float32))), y

    return loss


def _value_and_grads(recompute, x, w, jit):
    f = jax.value_and_grad(_loss(recompute), argnums=(0, 1), has_aux=True)
    return (jax.jit(f) if jit else f)(x, w)


def _assert_same_bits(a, b):
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert u.dtype == v.dtype
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("scale, dtype", [(2.0**-30, jnp.float32), (1.0, jnp.float32), (2.0**30, jnp.float32),
                                          (1.0, jnp.float16), (1.0, jnp.bfloat16)])
def test_same_bits_outside_scalify(scale, dtype, jit):
    """Outside scalify the casts saturate at scale 1: weights of 2^30 clamp to E4M3's max
    and of 2^-30 flush to 0, the same way in both passes."""
    x, w = _operands(scale, dtype)
    _assert_same_bits(_value_and_grads(True, x, w, jit), _value_and_grads(False, x, w, jit))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("scale", [2.0**-30, 1.0, 2.0**30])
@pytest.mark.parametrize("data_dtype, data_scale", [(jnp.float16, 1.0), (jnp.float32, 2.0**-20),
                                                    (jnp.bfloat16, 2.0**20)])
def test_same_bits_inside_scalify(data_dtype, data_scale, scale, jit):
    """Inside scalify the weight is a ScaledArray at scale `scale` (a float16 master, or
    float32 / bfloat16 data far from unit max-abs, which the FP8 cast's drift guard places):
    the backward cast takes the forward's guard, so its copy has the same scale and bits."""
    x, w = _operands(data_scale, data_dtype)
    sw = scalify.ScaledArray(w, jnp.float32(scale))

    def run(recompute):
        f = scalify.scalify(jax.value_and_grad(_loss(recompute), argnums=(0, 1), has_aux=True))
        return (jax.jit(f) if jit else f)(x, sw)

    on, off = run(True), run(False)
    _assert_same_bits(on, off)
    assert np.isfinite(np.asarray(scalify.stop_scaling(off[1][1], jnp.float32))).all()
    assert np.any(np.asarray(scalify.stop_scaling(off[1][1], jnp.float32)) != 0)


def _saved(recompute):
    x, w = _operands(1.0, jnp.float32)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(lambda w: _loss(recompute)(x, w)[0], w)
    return out.getvalue()


def test_the_weight_is_kept_instead_of_its_fp8_copy():
    kept = _saved(False)
    assert f"f8_e4m3fn[{K},{N}]" in kept
    recomputed = _saved(True)
    assert f"f8_e4m3fn[{K},{N}]" not in recomputed
    assert f"f32[{K},{N}] from the argument" in recomputed
