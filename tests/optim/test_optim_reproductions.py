"""Reproductions, in direction, on real Adam moments (optim_lm.py: a word-level language
model on WikiText-103 validation text, 40 steps of float32 Adam):

- Dettmers et al. 2022 ("8-bit Optimizers via Block-wise Quantization"), the quantisation
  error of Adam's first moment: block-wise dynamic < dynamic (per tensor) < linear.
- Xi et al. 2024 (COAT) Table 1: with E4M3 moments in 1x128 groups, dynamic range
  expansion lowers the error of the update direction m / sqrt(v).

benchmarks/optim_memory.py writes the measured numbers to benchmarks/optim_results/.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optim_lm
import scalify.optim as so
import scalify.quant as q


@pytest.fixture(scope="module")
def moments():
    _, state = optim_lm.adam_moments()
    return state


def _errors(m, mq):
    m, mq = np.asarray(m, np.float64), np.asarray(mq, np.float64)
    nz = m != 0
    return np.mean(np.abs(mq - m)) / np.mean(np.abs(m)), np.mean(np.abs(mq - m)[nz] / np.abs(m[nz]))


@pytest.mark.parametrize("leaf", ["emb", "out"])
def test_8bit_paper_blockwise_beats_dynamic_beats_linear(moments, leaf):
    m = moments.mu["emb"] if leaf == "emb" else moments.mu["out"]["w"]
    dyn_map = q.dynamic_map(signed=True)
    linear = q.linear_dequantize(*q.linear_quantize(m))
    dynamic = q.dynamic_dequantize(*q.dynamic_quantize(m))
    blockwise = q.blockwise_dequantize(*q.blockwise_quantize(m, dyn_map, 2048), dyn_map, 2048)
    e_lin, e_dyn, e_bw = _errors(m, linear), _errors(m, dynamic), _errors(m, blockwise)
    for i in range(2):  # mean absolute error (normalised), mean relative error
        assert e_bw[i] < e_dyn[i] < e_lin[i], (e_bw, e_dyn, e_lin)


def test_coat_table1_expansion_lowers_update_error(moments):
    m = jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(moments.mu)])
    v = jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(moments.nu)])
    direction = m / (jnp.sqrt(v) + 1e-8)

    def mse(codec):
        rt = jax.jit(lambda x: codec.decode(codec.encode(x)))
        d = rt(m) / (jnp.sqrt(rt(v)) + 1e-8)
        return float(jnp.mean((d - direction) ** 2))

    plain = mse(so.CoatCodec(expand=False))
    expanded = mse(so.CoatCodec())
    coat_kernel_range = mse(so.CoatCodec(target_range=q.default_target_range()))
    assert expanded < 0.5 * plain
    assert coat_kernel_range < 0.5 * plain
