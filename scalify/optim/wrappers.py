"""Wrappers around any optax transformation: its state stored in low precision, or the
whole transformation run on unscaled float32 values (`unscaled`).

`quantized_state(inner, codec)` keeps the state of `inner` encoded between steps and
decodes it to float32 for `inner.update`:

    state_t (stored) --decode--> float32 state --inner.update(g)--> float32 state --encode--> state_t+1

so the update math is exactly the inner transformation's, in float32; only the storage
between steps is compressed. `scaled_state(inner, dtype)` is the case where every float
leaf is a `ScaledArray` of `dtype` with a just-in-time power-of-two scale.

Inside `scalify.scalify(update_fn)` the interpreter sees the ScaledArray leaves as scaled
inputs: the wrapper up-casts their values (`convert_element_type` keeps the scale),
materialises the new values once (`stop_scaling`) to pick the next scale, and returns
them with `set_scaling` so that the scalified update returns ScaledArray leaves again.

`unscaled(inner)` is for a float32 state: it hands `inner` the materialised float32
values of the gradients and params, so inside `scalify` the optimizer is plain JAX.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
import optax

from scalify.core.scaled_array import ScaledArray, is_float
from scalify.ops.scaling import stop_scaling
from scalify.optim.codecs import ScaledCodec, encode_scaled, finite_amax, is_stored_leaf

__all__ = ["QuantizedState", "quantized_state", "scaled_state", "moment_codecs", "values", "unscaled"]

KeyPath = tuple
Codec = Any  # ScaledCodec | BlockwiseCodec | CoatCodec (encode/decode)
CodecSpec = Union[Codec, Callable[[KeyPath, Any], Any]]


class QuantizedState(NamedTuple):
    """State of `quantized_state` and `scaled_state`."""

    inner: Any  # the inner state; selected float leaves stored encoded (e.g. ScaledArray)


def values(tree: Any, dtype=jnp.float32) -> Any:
    """The float leaves of a pytree as plain arrays of `dtype` (float32): stored leaves
    (ScaledArray, BlockwiseArray, CoatArray) materialised, narrower float leaves converted,
    other leaves unchanged. Use it to hand scaled params to code that expects plain arrays
    (models, `optax.MultiSteps`, `optax.masked`), and to differentiate the model with respect
    to float32 values of 16-bit master weights: inside `scalify` a scaled FP16 param is seen
    as its FP16 data, and `values` gives the float32 view whose gradient is float32."""

    def conv(x):
        if is_stored_leaf(x):
            return x.to_array(dtype)
        if hasattr(x, "dtype") and is_float(x) and jnp.dtype(x.dtype).itemsize < jnp.dtype(dtype).itemsize:
            return x.astype(dtype)
        return x

    return jax.tree_util.tree_map(conv, tree, is_leaf=is_stored_leaf)


def unscaled(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Run `inner` on unscaled float32 values: inside `scalify.scalify(update_fn)` the
    optimizer is then plain JAX.

    Its gradients and params arrive as `stop_scaling(x, float32)` (data * scale, one
    multiply that XLA fuses into the optimizer's own kernels), so its state is plain
    float32 and so are the updates it returns; `scalify.optim.apply_updates` adds them to
    scaled master weights. Nothing in the optimizer then carries a scale: no scale
    arithmetic, no input guard on its state between steps (plain arguments are not
    guarded), no power guard on `g * g`. The values are the ones a plain float32 optimizer
    computes: a power-of-two scale is exact in float32, so `data * scale` is the value
    itself for every value in float32's normal range. What the scales no longer protect is
    what a plain float32 optimizer does not protect either: Adam's `g * g` of a gradient
    beyond 2^63 overflows, and below 2^-63 it underflows (where `eps` outweighs it by far).

    Use it when the state is float32 anyway (AdamW with float32 moments), or around
    `scaled_state(..., unscaled_values=True)`: the state is then stored scaled in low
    precision and decoded to plain float32 values for the update.
    """
    def plain(tree):
        def conv(x):
            if is_stored_leaf(x):  # a ScaledArray outside scalify
                return x.to_array(jnp.float32)
            if hasattr(x, "dtype") and is_float(x):
                return stop_scaling(x, jnp.float32)
            return x

        return jax.tree_util.tree_map(conv, tree, is_leaf=is_stored_leaf)

    def init_fn(params):
        return inner.init(plain(params))

    def update_fn(updates, state, params=None, **extra_args):
        return inner.update(plain(updates), state, None if params is None else plain(params), **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _size(x) -> int:
    n = 1
    for d in getattr(x, "shape", ()):
        n *= int(d)
    return n


def _chooser(codec: CodecSpec, min_size: int) -> Callable[[KeyPath, Any], Any]:
    """(path, leaf) -> codec or None, from a codec or a per-leaf function."""
    fn = codec if callable(codec) and not hasattr(codec, "encode") else (lambda p, x: codec)

    def choose(path, leaf):
        if isinstance(leaf, ScaledArray):
            leaf = leaf.data
        if not is_stored_leaf(leaf) and not (hasattr(leaf, "dtype") and is_float(leaf)):
            return None
        if _size(leaf) < min_size:
            return None
        return fn(path, leaf)

    return choose


def moment_codecs(mu: Codec | None = None, nu: Codec | None = None, other: Codec | None = None):
    """A per-leaf codec choice by field name: leaves under a `mu` field (Adam's first
    moment) get `mu`, under `nu` (second moment) get `nu`, other float leaves `other`."""

    def choose(path, leaf):
        del leaf
        names = {getattr(k, "name", None) for k in path}
        if "mu" in names:
            return mu
        if "nu" in names:
            return nu
        return other

    return choose


def quantized_state(
    inner: optax.GradientTransformation, codec: CodecSpec, *, min_size: int = 2
) -> optax.GradientTransformationExtraArgs:
    """Store the state of `inner` encoded with `codec`, decode it to float32 for each update.

    Args:
      inner: any optax transformation (a chain, `inject_hyperparams(...)`, `masked`, ...).
      codec: a codec (`ScaledCodec`, `BlockwiseCodec`, `CoatCodec`) for every float leaf,
        or a function `(key_path, leaf) -> codec | None` choosing per leaf (None: keep).
      min_size: float leaves with fewer elements are kept as they are (scalars such as
        injected hyperparameters, or small tensors as bitsandbytes does with 4096).

    Returns:
      A transformation with state `QuantizedState(inner=...)`. `init` must run outside
      `scalify` (it builds ScaledArray leaves); `update` works in plain JAX, under `jit`
      and inside `scalify.scalify`. Params may be ScaledArray (e.g. FP16 master
      weights) or low-precision: `inner` reads them in float32. ScaledArray updates are
      materialised in float32; plain updates are passed as they are.
    """
    inner = optax.with_extra_args_support(inner)
    choose = _chooser(codec, min_size)

    def encode(tree, stored=None):
        # The scales of the ScaledCodec leaves from their max-abs, one reduction per leaf:
        # XLA computes each new leaf (a moment from the old one and the gradient) inside its
        # reduction and again inside its encode, and writes it only in `dtype`. A variadic
        # reduction over the same-shaped leaves makes XLA:GPU write every new leaf in
        # float32 first and read it back. The scales themselves: one vector per format
        # (`encode_scaled`).
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        likes = treedef.flatten_up_to(stored) if stored is not None else [None] * len(flat)
        out = [x for _, x in flat]
        scaled = []
        for i, ((path, x), like) in enumerate(zip(flat, likes)):
            c = choose(path, x)
            if isinstance(c, ScaledCodec):
                scaled.append((i, c))
            elif c is not None:
                out[i] = c.encode(x, like)
        xs = [stop_scaling(out[i], jnp.float32) for i, _ in scaled]
        news = encode_scaled([c for _, c in scaled], xs, [likes[i] for i, _ in scaled],
                             [finite_amax(x) for x in xs])
        for (i, _), new in zip(scaled, news):
            out[i] = new
        return jax.tree_util.tree_unflatten(treedef, out)

    def decode(stored):
        def dec(path, x):
            c = choose(path, x)
            return x if c is None else c.decode(x)

        return jax.tree_util.tree_map_with_path(dec, stored, is_leaf=is_stored_leaf)

    def init_fn(params):
        # The inner state is usually constant (zeros): without the barrier, XLA constant-
        # folds the quantiser over whole tensors under `jit(init)` (minutes for 20M params).
        state = jax.lax.optimization_barrier(inner.init(values(params)))
        return QuantizedState(inner=encode(state))

    def update_fn(updates, state, params=None, **extra_args):
        new_updates, new_inner = inner.update(
            values(updates), decode(state.inner), values(params), **extra_args
        )
        return new_updates, QuantizedState(inner=encode(new_inner, state.inner))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scaled_state(
    inner: optax.GradientTransformation,
    dtype: Any = jnp.float16,
    *,
    margin: int = 0,
    min_size: int = 2,
    unscaled_values: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Store every float leaf of `inner`'s state as a `ScaledArray` of `dtype`.

    Each leaf gets one power-of-two scale per tensor, recomputed at every update from the
    leaf's finite absolute maximum: `s = 2^ceil(log2(amax / fmax)) * 2^margin`, so the
    stored data lies in `(fmax/2, fmax] / 2^margin` at the top and can never overflow;
    the values are up-cast to float32 for `inner.update`. With FP16 this is the scaled
    FP16 optimizer state of Scalify (Balança et al. 2024, experiment #4): 2 bytes per
    element plus 8 bytes per tensor, i.e. 4 bytes/param for Adam instead of 8.

    Args:
      inner: any optax transformation.
      dtype: storage dtype of the data (float16, bfloat16, float8_e4m3fn, ...), or a
        function `(key_path, leaf) -> dtype | None` choosing per leaf (None: keep as is).
      margin: extra binades of headroom below the format maximum (0 is overflow-free).
      min_size: float leaves with fewer elements are kept as they are (default 2: scalars
        such as injected hyperparameters stay float32 and stay writable).
      unscaled_values: inside `scalify`, hand `inner` the state as plain float32 values
        (`ScaledCodec.unscaled_values`). With `unscaled(scaled_state(inner, ...,
        unscaled_values=True))` the whole optimizer computes in plain float32 and only the
        stored state carries scales (one max-reduction per leaf to encode it).

    Returns:
      An optax transformation; see `quantized_state`.
    """
    if callable(dtype) and not isinstance(dtype, type) and not hasattr(dtype, "itemsize"):
        fn = dtype

        def codec(path, leaf):
            d = fn(path, leaf)
            return None if d is None else ScaledCodec(jnp.dtype(d), margin, unscaled_values)

    else:
        codec = ScaledCodec(jnp.dtype(dtype), margin, unscaled_values)
    return quantized_state(inner, codec, min_size=min_size)
