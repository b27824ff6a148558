"""Storage formats ("codecs") for optimizer-state leaves and the pytree leaves they produce.

A codec turns a float32 leaf into a compact stored leaf and back:

- `ScaledCodec(dtype)`: a `ScaledArray` of `dtype` with one power-of-two scale per tensor,
  chosen just in time from the leaf's absolute maximum so that nothing overflows
  (FP16 scaled state, paper experiment #4; FP8-LM / MS-AMP moments).
- `BlockwiseCodec(signed)`: 8-bit codes of a dynamic tree codebook with one float32 absmax
  per block of 2048 values (Dettmers et al. 2022) -> `BlockwiseArray`.
- `CoatCodec()`: FP8 E4M3 per group of 128 values with dynamic range expansion
  (Xi et al. 2024, COAT) -> `CoatArray`.

The quantisers themselves live in `scalify.quant`; this module only packs their outputs
into pytree leaves that remember how to decode themselves.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify.core.config import get_config
from scalify.core.pow2 import pow2_fit, pow2_round_down
from scalify.core.scale_flow import cut_scale
from scalify.core.scaled_array import ScaledArray
from scalify.core.lax_utils import stacked_reductions, widen
from scalify.quant.blockwise import blockwise_dequantize, blockwise_quantize, dynamic_map
from scalify.quant.coat import coat_dequantize, coat_quantize
from scalify.quant.formats import format_info
from scalify.ops import cast, set_scaling, stop_scaling
from scalify.ops.custom_scale import custom_scale
from scalify.rules.common import materialize, rescale

__all__ = [
    "ScaledCodec",
    "BlockwiseCodec",
    "CoatCodec",
    "BlockwiseArray",
    "CoatArray",
    "is_stored_leaf",
    "decode",
    "scale_for",
    "finite_amax",
    "at_scales",
    "encode_scaled",
    "round_to_dtype",
]


# ---------------------------------------------------------------------------------------
# Stored leaves
# ---------------------------------------------------------------------------------------
@jax.tree_util.register_pytree_node_class
class BlockwiseArray:
    """An 8-bit block-wise quantised tensor: `x ~= codebook[codes] * absmax[block]`.

    Children: `codes` (uint8, the tensor's shape) and `absmax` (float32, one per block of
    the flattened tensor). Static: `signed` (which dynamic tree codebook) and `block_size`.
    """

    __slots__ = ("codes", "absmax", "signed", "block_size")

    def __init__(self, codes, absmax, signed: bool, block_size: int):
        self.codes = codes
        self.absmax = absmax
        self.signed = signed
        self.block_size = block_size

    def tree_flatten(self):
        return (self.codes, self.absmax), (self.signed, self.block_size)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def shape(self):
        return tuple(self.codes.shape)

    def to_array(self, dtype=jnp.float32):
        """Dequantise to `dtype` (float32 by default)."""
        return blockwise_dequantize(
            self.codes, self.absmax, _codebook(self.signed), self.block_size, dtype=dtype
        )

    def __repr__(self):
        return (
            f"BlockwiseArray(shape={self.shape}, signed={self.signed}, "
            f"block_size={self.block_size})"
        )


@jax.tree_util.register_pytree_node_class
class CoatArray:
    """A COAT-quantised tensor: FP8 `data` with per-group `scale` and expansion exponent `k`.

    `x ~= sign(q) * scale * |q|^(1/k)` per group of `group_size` consecutive elements of
    the flattened tensor (groups over the flattened tensor, as COAT's CUDA kernel does).
    Children: `data` (FP8, the tensor's shape), `scale` and `k` (float32, one per group;
    `k=None` when stored without expansion).
    """

    __slots__ = ("data", "scale", "k", "group_size")

    def __init__(self, data, scale, k, group_size: int):
        self.data = data
        self.scale = scale
        self.k = k
        self.group_size = group_size

    def tree_flatten(self):
        return (self.data, self.scale, self.k), (self.group_size,)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def shape(self):
        return tuple(self.data.shape)

    def to_array(self, dtype=jnp.float32):
        """Dequantise to `dtype` (float32 by default)."""
        flat = coat_dequantize(
            self.data.reshape(-1), self.scale, self.k, self.group_size, dtype=dtype
        )
        return flat.reshape(self.data.shape)

    def __repr__(self):
        return f"CoatArray(shape={self.shape}, dtype={self.data.dtype}, group_size={self.group_size})"


_STORED = (ScaledArray, BlockwiseArray, CoatArray)


def is_stored_leaf(x: Any) -> bool:
    """`is_leaf` predicate: stops at ScaledArray, BlockwiseArray and CoatArray."""
    return isinstance(x, _STORED)


def decode(x: Any, dtype=jnp.float32):
    """The value of a stored leaf in `dtype`; other leaves are returned unchanged."""
    if isinstance(x, _STORED):
        return x.to_array(dtype)
    return x


@functools.cache
def _codebook_np(signed: bool) -> np.ndarray:
    with jax.ensure_compile_time_eval():
        return np.asarray(dynamic_map(signed=signed))


def _codebook(signed: bool):
    # A NumPy constant: embedded in the graph, never a traced value.
    return _codebook_np(signed)


# ---------------------------------------------------------------------------------------
# Scale choice and rounding (plain float32 math)
# ---------------------------------------------------------------------------------------
def finite_amax(x):
    """max |x| over the finite elements of x (0 if none), in float32: one reduction."""
    return _finite_amax_over(x, None)


def _finite_abs(x):
    """|x| in float32 with the non-finite elements as 0."""
    a = jnp.abs(jnp.asarray(x).astype(jnp.float32))
    return jnp.where(jnp.isfinite(a), a, 0.0)


def _finite_amax_over(x, axes):
    return jnp.max(_finite_abs(x), axis=axes, initial=0.0)


def finite_amaxes(xs):
    """`[max |x| over the finite elements of x (0 if none) for x in xs]`, one reduction per
    shape (`stacked_reductions`; a group of mixed float dtypes stacks in their promoted
    dtype, exactly)."""
    return stacked_reductions([jnp.asarray(x) for x in xs], _finite_amax_over, key=np.shape)


def finite_amaxes_variadic(xs):
    """`finite_amaxes` as one variadic reduction per shape and dtype: the arrays of a shape
    are the operands of one `lax.reduce` with one maximum per operand, so XLA reads each
    array once in one kernel and writes no stacked copy (for arrays computed in the step,
    such as an optimizer's new moments, which a stack would materialise). Each array is
    read in its own dtype (16 bits or more; exact: XLA reduces one precision per
    reduction), the maxima returned in float32."""
    mags = [_finite_abs_as_stored(x) for x in xs]
    groups: dict = {}
    for i, m in enumerate(mags):
        groups.setdefault((m.shape, m.dtype), []).append(i)
    out = [None] * len(xs)
    for (shape, _), members in groups.items():
        mags_of = tuple(mags[i] for i in members)
        zeros = tuple(np.zeros((), m.dtype) for m in mags_of)
        maxima = jax.lax.reduce(mags_of, zeros,
                                lambda a, b: tuple(jnp.maximum(u, v) for u, v in zip(a, b)),
                                tuple(range(len(shape))))
        for i, m in zip(members, maxima):
            out[i] = m.astype(jnp.float32)
    return out


def _finite_abs_as_stored(x):
    """|x| with the non-finite elements as 0, in x's dtype if it is a float of 16 bits or
    more (a maximum is exact in any float format), else in float32. Read in its stored
    dtype, an array shares no float32 copy with the other readers of it."""
    x = jnp.asarray(x)
    if not (jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize >= 2):
        return _finite_abs(x)
    a = jnp.abs(x)
    return jnp.where(jnp.isfinite(a), a, jnp.zeros((), a.dtype))


def scale_for(amax, dtype, margin: int = 0):
    """Power-of-two scale that maps `amax` into the top binade of `dtype` without overflow.

    `s = 2^ceil(log2(amax / fmax)) * 2^margin`, so `amax / s` lies in `(fmax/2, fmax]`
    (shifted down `margin` binades). The largest value is stored just below the format's
    maximum and the rest of the format's range (normals and subnormals) covers the small
    values. Exact, on the float32 bits, clipped to `[2^-126, 2^127]`
    (`scalify.core.pow2.pow2_fit` with target `fmax / 2^margin`). Zero, inf or NaN `amax`
    give scale 1.
    """
    return pow2_fit(amax, format_info(dtype).max * 2.0**-margin)


def _uniform(key, shape, salt: int = 0):
    """Uniform [0, 1) float32 from XLA's Philox `RngBitGenerator`, seeded by `key` and
    `salt`: one HLO op (JAX's threefry lowering is many ops)."""
    if jnp.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    kd = jnp.asarray(key, jnp.uint32).reshape(-1)
    extra = jnp.array([salt & 0xFFFFFFFF, 0x9E3779B9], jnp.uint32)
    k4 = jnp.concatenate([kd, extra])[:4] if kd.size < 4 else kd[:4] ^ jnp.concatenate([jnp.zeros(2, jnp.uint32), extra])
    _, bits = jax.lax.rng_bit_generator(k4, shape, dtype=jnp.uint32, algorithm=jax.lax.RandomAlgorithm.RNG_PHILOX)
    return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def round_to_dtype(t, dtype, rounding: str = "nearest", key=None, salt: int = 0):
    """Round float32 `t` to `dtype`: round-to-nearest-even or stochastic rounding.

    Stochastic rounding (`rounding="stochastic"`, needs `key`) rounds up with probability
    equal to the distance to the lower neighbour in units of the spacing of `dtype` at `t`
    (`ulp = 2^(floor(log2|t|) - mantissa_bits)`, at least the smallest subnormal), so
    `E[round(t)] = t`: updates smaller than half a unit in the last place are kept on
    average instead of being rounded away. `t` must be within `dtype`'s range (scale first).
    0, inf and NaN are kept. The random bits come from XLA's Philox generator seeded with
    `key` (a typed or raw JAX PRNG key) and the integer `salt` (e.g. the leaf index).
    """
    dtype = jnp.dtype(dtype)
    t = jnp.asarray(t, jnp.float32)
    if rounding == "nearest":
        return t.astype(dtype)
    if rounding != "stochastic":
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}.")
    if key is None:
        raise ValueError(
            "rounding='stochastic' needs a PRNG key: pass key=jax.random.key(...) (e.g. "
            "jax.random.fold_in(key, step) so that a resumed run draws the same bits)."
        )
    info = format_info(dtype)
    a = jnp.abs(t)
    ulp = jnp.maximum(
        pow2_round_down(a) * jnp.float32(2.0**-info.mantissa_bits), jnp.float32(info.min_subnormal)
    )
    u = _uniform(key, t.shape, salt)
    # floor(a/ulp + u) * ulp is exact in float32: a/ulp < 2^(mantissa_bits+1) <= 2^24.
    r = jnp.floor(a / ulp + u) * ulp
    r = jnp.where(jnp.isfinite(t), jnp.copysign(r, t), t)
    return r.astype(dtype)


# ---------------------------------------------------------------------------------------
# Codecs
# ---------------------------------------------------------------------------------------
def _stop_scaling(x):
    """x as a plain float32 array (materialised inside scalify; a cast outside)."""
    return stop_scaling(x, jnp.float32)


def _set_scaling(x, scale):
    """x with scale `scale` inside scalify; the identity outside."""
    return set_scaling(x, scale)


def _seen_inside_scalify(like) -> bool:
    """Whether a previously stored leaf is a bare array: a ScaledArray's value as the
    scalify interpreter shows it, whose new value is expressed with scaling ops."""
    return like is not None and not isinstance(like, ScaledArray)


def at_scales(values, scales):
    """values[i] represented with the power-of-two scale scales[i] inside scalify (a
    float32 vector, e.g. from `scale_for`, in the scale range); the values unchanged.

    Scaled and unscaled values alike are placed: the vector enters as a scaled value
    (`set_scaling` at scale 1, whose rule runs on unscaled operands too), so the rule runs
    whether or not some value is scaled. Outside scalify, the values."""
    return _at_scales(list(values), set_scaling(scales, np.float32(1.0)))


@custom_scale
def _at_scales(values, scales):
    """`at_scales`' values (its rule places them; the identity on the values outside)."""
    return list(values)


@_at_scales.defscale
def _at_scales_rule(values, scales):
    """out[i] = (values[i].data * (values[i].scale / s_i), s_i), s_i = scales[i]: exact,
    barring under- or overflow of the data. The vector is computed once (`cut_scale`), not
    in every pass that reads one of its elements."""
    s = cut_scale(lax.stop_gradient(materialize(scales, jnp.float32)))
    s = s.astype(get_config().scale_dtype)
    return [ScaledArray(rescale(v, s[i]), s[i]) for i, v in enumerate(values)]


def encode_scaled(codecs, values, likes, amaxes):
    """`[c.encode(x, like, amax=a) for ...]` for `ScaledCodec`s with round-to-nearest.

    Inside scalify (a bare `like`: a stored leaf's value as the interpreter shows it) the
    leaves of one (dtype, margin) get their scales as one vector, `scale_for` of their
    stacked maxima, placed with `at_scales` and cast: the scale arithmetic is traced once
    per group instead of once per leaf. The stored data and scales are those of
    `ScaledCodec.encode`.
    """
    out, groups = [None] * len(values), {}
    for i, (c, x, like, amax) in enumerate(zip(codecs, values, likes, amaxes)):
        if _seen_inside_scalify(like):
            groups.setdefault((jnp.dtype(c.dtype), c.margin), []).append(i)
        else:
            out[i] = c.encode(x, like, amax=amax)
    for (dtype, margin), members in groups.items():
        scales = scale_for(jnp.stack([jnp.asarray(amaxes[i], jnp.float32) for i in members]), dtype, margin)
        placed = at_scales([_stop_scaling(values[i]) for i in members], scales)
        for i, y in zip(members, placed):
            # `scale_for` placed the data in the format's range: a `cast` (scale kept), as
            # in `ScaledCodec.encode`.
            out[i] = cast(y, dtype, saturate=False)
    return out


@dataclasses.dataclass(frozen=True)
class ScaledCodec:
    """Store a leaf as `ScaledArray(data: dtype, scale: float32 power of two)`.

    The scale is recomputed at every encode from the leaf's finite absolute maximum
    (`scale_for`), so the stored data cannot overflow; relative precision is that of
    `dtype` (FP16: 2^-11, E4M3: 2^-4) over the format's whole range below the maximum.
    Bytes per element: `itemsize(dtype)` + 4 per tensor.

    `unscaled_values`: inside `scalify`, decode to the plain float32 value (`data * scale`,
    `stop_scaling`) instead of a float32 value that carries its scale, so that an optimizer
    run on unscaled values (`scalify.optim.unscaled`) computes in plain float32 with no
    scale arithmetic and no guards; the stored form is the same.
    """

    dtype: Any = jnp.float16
    margin: int = 0
    unscaled_values: bool = False

    def encode(self, x, like=None, rounding: str = "nearest", key=None, salt: int = 0, amax=None):
        """Encode float `x`. `like` is the previously stored leaf: if it is a bare array (the
        value of a ScaledArray as seen inside `scalify`), the result is expressed with
        `scalify.ops.set_scaling` so that the interpreter carries the scale. `amax`: x's
        finite absolute maximum when the caller computed it (`finite_amaxes`)."""
        xp = _stop_scaling(x)
        s = scale_for(finite_amax(xp) if amax is None else amax, self.dtype, self.margin)
        if _seen_inside_scalify(like):
            # `scale_for` placed the data x / s in the format's range, so the conversion
            # is a `cast` (scale kept, data converted), not a convert that scalify guards
            # for drift with one more max-reduction over the leaf.
            if rounding == "nearest":
                return cast(_set_scaling(xp, s), self.dtype, saturate=False)
            r = widen(round_to_dtype(xp / s, self.dtype, rounding, key, salt), jnp.float32) * s
            return cast(_set_scaling(r, s), self.dtype, saturate=False)
        return ScaledArray(round_to_dtype(xp / s, self.dtype, rounding, key, salt), s)

    def decode(self, leaf):
        if isinstance(leaf, ScaledArray):
            return leaf.to_array(jnp.float32)
        if self.unscaled_values:  # inside scalify: the plain value
            return _stop_scaling(leaf)
        return leaf.astype(jnp.float32)  # inside scalify: the value, its scale is carried


@dataclasses.dataclass(frozen=True)
class BlockwiseCodec:
    """Store a leaf as 8-bit dynamic-tree codes with a float32 absmax per block
    (Dettmers et al. 2022). `signed=True` for Adam's first moment, `False` for the
    non-negative second moment (the unsigned codebook spends the sign bit on precision).
    Bytes per element: 1 + 4 / block_size."""

    signed: bool = True
    block_size: int = 2048

    def encode(self, x, like=None, rounding: str = "nearest", key=None):
        del like, rounding, key
        xp = _stop_scaling(x)
        codes, absmax = blockwise_quantize(xp, _codebook(self.signed), self.block_size)
        return BlockwiseArray(codes, absmax, self.signed, self.block_size)

    def decode(self, leaf):
        return leaf.to_array(jnp.float32)


@dataclasses.dataclass(frozen=True)
class CoatCodec:
    """Store a leaf as FP8 with per-group (1 x group_size) scales and dynamic range
    expansion `f(x) = sign(x)|x|^k` (Xi et al. 2024). Groups run over the flattened tensor,
    as in COAT's CUDA kernel. Bytes per element: 1 + 8 / group_size (float32 scale and k
    per group; 1 + 4 / group_size with `expand=False`).

    `target_range` is the ratio the expanded group range is stretched to. The default,
    None, is the format's *normal* range `fmax / min_normal` (28672 for E4M3): the group
    maximum maps to `fmax` and the minimum to the smallest normal, both exactly
    representable. COAT's kernel uses `fmax^2 / 2` (`scalify.quant.default_target_range`),
    which maps every group minimum to 2.29 subnormal steps, rounded down to 2 at every
    re-quantisation: the smallest second moment of each group then shrinks by a factor
    (2 / 2.29)^(1/k) per step (12.5% at k = 1), its update grows, and training drifts
    (docs/optimizers.md, "COAT's target range").
    """

    dtype: Any = jnp.float8_e4m3fn
    group_size: int = 128
    expand: bool = True
    target_range: Optional[float] = None

    def encode(self, x, like=None, rounding: str = "nearest", key=None):
        del like, rounding, key
        xp = _stop_scaling(x)
        target = self.target_range
        if target is None:
            info = format_info(self.dtype)
            target = info.max / info.min_normal
        data, scale, k = coat_quantize(
            xp.reshape(-1), self.group_size, self.dtype, expand=self.expand, target_range=target
        )
        return CoatArray(data.reshape(xp.shape), scale, k if self.expand else None, self.group_size)

    def decode(self, leaf):
        return leaf.to_array(jnp.float32)
