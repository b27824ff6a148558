"""Reproductions, in direction, on real Adam moments (optim_lm.py: a word-level language
model on WikiText-103 validation text, or the pydoc topics without it, 40 steps of float32
Adam):

- Dettmers et al. 2022 ("8-bit Optimizers via Block-wise Quantization"), the quantisation
  error of Adam's first moment: block-wise dynamic < dynamic (per tensor) < linear.
- Xi et al. 2024 (COAT) Table 1: with E4M3 moments in 1x128 groups, dynamic range
  expansion lowers the error of the update direction m / sqrt(v).

benchmarks/optim_memory.py writes the measured numbers to results/cpu/optim_memory/.
"""
import jax
import jax.numpy as jnp
import numpy as np

import optim_lm
import scalify.optim as so
import scalify.quant as q


def _errors(m, mq):
    m, mq = np.asarray(m, np.float64), np.asarray(mq, np.float64)
    nz = m != 0
    return np.mean(np.abs(mq - m)) / np.mean(np.abs(m)), np.mean(np.abs(mq - m)[nz] / np.abs(m[nz]))


def test_reproductions_on_real_adam_moments():
    """One test: the moments cost a training run, computed once per process."""
    _, moments = optim_lm.adam_moments()

    # 8-bit paper: for the embedding and output-layer first moments, on both the mean
    # absolute error (normalised) and the mean relative error.
    dyn_map = q.dynamic_map(signed=True)
    for m in (moments.mu["emb"], moments.mu["out"]["w"]):
        linear = q.linear_dequantize(*q.linear_quantize(m))
        dynamic = q.dynamic_dequantize(*q.dynamic_quantize(m))
        blockwise = q.blockwise_dequantize(*q.blockwise_quantize(m, dyn_map, 2048), dyn_map, 2048)
        e_lin, e_dyn, e_bw = _errors(m, linear), _errors(m, dynamic), _errors(m, blockwise)
        for i in range(2):
            assert e_bw[i] < e_dyn[i] < e_lin[i], (e_bw, e_dyn, e_lin)

    # COAT Table 1: E4M3 m and v in 1x128 groups, error of the update direction.
    m = jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(moments.mu)])
    v = jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(moments.nu)])
    direction = m / (jnp.sqrt(v) + 1e-8)

    def mse(codec):
        rt = jax.jit(lambda x: codec.decode(codec.encode(x)))
        d = rt(m) / (jnp.sqrt(rt(v)) + 1e-8)
        return float(jnp.mean((d - direction) ** 2))

    plain = mse(so.CoatCodec(expand=False))
    assert mse(so.CoatCodec()) < 0.5 * plain
    assert mse(so.CoatCodec(target_range=q.default_target_range())) < 0.5 * plain
