"""Activations saved for the backward pass in FP8 with fine-grained scales (COAT).

In training, the tensors autodiff keeps for the backward pass ("residuals") dominate
activation memory. COAT (Xi et al. 2024, "COAT: Compressing Optimizer States and
Activation for Memory-Efficient FP8 Training", ICLR 2025, Sec. 5) stores them in FP8 with
a *mixed granularity*:

- inputs of linear layers: per-tensor scaling (they feed FP8 GEMMs already; here the
  just-in-time power-of-two scale of Perez et al. 2023, `scalify.ops.fp8.fp8_scale`);
- inputs of non-linear layers (LayerNorm, GELU/SiLU, softmax): per-group scaling, one
  scale per group of `G` consecutive elements along the last (hidden) axis, never across
  tokens (G = 16 or 128), each group quantised with its own absmax.

The forward pass is computed as usual, in full precision; only what is *kept for the
backward* changes. A wrapped function `f' = save_in_fp8(f, spec)` has

    forward:   y = f(x, *params)                  (exactly f's output)
               saved = quantize_saved(x, spec)    (FP8 data + scales), params kept as is
    backward:  x~ = dequantize_saved(saved)       (the FP8 value of x)
               dx, dparams = vjp(f, x~, *params)(dy)

so nothing of `f`'s internals is saved. The backward evaluates `f`'s own VJP at the
dequantised input: for elementwise functions (GELU) this is the usual backward (the
derivative is computed from x); for a normalisation it re-derives the row statistics
(mean, variance: one fused reduction) from x~; no matmul is ever recomputed (an unused
primal output of the VJP is dead code). `fp8_saved_attention` has an explicit backward
that saves the softmax probabilities (per group along the key axis) and q, k, v (per
tensor) and recomputes nothing.

Per-group scales are powers of two stored as E8M0 (1 byte per group, `scale_format=
"e8m0"`, via `scalify.quant.mx_quantize(..., scale_rounding="ceil")`: nothing saturates)
or COAT's float32 `absmax / fmax` (`"float32"`, via `scalify.quant.coat_quantize(...,
expand=False)`). Per-tensor scales are float32 powers of two. Storage per element:
1 byte of FP8 + (1 or 4 bytes) / G of scales.

A `ResidualPolicy` says, per layer type ("linear", "norm", "activation",
"attention_qkv", "attention_probs"), which saved tensors are FP8 and at which
granularity; `ResidualPolicy.parse("coat")` etc. give the presets of `POLICIES`.

Memory accounting (units of batch x seq x hidden x 2 bytes): see docs/fp8_activations.md.

Scalify: the quantiser and the dequantiser are `custom_scale` functions. Inside
`scalify`, the quantiser works on the data of a ScaledArray (a per-tensor power-of-two
scale commutes with the group absmax, so the FP8 values are the same as outside) and the
group scales carry the tensor's scale: `dequantize_saved` returns the data in its own
dtype with the tensor's scale back. Both `scalify(jax.grad(f))` (the NanoGPT step) and
`jax.grad(scalify(f))` work.

Why an `optimization_barrier` around the saved tensors: without it, XLA may fuse the
(elementwise) quantisation into its consumer in the backward pass, which then reads the
full-precision input, kept alive until the backward: the FP8 copy would never exist and
no memory would be saved.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify.core.config import get_config
from scalify.core.lax_utils import widen
from scalify.core.scaled_array import ScaledArray, is_float
from scalify.ops.custom_scale import custom_scale
from scalify.ops.fp8 import E4M3, amax, fp8_scale, quantize
from scalify.quant.coat import coat_dequantize, coat_quantize
from scalify.quant.e8m0 import E8M0
from scalify.quant.formats import is_fp8
from scalify.quant.mx import mx_dequantize, mx_quantize
from scalify.rules.common import materialize, scalar_of, scalar_scale

__all__ = [
    "SaveSpec",
    "SavedTensor",
    "ResidualPolicy",
    "POLICIES",
    "LAYER_TYPES",
    "PER_TENSOR",
    "GROUP16",
    "GROUP128",
    "PROBS_BOUND",
    "quantize_saved",
    "dequantize_saved",
    "save_in_fp8",
    "fp8_saved_gelu",
    "fp8_saved_layer_norm",
    "fp8_saved_dense",
    "fp8_saved_attention",
    "fp8_saved_module_call",
    "residual_bytes",
]

_F32 = jnp.dtype(jnp.float32)
_SCALE_FORMATS = {"e8m0": E8M0, "float32": _F32}


# ---------------------------------------------------------------------------------------
# What a saved tensor is stored as
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SaveSpec:
    """How one saved tensor is stored.

    Attributes:
      dtype: the storage format (E4M3 by default; any float dtype works, e.g. E5M2).
      group_size: None for one scale per tensor; G for one scale per group of G
        consecutive elements along the last axis (never across rows/tokens).
      scale_format: per-group scales as "e8m0" (powers of two, 1 byte per group; the
        group absmax lands in (fmax/2, fmax], nothing saturates) or "float32" (COAT:
        absmax / fmax, 4 bytes per group). Per-tensor scales are float32 powers of two.
      margin: per-tensor only: binades of headroom below the format's max (the margin of
        `scalify.ops.fp8.fp8_scale`).
      amax_bound: per-tensor only: a known bound on |x| (1 for softmax probabilities). The
        scale then comes from the bound, `fp8_scale(amax_bound)`, with no reduction over the
        tensor (the quantisation is one elementwise convert that XLA fuses into the
        producer, as FlashAttention-3 does for P in FP8); values above it saturate.
    """

    dtype: Any = E4M3
    group_size: int | None = None
    scale_format: str = "e8m0"
    margin: int = 0
    amax_bound: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        if not jnp.issubdtype(self.dtype, jnp.floating):
            raise ValueError(f"SaveSpec.dtype must be a float format, got {self.dtype}.")
        if self.group_size is not None:
            if int(self.group_size) < 1:
                raise ValueError(f"SaveSpec.group_size must be None or >= 1, got {self.group_size}.")
            object.__setattr__(self, "group_size", int(self.group_size))
        if self.amax_bound is not None:
            if self.group_size is not None:
                raise ValueError("SaveSpec.amax_bound is per tensor: use it with group_size=None.")
            if not (math.isfinite(self.amax_bound) and self.amax_bound > 0):
                raise ValueError(f"SaveSpec.amax_bound must be a positive finite number, got {self.amax_bound}.")
            object.__setattr__(self, "amax_bound", float(self.amax_bound))
        if self.scale_format not in _SCALE_FORMATS:
            raise ValueError(
                f"SaveSpec.scale_format must be one of {sorted(_SCALE_FORMATS)}, got "
                f"{self.scale_format!r}."
            )

    @property
    def per_tensor(self) -> bool:
        return self.group_size is None

    def bytes_per_element(self, n_last: int | None = None) -> float:
        """Storage bytes per element: the format's bytes + the scales' share (per-group)."""
        b = self.dtype.itemsize
        if self.per_tensor:
            return float(b)
        scale_b = _SCALE_FORMATS[self.scale_format].itemsize
        g = self.group_size
        if n_last is not None:
            return b + scale_b * math.ceil(n_last / g) / n_last
        return b + scale_b / g

    def __str__(self) -> str:
        fmt = "e4m3" if self.dtype == E4M3 else self.dtype.name
        gran = "tensor" if self.per_tensor else f"g{self.group_size}"
        extra = "" if self.per_tensor or self.scale_format == "e8m0" else ":float32"
        if self.margin:
            extra += f":margin{self.margin}"
        if self.amax_bound is not None:
            extra += f":bound{self.amax_bound:g}"
        return f"{fmt}:{gran}{extra}"

    @classmethod
    def parse(cls, text: str) -> "SaveSpec | None":
        """From "tensor", "g16", "g128", "e5m2:g16", "g16:float32", ... ("none": None).

        Tokens (any order, separated by ":"): a granularity ("tensor" or "gN"), a format
        ("e4m3", "e5m2", or a dtype name), a scale format ("e8m0", "float32"),
        "marginN" (per-tensor headroom), "boundX" (per tensor, a known bound X on |x|).
        """
        text = text.strip().lower()
        if text in ("none", "", "keep"):
            return None
        kw: dict = {}
        for tok in text.split(":"):
            if tok == "tensor":
                kw["group_size"] = None
            elif tok.startswith("g") and tok[1:].isdigit():
                kw["group_size"] = int(tok[1:])
            elif tok in _SCALE_FORMATS:
                kw["scale_format"] = tok
            elif tok in ("e4m3", "e5m2"):
                kw["dtype"] = {"e4m3": E4M3, "e5m2": jnp.float8_e5m2}[tok]
            elif tok.startswith("margin") and tok[6:].lstrip("-").isdigit():
                kw["margin"] = int(tok[6:])
            elif tok.startswith("bound") and _is_number(tok[5:]):
                kw["amax_bound"] = float(tok[5:])
            else:
                try:
                    kw["dtype"] = jnp.dtype(tok)
                except TypeError:
                    raise ValueError(
                        f"Cannot parse {tok!r} in save spec {text!r}: use 'tensor' or 'gN' "
                        "(group size), 'e4m3'/'e5m2', 'e8m0'/'float32' (group scales), "
                        "'marginN', 'boundX', or 'none'."
                    ) from None
        return cls(**kw)


PER_TENSOR = SaveSpec()
GROUP16 = SaveSpec(group_size=16)
GROUP128 = SaveSpec(group_size=128)
# Softmax probabilities lie in [0, 1]: a per-tensor scale from that bound (no reduction).
PROBS_BOUND = SaveSpec(amax_bound=1.0)


class SavedTensor(NamedTuple):
    """A tensor stored for the backward pass: `data` in the spec's format (x's shape) and
    `scale` (per-tensor: a float32 scalar; per-group: `x.shape[:-1] + (n_groups,)`), with
    `x ~= data * scale` (scale repeated over each group)."""

    data: Any
    scale: Any


# ---------------------------------------------------------------------------------------
# Quantise / dequantise (plain arrays), reusing scalify.ops.fp8 and scalify.quant
# ---------------------------------------------------------------------------------------
def _pad_last(x, g):
    n = x.shape[-1]
    pad = -n % g
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x, n


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _quantize_plain(x, spec: SaveSpec, value_scale=None):
    """(data, scale) of x (a plain array) under `spec`; `value_scale` (scalify: the
    tensor scale of x) converts `spec.amax_bound`, a bound on the value, to one on x."""
    if spec.per_tensor or x.ndim == 0:
        # Non-FP8 storage formats (float16, bfloat16) are a plain cast (scale 1).
        if not is_fp8(spec.dtype):
            s = jnp.ones((), _F32)
        elif spec.amax_bound is not None:
            bound = jnp.float32(spec.amax_bound)
            bound = bound if value_scale is None else bound / jnp.asarray(value_scale, _F32)
            s = fp8_scale(bound, spec.dtype, spec.margin)
        else:
            s = fp8_scale(amax(x), spec.dtype, spec.margin)
        return quantize(x, s, spec.dtype), s
    g = spec.group_size
    if spec.scale_format == "float32":
        data, scale, _ = coat_quantize(x, g, spec.dtype, expand=False)
        return data, scale
    xp, n = _pad_last(x, g)
    data, scale = mx_quantize(xp, spec.dtype, g, -1, "ceil")
    return data[..., :n], scale


def _dequantize_plain(data, scale, spec: SaveSpec, dtype):
    """x ~= data * scale in `dtype` (the inverse of `_quantize_plain`)."""
    if spec.per_tensor or data.ndim == 0:
        # widen: XLA's GPU compiler would fold a plain convert pair and skip the rounding.
        return (widen(data, _F32) * scale.astype(_F32)).astype(dtype)
    g = spec.group_size
    if spec.scale_format == "float32":
        return coat_dequantize(data, scale, None, g, dtype)
    dp, n = _pad_last(data, g)
    return mx_dequantize(dp, scale, g, -1, dtype)[..., :n]


_quantize_cs = custom_scale(_quantize_plain, static_argnums=(1,))
_dequantize_cs = custom_scale(_dequantize_plain, static_argnums=(2, 3))


@_quantize_cs.defscale
def _quantize_rule(x: ScaledArray, spec: SaveSpec):
    """quantize_saved(x): on x's data (its power-of-two tensor scale commutes with every
    group absmax, so the FP8 data equals the one of the plain value); data with scale 1,
    the group scales carry x's scale: (ScaledArray(q, 1), ScaledArray(s_data, x.scale)).
    A non-scalar x scale is materialised first (value in float32)."""
    sdtype = get_config().scale_dtype
    if scalar_scale(x):
        d, s = x.data, scalar_of(x.scale)
    else:
        d, s = materialize(x), jnp.ones((), sdtype)
    q, qs = _quantize_plain(d, spec, s)
    return ScaledArray(q, jnp.ones((), sdtype)), ScaledArray(qs, s.astype(sdtype))


@_dequantize_cs.defscale
def _dequantize_rule(q: ScaledArray, qs: ScaledArray, spec: SaveSpec, dtype):
    """dequantize_saved: data = q.data * qs.data in `dtype` (the original data, up to the
    FP8 rounding), scale = q.scale * qs.scale (x's tensor scale back). Non-scalar outer
    scales are folded into the value (scale 1)."""
    sdtype = get_config().scale_dtype
    if scalar_scale(q) and scalar_scale(qs):
        data = _dequantize_plain(q.data, qs.data, spec, dtype)
        s = scalar_of(q.scale).astype(_F32) * scalar_of(qs.scale).astype(_F32)
        return ScaledArray(data, s.astype(sdtype))
    # Per-element outer scales: dequantise the values (group scales as float32).
    qsv = qs.data.astype(_F32) * jnp.asarray(qs.scale).astype(_F32)
    spec32 = spec if spec.per_tensor else dataclasses.replace(spec, scale_format="float32")
    return ScaledArray(_dequantize_plain(materialize(q), qsv, spec32, dtype), jnp.ones((), sdtype))


def quantize_saved(x, spec: SaveSpec = PER_TENSOR) -> SavedTensor:
    """Quantise `x` for storage: FP8 data and per-tensor or per-group scales.

    Per tensor: `s = 2^margin / 2^floor(log2(fmax / amax(x)))` (Perez et al. 2023; a float32
    power of two; `spec.amax_bound` in place of amax(x) when set), `data = saturating_cast(x / s)`. Per group of G along the last axis:
    the group's own absmax gives its scale (E8M0: the smallest power of two with
    absmax / s <= fmax; float32: absmax / fmax, COAT), the last axis is zero-padded to a
    multiple of G for the statistics only. Valid outside and inside `scalify`.

    Args:
      x: float array.
      spec: a `SaveSpec`.
    Returns:
      `SavedTensor(data, scale)`; `dequantize_saved(saved, spec, x.dtype)` inverts it.
    """
    x = jnp.asarray(x) if not isinstance(x, ScaledArray) else x
    data, scale = _quantize_cs(x, spec)
    return SavedTensor(data, scale)


def dequantize_saved(saved: SavedTensor, spec: SaveSpec, dtype) -> jax.Array:
    """The value of a `SavedTensor` in `dtype`: data * scale (scale repeated per group)."""
    return _dequantize_cs(saved.data, saved.scale, spec, jnp.dtype(dtype))


def residual_bytes(shape: Sequence[int], spec: SaveSpec | None, dtype) -> int:
    """Bytes a saved tensor of `shape` takes: `dtype` itself (spec None) or FP8 + scales."""
    n = int(np.prod(shape)) if len(shape) else 1
    if spec is None:
        return n * jnp.dtype(dtype).itemsize
    if spec.per_tensor or not len(shape):
        return n * spec.dtype.itemsize + 4
    last = shape[-1]
    groups = (n // last) * math.ceil(last / spec.group_size)
    return n * spec.dtype.itemsize + groups * _SCALE_FORMATS[spec.scale_format].itemsize


# ---------------------------------------------------------------------------------------
# The generic wrapper: forward as is, backward from the FP8-saved inputs
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _ArgSave:
    """Static description of how one argument is saved (spec None: kept as is)."""

    spec: SaveSpec | None
    dtype: Any


def _barrier(tree):
    return lax.optimization_barrier(tree)


def _is_array(x) -> bool:
    return isinstance(x, ScaledArray) or hasattr(x, "dtype") or isinstance(x, (int, float))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _saved_call(fn, how, *args):
    return fn(*args)


def _saved_call_fwd(fn, how, *args):
    out = fn(*args)
    # Only the quantised inputs go through the barrier (the others are saved as they are).
    res = tuple(
        _barrier(quantize_saved(a, h.spec)) if h.spec is not None else a
        for a, h in zip(args, how)
    )
    return out, res


def _saved_call_bwd(fn, how, res, g):
    args = [
        dequantize_saved(r, h.spec, h.dtype) if h.spec is not None else r for r, h in zip(res, how)
    ]
    _, vjp = jax.vjp(fn, *args)
    cts = vjp(g)
    # Integer inputs have float0 cotangents; None is accepted for "no cotangent".
    return tuple(
        jax.tree_util.tree_map(lambda a, c: None if not is_float(a) else c, a, c)
        for a, c in zip(args, cts)
    )


_saved_call.defvjp(_saved_call_fwd, _saved_call_bwd)


def save_in_fp8(
    fn: Callable,
    spec: SaveSpec | None = GROUP16,
    argnums: int | Sequence[int] = 0,
) -> Callable:
    """`fn` whose inputs `argnums` are saved for the backward pass as `spec` (FP8 + scales).

    The output is exactly `fn(*args)`. Residuals: the quantised inputs `argnums` and the
    other arguments as they are (e.g. parameters, which are alive anyway); none of `fn`'s
    internals. The backward is `jax.vjp(fn)` at the dequantised inputs (see the module
    docstring), so the gradients are those of `fn` at the FP8 value of its inputs.

    Args:
      fn: a function of positional array arguments (pytrees allowed) returning arrays.
      spec: how the inputs `argnums` are stored (None: `fn` unchanged).
      argnums: which positional arguments are saved in FP8 (float arrays).
    Returns:
      The wrapped function (same signature; positional arguments only).
    """
    if spec is None:
        return fn
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(fn)
    def wrapped(*args):
        how = tuple(
            _ArgSave(spec, jnp.result_type(a)) if (i in nums and _is_array(a) and is_float(a))
            else _ArgSave(None, None)
            for i, a in enumerate(args)
        )
        return _saved_call(fn, how, *args)

    return wrapped


# ---------------------------------------------------------------------------------------
# Layer wrappers
# ---------------------------------------------------------------------------------------
def fp8_saved_gelu(x, spec: SaveSpec | None = GROUP16, approximate: bool = True):
    """GELU (as `scalify.ops.gelu`, scale rule included) whose input is saved as `spec`."""
    from scalify.ops.activations import gelu

    return save_in_fp8(functools.partial(gelu, approximate=approximate), spec)(x)


def fp8_saved_layer_norm(x, scale=None, bias=None, spec: SaveSpec | None = GROUP16, *,
                         epsilon: float = 1e-6, dtype=None):
    """LayerNorm `(x - mean) / sqrt(var + epsilon) * scale + bias` over the last axis whose
    input is saved as `spec` (the parameters are kept as they are). Statistics in float32,
    output in `dtype` (default x's)."""
    dtype = jnp.dtype(dtype or jnp.result_type(x))

    def ln(x, scale, bias):
        xf = x.astype(_F32)
        c = xf - jnp.mean(xf, axis=-1, keepdims=True)
        y = c * lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + epsilon)
        y = y.astype(dtype)
        if scale is not None:
            y = y * scale.astype(dtype)
        if bias is not None:
            y = y + bias.astype(dtype)
        return y

    return save_in_fp8(ln, spec)(x, scale, bias)


def fp8_saved_dense(x, kernel, bias=None, spec: SaveSpec | None = PER_TENSOR, *,
                    preferred_element_type=None):
    """`x @ kernel + bias` over the last axis whose input is saved as `spec` (per tensor by
    default: the input of a linear layer). The forward matmul is in x's precision; the
    weight gradient uses the FP8 value of x."""

    def dense(x, kernel, bias):
        y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())),
                            preferred_element_type=preferred_element_type)
        return y if bias is None else y + bias.astype(y.dtype)

    return save_in_fp8(dense, spec)(x, kernel, bias)


def fp8_saved_module_call(module, x, spec: SaveSpec | None):
    """Call a Flax linen module `module(x)` with its input saved as `spec`.

    Use inside a `@nn.compact` method, on a freshly defined submodule (its parameters keep
    their name and path): `y = fp8_saved_module_call(nn.LayerNorm(name="ln"), x, GROUP16)`.
    The residuals are the quantised input and a snapshot of the module's variables; the
    backward is the module's VJP at the dequantised input (Flax `nn.custom_vjp`).
    Only the "params" collection is differentiated; the module must not mutate variables.
    """
    if spec is None:
        return module(x)
    import flax.linen as nn

    x = jnp.asarray(x)
    dtype = x.dtype

    # A detached copy of the module, applied functionally in the backward pass.
    pure = module.clone(parent=None, name=None)

    def f(mdl, x):
        return mdl(x)

    def fwd(mdl, x):
        y = mdl(x)
        return y, (_barrier(quantize_saved(x, spec)), mdl.variables)

    def bwd(residuals, g):
        saved, variables = residuals
        xd = dequantize_saved(saved, spec, dtype)
        params = variables.get("params", {})
        rest = {k: v for k, v in variables.items() if k != "params"}

        def apply(p, x):
            return pure.apply({"params": p, **rest}, x)

        _, vjp = jax.vjp(apply, params, xd)
        p_t, x_t = vjp(g)
        return {"params": p_t}, x_t

    return nn.custom_vjp(f, forward_fn=fwd, backward_fn=bwd)(module, x)


# ---------------------------------------------------------------------------------------
# Attention with FP8-saved q, k, v and softmax probabilities
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _AttnCfg:
    qkv: SaveSpec | None
    probs: SaveSpec | None
    softmax_dtype: Any
    mask_value: float
    dtypes: tuple  # q, k, v dtypes


def _attn_probs(q, k, mask, cfg: _AttnCfg):
    d_head = q.shape[-1]
    qs = q * jnp.asarray(1.0 / math.sqrt(d_head), dtype=q.dtype)
    logits = jnp.einsum("bqhd,bkhd->bhqk", qs, k).astype(cfg.softmax_dtype)
    logits = jnp.where(mask, logits, jnp.asarray(cfg.mask_value, dtype=cfg.softmax_dtype))
    return jax.nn.softmax(logits, axis=-1)


def _attn_forward(q, k, v, mask, cfg):
    p = _attn_probs(q, k, mask, cfg)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v), p


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _saved_attention(q, k, v, mask, cfg):
    return _attn_forward(q, k, v, mask, cfg)[0]


def _save(x, spec):
    return x if spec is None else quantize_saved(x, spec)


def _load(x, spec, dtype):
    return x if spec is None else dequantize_saved(x, spec, dtype)


# `fp8_saved_attention` quantises per-group saved softmax probabilities from a
# materialised p (an XLA fusion boundary): otherwise XLA fuses the group statistics into
# the softmax's own reduction kernel, which then runs slower. Per-tensor specs (one
# elementwise convert) need none.


def _saved_attention_fwd(q, k, v, mask, cfg):
    out, p = _attn_forward(q, k, v, mask, cfg)
    if cfg.probs is not None and not cfg.probs.per_tensor:
        p = _barrier(p)
    res = _barrier((_save(q, cfg.qkv), _save(k, cfg.qkv), _save(v, cfg.qkv), _save(p, cfg.probs)))
    return out, (*res, mask)


def _saved_attention_bwd(cfg, res, g):
    """softmax attention backward from the saved tensors (no recomputation):
    dv = p^T g; dp = g v^T; dlogits = p (dp - rowsum(dp p)) (masked entries have p = 0);
    dq = dlogits k / sqrt(d); dk = dlogits^T q / sqrt(d)."""
    sq, sk, sv, sp, mask = res
    qdt, kdt, vdt = cfg.dtypes
    q, k, v = _load(sq, cfg.qkv, qdt), _load(sk, cfg.qkv, kdt), _load(sv, cfg.qkv, vdt)
    p = _load(sp, cfg.probs, cfg.softmax_dtype)
    sdt = cfg.softmax_dtype
    dv = jnp.einsum("bhqk,bqhd->bkhd", p.astype(vdt), g.astype(vdt)).astype(vdt)
    dp = jnp.einsum("bqhd,bkhd->bhqk", g.astype(vdt), v).astype(sdt)
    dlogits = p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True))
    dlogits = jnp.where(mask, dlogits, jnp.zeros((), sdt))
    c = 1.0 / math.sqrt(q.shape[-1])
    dl = dlogits.astype(qdt)
    dq = (jnp.einsum("bhqk,bkhd->bqhd", dl, k.astype(qdt)) * jnp.asarray(c, qdt)).astype(qdt)
    dk = (jnp.einsum("bhqk,bqhd->bkhd", dl.astype(kdt), q.astype(kdt)) * jnp.asarray(c, kdt)).astype(kdt)
    return dq, dk, dv, None


_saved_attention.defvjp(_saved_attention_fwd, _saved_attention_bwd)


def fp8_saved_attention(q, k, v, mask, *, qkv_spec: SaveSpec | None = PER_TENSOR,
                        probs_spec: SaveSpec | None = GROUP16, softmax_dtype=jnp.float32,
                        mask_value: float = float("-inf")):
    """Masked softmax attention `softmax(q k^T / sqrt(d_head), mask) v` (the math of
    `experiments/nanogpt/model.causal_attention`) whose backward reads only FP8 copies.

    Saved for the backward: q, k, v as `qkv_spec` (the inputs of the two attention
    matmuls: per tensor by default), the softmax probabilities as `probs_spec` (groups
    along the key axis), and the boolean mask. Nothing is recomputed.

    Args:
      q, k, v: `(batch, seq, heads, d_head)`.
      mask: `(seq_q, seq_k)` bool (or broadcasting to `(batch, heads, seq_q, seq_k)`).
      qkv_spec, probs_spec: `SaveSpec` or None (kept in their own dtype).
      softmax_dtype: dtype of the logits and the softmax.
      mask_value: value of masked logits.
    Returns:
      `(batch, seq, heads, d_head)` in v's dtype.
    """
    q, k, v = (jnp.asarray(a) for a in (q, k, v))
    cfg = _AttnCfg(qkv_spec, probs_spec, jnp.dtype(softmax_dtype), float(mask_value),
                   (q.dtype, k.dtype, v.dtype))
    return _saved_attention(q, k, v, jnp.asarray(mask), cfg)


# ---------------------------------------------------------------------------------------
# The policy: which saved tensors are FP8, per layer type
# ---------------------------------------------------------------------------------------
LAYER_TYPES = ("linear", "norm", "activation", "attention_qkv", "attention_probs")


@dataclasses.dataclass(frozen=True)
class ResidualPolicy:
    """Which saved tensors are stored in FP8 and at which granularity, per layer type.

    Attributes (a `SaveSpec`, or None to keep the tensor in its own dtype):
      linear: input of a linear layer (per tensor in COAT). Leave None where the linear
        layer is already an FP8 matmul (`scalify.nn.Dense` with FP8 inputs saves its
        quantised input itself).
      norm: input of a normalisation layer (LayerNorm/RMSNorm; per group).
      activation: input of an activation function (GELU/SiLU; per group).
      attention_qkv: q, k, v of the attention matmuls (per tensor).
      attention_probs: softmax probabilities (per group along the key axis).
    """

    linear: SaveSpec | None = None
    norm: SaveSpec | None = None
    activation: SaveSpec | None = None
    attention_qkv: SaveSpec | None = None
    attention_probs: SaveSpec | None = None

    def spec(self, layer: str) -> SaveSpec | None:
        """The `SaveSpec` of a layer type (one of `LAYER_TYPES`)."""
        if layer not in LAYER_TYPES:
            raise ValueError(f"Unknown layer type {layer!r}; one of {LAYER_TYPES}.")
        return getattr(self, layer)

    @property
    def attention(self) -> bool:
        return self.attention_qkv is not None or self.attention_probs is not None

    def __str__(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in LAYER_TYPES if getattr(self, k) is not None]
        return ",".join(parts) or "none"

    @classmethod
    def parse(cls, spec: "str | ResidualPolicy | None") -> "ResidualPolicy | None":
        """A policy from a preset name of `POLICIES` or "layer=spec,..." (e.g.
        "norm=g16,activation=g128:float32,linear=tensor"); presets and fields combine:
        "coat,activation=g128". None/"none" gives None."""
        if spec is None or isinstance(spec, ResidualPolicy):
            return spec
        text = spec.strip()
        if text.lower() in ("", "none"):
            return None
        fields: dict = {}
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                if part not in POLICIES:
                    raise ValueError(
                        f"Unknown residual policy {part!r}: a preset ({', '.join(POLICIES)}) "
                        f"or layer=spec with a layer in {LAYER_TYPES}."
                    )
                fields.update({k: getattr(POLICIES[part], k) for k in LAYER_TYPES})
                continue
            key, value = (s.strip() for s in part.split("=", 1))
            key = {"act": "activation", "qkv": "attention_qkv", "probs": "attention_probs"}.get(key, key)
            if key not in LAYER_TYPES:
                raise ValueError(f"Unknown layer type {key!r} in {text!r}; one of {LAYER_TYPES}.")
            fields[key] = SaveSpec.parse(value)
        return cls(**fields)


POLICIES: dict[str, ResidualPolicy] = {
    # COAT's mixed granularity on a model whose linear layers are not FP8 already.
    "coat": ResidualPolicy(linear=PER_TENSOR, norm=GROUP16, activation=GROUP16),
    # The same where the linear layers are FP8 matmuls (their inputs are saved in FP8 by the
    # matmul itself): only the non-linear layers.
    "coat-nonlinear": ResidualPolicy(norm=GROUP16, activation=GROUP16),
    # + attention: q, k, v per tensor and the softmax probabilities per group of 16 keys.
    "coat-attention": ResidualPolicy(norm=GROUP16, activation=GROUP16,
                                     attention_qkv=PER_TENSOR, attention_probs=GROUP16),
    # As coat-attention with the probabilities per tensor with the scale of their bound 1
    # (E4M3 data x 2^-8: one elementwise convert fused into the softmax; values below
    # 2^-17 flush to zero), as FlashAttention-3 feeds P to its FP8 matmul.
    "coat-attention-bound": ResidualPolicy(norm=GROUP16, activation=GROUP16,
                                           attention_qkv=PER_TENSOR, attention_probs=PROBS_BOUND),
    # Everything: all of the above, linear inputs included.
    "all": ResidualPolicy(linear=PER_TENSOR, norm=GROUP16, activation=GROUP16,
                          attention_qkv=PER_TENSOR, attention_probs=GROUP16),
}
