"""8-bit block-wise dynamic quantisation (Dettmers et al. 2022, "8-bit Optimizers via
Block-wise Quantization", ICLR 2022; reference implementation: bitsandbytes).

The tensor is flattened, padded with zeros to a multiple of ``block_size`` and split into
blocks; each block ``b`` is normalised by its absmax ``N_b = max |x_b|`` and every value
is mapped to the index of the nearest value of a 256-entry codebook ``Q`` in [-1, 1]::

    code_i = argmin_j |Q_j - x_i / N_b|          x_i ~= Q[code_i] * N_b

``dynamic_map`` builds the *dynamic tree* codebook (Dettmers 2016, "8-Bit Approximations
for Parallelism in Deep Learning"): a sign bit, a run of zero bits giving a decimal
exponent ``10^-e`` (e = 0..6), an indicator bit, and the remaining bits a linear fraction
in [0.1, 1]; the unsigned variant spends the sign bit on the fraction (used for Adam's
second moment). ``linear_map`` is the uniform baseline.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from scalify.quant._jit import eager_jit

__all__ = [
    "dynamic_map",
    "linear_map",
    "quantize_to_codebook",
    "blockwise_quantize",
    "blockwise_dequantize",
    "linear_quantize",
    "linear_dequantize",
    "dynamic_quantize",
    "dynamic_dequantize",
]


def dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> jax.Array:
    """Dynamic tree quantisation codebook, sorted ascending (bitsandbytes ``create_dynamic_map``).

    For exponent ``i = 0..max_exponent_bits-1`` the fraction has
    ``n_i = 2^(i + nsb - max_exponent_bits)`` values (twice that when unsigned; ``nsb =
    total_bits - 1``), the midpoints of ``linspace(0.1, 1, n_i + 1)``, scaled by
    ``10^(i - (max_exponent_bits - 1))`` and mirrored for the sign; plus 0 and 1.
    Signed: 256 values in [-0.9930, 1]; unsigned: 256 values in [0, 1]. Smallest nonzero
    magnitude: ``5.5e-7`` (signed), ``3.25e-7`` (unsigned).
    """
    return jnp.asarray(_dynamic_map_np(bool(signed), int(max_exponent_bits), int(total_bits)))


@functools.lru_cache(maxsize=None)
def _dynamic_map_np(signed: bool, max_exponent_bits: int, total_bits: int) -> np.ndarray:
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        n = 2 ** (i + non_sign_bits - max_exponent_bits + (0 if signed else 1))
        bounds = np.linspace(0.1, 1.0, n + 1, dtype=np.float32)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2.0)
        vals = np.float32(10.0 ** (-(max_exponent_bits - 1) + i)) * means  # float32, as bnb
        data += vals.tolist()
        if signed:
            data += (-vals).tolist()
    if additional_items > 0:
        bounds = np.linspace(0.1, 1.0, additional_items + 1, dtype=np.float32)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2.0)
        vals = means  # bnb reuses the last loop exponent, 10^0
        data += vals.tolist()
        if signed:
            data += (-vals).tolist()
    data += [0.0, 1.0]
    if len(data) != 2**total_bits:
        raise ValueError(
            f"dynamic_map(signed={signed}, max_exponent_bits={max_exponent_bits}, "
            f"total_bits={total_bits}) yields {len(data)} values, not {2**total_bits}; "
            "use max_exponent_bits <= total_bits - 1."
        )
    data += [0.0] * (256 - len(data))
    return np.sort(np.asarray(data, np.float32))


def linear_map(signed: bool = True) -> jax.Array:
    """Uniform 8-bit codebook, sorted: 255 values ``linspace(-1, 1, 255)`` plus a second
    zero (signed, symmetric around an exact 0), or ``linspace(0, 1, 256)`` (unsigned)."""
    if signed:
        v = np.linspace(-1.0, 1.0, 255, dtype=np.float32)
        v = np.sort(np.concatenate([v, np.zeros(1, np.float32)]))
    else:
        v = np.linspace(0.0, 1.0, 256, dtype=np.float32)
    return jnp.asarray(v)


def _check_codebook(codebook) -> jax.Array:
    codebook = jnp.asarray(codebook, jnp.float32)
    if codebook.ndim != 1 or not 2 <= codebook.shape[0] <= 256:
        raise ValueError(
            f"codebook must be 1-D with 2..256 entries (indexable by uint8), got shape "
            f"{codebook.shape}."
        )
    if not isinstance(codebook, jax.core.Tracer):
        c = np.asarray(codebook)
        if np.any(np.diff(c) < 0):
            raise ValueError(
                "codebook must be sorted ascending (codes index it directly); pass "
                "jnp.sort(codebook)."
            )
    return codebook


def quantize_to_codebook(x: jax.Array, codebook: jax.Array) -> jax.Array:
    """Index (uint8) of the nearest entry of a sorted ``codebook`` for each element of ``x``.

    Uses binary search (``jnp.searchsorted``) over the midpoints between consecutive
    codebook entries: O(n log 256) work and O(n) memory, no n x 256 broadcast. Ties go to
    the lower entry.
    """
    codebook = _check_codebook(codebook)
    mid = (codebook[1:] + codebook[:-1]) * 0.5
    idx = jnp.searchsorted(mid, jnp.asarray(x, jnp.float32), side="left")
    return idx.astype(jnp.uint8)


def _absmax_or_one(a: jax.Array) -> jax.Array:
    # An all-zero block normalises by 1 (codes then all point at the zero entry).
    return jnp.where(a > 0, a, 1.0)


def blockwise_quantize(
    x: jax.Array, codebook: jax.Array | None = None, block_size: int = 2048
) -> tuple[jax.Array, jax.Array]:
    """Block-wise absmax quantisation into ``(codes, absmax)``.

    Args:
      x: any-shape floating array.
      codebook: sorted 1-D codebook in [-1, 1] (default ``dynamic_map(signed=True)``;
        use ``dynamic_map(signed=False)`` for non-negative tensors such as Adam's ``v``).
      block_size: elements per block of the flattened tensor (2048 in the paper).

    Returns:
      ``codes``: uint8 with ``x``'s shape; ``absmax``: float32 of shape
      ``(ceil(x.size / block_size),)``. The last block is zero-padded.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}.")
    codebook = dynamic_map(True) if codebook is None else _check_codebook(codebook)
    return _blockwise_quantize(jnp.asarray(x), codebook, block_size)


@eager_jit(static_argnames=("block_size",))
def _blockwise_quantize(x, codebook, block_size):
    n = x.size
    nb = max(1, -(-n // block_size))
    flat = jnp.pad(x.reshape(-1).astype(jnp.float32), (0, nb * block_size - n))
    blocks = flat.reshape(nb, block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    codes = quantize_to_codebook(blocks / _absmax_or_one(absmax)[:, None], codebook)
    return codes.reshape(-1)[:n].reshape(x.shape), absmax


def blockwise_dequantize(
    codes: jax.Array,
    absmax: jax.Array,
    codebook: jax.Array | None = None,
    block_size: int = 2048,
    dtype=jnp.float32,
) -> jax.Array:
    """Inverse of :func:`blockwise_quantize`: ``x_i = codebook[code_i] * absmax[block(i)]``."""
    codebook = dynamic_map(True) if codebook is None else _check_codebook(codebook)
    codes = jnp.asarray(codes)
    absmax = jnp.asarray(absmax, jnp.float32)
    n = codes.size
    nb = max(1, -(-n // block_size))
    if absmax.shape != (nb,):
        raise ValueError(
            f"absmax has shape {absmax.shape} but {n} codes in blocks of {block_size} need "
            f"({nb},); pass the same block_size as to blockwise_quantize."
        )
    return _blockwise_dequantize(codes, absmax, codebook, block_size, dtype)


@eager_jit(static_argnames=("block_size", "dtype"))
def _blockwise_dequantize(codes, absmax, codebook, block_size, dtype):
    n = codes.size
    nb = max(1, -(-n // block_size))
    flat = jnp.pad(codes.reshape(-1), (0, nb * block_size - n))
    vals = jnp.take(codebook, flat.astype(jnp.int32)).reshape(nb, block_size) * absmax[:, None]
    return vals.reshape(-1)[:n].reshape(codes.shape).astype(dtype)


@eager_jit
def _tensor_quantize(x, codebook):
    x = jnp.asarray(x)
    absmax = jnp.max(jnp.abs(x.astype(jnp.float32))) if x.size else jnp.float32(0)
    codes = quantize_to_codebook(x.astype(jnp.float32) / _absmax_or_one(absmax), codebook)
    return codes, absmax


@eager_jit(static_argnames=("dtype",))
def _lookup(codes, absmax, codebook, dtype):
    return (jnp.take(codebook, jnp.asarray(codes).astype(jnp.int32)) * absmax).astype(dtype)


def linear_quantize(x: jax.Array, signed: bool = True) -> tuple[jax.Array, jax.Array]:
    """Per-tensor linear 8-bit quantisation: nearest of ``linear_map(signed)`` after
    dividing by the tensor absmax. Returns ``(codes uint8, absmax scalar float32)``."""
    return _tensor_quantize(x, linear_map(signed))


def linear_dequantize(codes, absmax, signed: bool = True, dtype=jnp.float32) -> jax.Array:
    """Inverse of :func:`linear_quantize`."""
    return _lookup(codes, absmax, linear_map(signed), dtype)


def dynamic_quantize(x: jax.Array, signed: bool = True) -> tuple[jax.Array, jax.Array]:
    """Per-tensor dynamic tree quantisation (one absmax for the whole tensor, no blocks).
    Returns ``(codes uint8, absmax scalar float32)``."""
    return _tensor_quantize(x, dynamic_map(signed))


def dynamic_dequantize(codes, absmax, signed: bool = True, dtype=jnp.float32) -> jax.Array:
    """Inverse of :func:`dynamic_quantize`."""
    return _lookup(codes, absmax, dynamic_map(signed), dtype)
