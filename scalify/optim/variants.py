"""AdamW with low-precision moments, as in the literature.

Each variant is `optax.adamw` (same math, in float32, same hyperparameters and defaults)
whose moments are stored between steps in a compact format by `quantized_state`, so its
decoded state has exactly the structure of `optax.adamw`'s (compare them with
`scalify.optim.quantization_error`).

| variant          | first moment m                | second moment v               | bytes/param (state) |
|------------------|-------------------------------|-------------------------------|---------------------|
| `optax.adamw`    | float32                       | float32                       | 8                   |
| `scaled_state`   | FP16, per-tensor pow2 scale   | FP16, per-tensor pow2 scale   | 4                   |
| `adamw_fp8lm`    | E4M3, per-tensor pow2 scale   | FP16, per-tensor pow2 scale   | 3                   |
| `adamw_8bit`     | 8-bit dynamic tree, 2048-block| 8-bit unsigned tree, 2048-block| 2 + 4/1024         |
| `adamw_coat`     | E4M3, 1x128 groups, expansion | E4M3, 1x128 groups, expansion | 2 + 16/128          |

Master weights are separate (see `scalify.optim.scaled_params` / `apply_updates`): FP16
scaled master weights add 2 bytes/param (FP8-LM's "3 + 2").
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import jax.numpy as jnp
import optax

from scalify.optim.codecs import BlockwiseCodec, CoatCodec, ScaledCodec
from scalify.optim.wrappers import moment_codecs, quantized_state

__all__ = ["adamw_fp8lm", "adamw_8bit", "adamw_coat"]

ScalarOrSchedule = Union[float, Callable[[Any], Any]]
MaskOrFn = Optional[Union[Any, Callable[[Any], Any]]]


def _adamw(learning_rate, b1, b2, eps, eps_root, weight_decay, mask, nesterov):
    return optax.adamw(
        learning_rate,
        b1=b1,
        b2=b2,
        eps=eps,
        eps_root=eps_root,
        weight_decay=weight_decay,
        mask=mask,
        nesterov=nesterov,
    )


def adamw_fp8lm(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    weight_decay: float = 1e-4,
    mask: MaskOrFn = None,
    *,
    nesterov: bool = False,
    mu_dtype=jnp.float8_e4m3fn,
    nu_dtype=jnp.float16,
    margin: int = 0,
    min_size: int = 2,
) -> optax.GradientTransformationExtraArgs:
    """AdamW with an FP8 first moment and an FP16 second moment, each with a per-tensor
    power-of-two scale (FP8-LM: Peng et al. 2023, "FP8-LM: Training FP8 Large Language
    Models", Sec. 2.3; MS-AMP level O2).

    `m` is stored in E4M3 (relative precision 2^-4, 17 binades below its maximum) and `v`
    in FP16 (2^-11): the update direction `m / sqrt(v)` tolerates a coarse `m` but `v`,
    which squares the gradient's dynamic range, needs more. Scales are chosen just in time
    from each tensor's absolute maximum (no overflow). Use with FP16 scaled master weights
    (`scaled_params(params, jnp.float16)` + `apply_updates`) for the paper's 3 + 2 bytes.

    Args:
      learning_rate ... nesterov: as `optax.adamw`.
      mu_dtype, nu_dtype: storage dtypes of the two moments.
      margin: binades of headroom below the format maximum.
      min_size: leaves with fewer elements stay float32.

    Returns:
      An optax transformation; state bytes/param: 1 + 2 (+ 8 bytes per tensor).
    """
    codec = moment_codecs(mu=ScaledCodec(jnp.dtype(mu_dtype), margin), nu=ScaledCodec(jnp.dtype(nu_dtype), margin))
    inner = _adamw(learning_rate, b1, b2, eps, eps_root, weight_decay, mask, nesterov)
    return quantized_state(inner, codec, min_size=min_size)


def adamw_8bit(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    weight_decay: float = 1e-4,
    mask: MaskOrFn = None,
    *,
    nesterov: bool = False,
    block_size: int = 2048,
    min_size: int = 4096,
) -> optax.GradientTransformationExtraArgs:
    """AdamW with 8-bit block-wise dynamic quantised moments (Dettmers et al. 2022, "8-bit
    Optimizers via Block-wise Quantization", ICLR 2022; bitsandbytes `AdamW8bit`).

    Each moment tensor is split into blocks of `block_size` (2048) values; each block keeps
    its absolute maximum in float32 and 8-bit indices into a dynamic tree codebook (signed
    for `m`, unsigned for `v`), dequantised to float32 for the update and re-quantised with
    the new block maxima. Block-wise normalisation isolates outliers to their block, and the
    dynamic codebook spends its codes log-uniformly, so small moments keep their precision.
    As in bitsandbytes, tensors with fewer than `min_size` (4096) elements keep float32
    moments; pair embeddings with `scalify.optim.StableEmbedding` as the paper recommends.

    Returns:
      An optax transformation; state bytes/param: 2 + 8/block_size (+ small tensors at 8).
    """
    codec = moment_codecs(mu=BlockwiseCodec(True, block_size), nu=BlockwiseCodec(False, block_size))
    inner = _adamw(learning_rate, b1, b2, eps, eps_root, weight_decay, mask, nesterov)
    return quantized_state(inner, codec, min_size=min_size)


def adamw_coat(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    weight_decay: float = 1e-4,
    mask: MaskOrFn = None,
    *,
    nesterov: bool = False,
    dtype=jnp.float8_e4m3fn,
    group_size: int = 128,
    expand: bool = True,
    min_size: int = 2,
) -> optax.GradientTransformationExtraArgs:
    """AdamW with FP8 moments, per-group scales and dynamic range expansion (Xi et al. 2024,
    "COAT: Compressing Optimizer States and Activation for Memory-Efficient FP8 Training").

    Both moments are stored in E4M3, in groups of `group_size` (128) consecutive values of
    the flattened tensor. A group's values span only a small part of E4M3's range; COAT
    expands them with `f(x) = sign(x)|x|^k`, `k` chosen per group so the group's
    max/min ratio fills the format (`scalify.quant.coat_quantize`), which lowers the error
    of `m / sqrt(v)` (COAT Table 1). `expand=False` gives plain per-group scaling.

    Returns:
      An optax transformation; state bytes/param: 2 + 16/group_size (float32 scale and k
      per group per moment; 2 + 8/group_size without expansion).
    """
    c = CoatCodec(jnp.dtype(dtype), group_size, expand)
    inner = _adamw(learning_rate, b1, b2, eps, eps_root, weight_decay, mask, nesterov)
    return quantized_state(inner, moment_codecs(mu=c, nu=c), min_size=min_size)
