"""A Llama-3-style decoder in Flax linen.

The architecture of Llama 3 (Grattafiori et al. 2024), as Meta's reference code writes it:

- token embedding, ``n_layers`` pre-norm blocks, a final RMSNorm and an untied output head
  ``lm_head``; no biases anywhere;
- RMSNorm: ``x / sqrt(mean(x^2) + eps) * weight``, the statistics and the division in
  float32, the result cast back to the input's dtype before the gain (``RMSNorm``);
- rotary position embeddings on q and k: each pair ``(x[2i], x[2i+1])`` of a head is the
  complex number ``x[2i] + j x[2i+1]``, multiplied by ``exp(j t theta^(-2i/head_dim))`` at
  position ``t`` (``theta = rope_theta``, 500000), in float32 (``apply_rotary_emb``);
- grouped-query attention: ``n_heads`` query heads share ``n_kv_heads`` key/value heads
  (``n_heads / n_kv_heads`` queries per key/value head), causal, scaled by
  ``1/sqrt(head_dim)``, through ``jax.nn.dot_product_attention`` with the key/value heads
  passed as they are; its ``implementation`` is ``cfg.attention``: "cudnn" (cuDNN flash
  attention, GPU, bfloat16/float16 q/k/v), "xla", or "auto" (default): cudnn on a GPU when
  q is bfloat16 or float16 (the dtype the layer computes in at call time, a recipe's
  included), else xla;
- SwiGLU feed-forward: ``w2(silu(w1 x) * w3 x)``, hidden width ``ffn_dim``.

Every matmul is an ``nn.Dense`` (``use_bias=False``) with ``dtype`` the compute dtype
(default bfloat16) and float32 parameters; the embedding computes in ``dtype`` too. The
logits come out of ``lm_head`` in ``dtype``; the loss casts them to float32.

Presets (``PRESETS``, ``get_config(name, **overrides)``); the counts are exact
(``expected_param_count``, equal to the count of ``jax.eval_shape`` of the init):

=============  ====  ======  =====  ========  ======  =======  ====  =================
preset         d     layers  heads  kv heads  ffn     vocab    seq   parameters
=============  ====  ======  =====  ========  ======  =======  ====  =================
``tiny``       64    2       4      2         192     256      64    0.13M (131,392)
``small``      512   8       8      4         1536    8192     512   33.6M (33,563,136)
``1b``         2048  16      32     8         8192    128256   2048  1.50B (1,498,482,688)
``8b-shape``   4096  4       32     8         14336   128256   2048  1.92B (1,923,125,248)
=============  ====  ======  =====  ========  ======  =======  ====  =================

``1b`` is the shape of Llama 3.2 1B with an untied head (tied, as Meta ships it, 1.24B
parameters). ``8b-shape`` has the width of Llama 3 8B (its 32 layers give 8.03B
parameters) with 4 layers by default (``n_layers`` overrides it), to time the 8B model's
matmul shapes on one GPU. The 128256-token vocabulary is a multiple of 64 (2004 x 64).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from experiments.nanogpt.model import param_count

__all__ = ["ATTENTIONS", "LlamaConfig", "PRESETS", "get_config", "Llama", "RMSNorm", "rope_frequencies", "apply_rotary_emb",
           "attention_implementation", "Attention", "FeedForward", "Block", "param_count", "expected_param_count"]


ATTENTIONS = ("auto", "xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a `Llama` model."""

    vocab_size: int = 256
    seq_len: int = 64  # the longest sequence (rotary table length)
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 192
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02  # normal initialiser of every matrix
    attention: str = "auto"  # ATTENTIONS (module doc)
    dot_general_cls: Any = None  # every nn.Dense's (e.g. flax's Fp8DirectDotGeneralOp); None: lax's

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention {self.attention!r} is not one of {ATTENTIONS}.")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}.")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}.")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head_dim {self.d_model // self.n_heads} must be even (rotary pairs).")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    "small": LlamaConfig(vocab_size=8192, seq_len=512, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4,
                         ffn_dim=1536),
    "1b": LlamaConfig(vocab_size=128256, seq_len=2048, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                      ffn_dim=8192),
    "8b-shape": LlamaConfig(vocab_size=128256, seq_len=2048, d_model=4096, n_layers=4, n_heads=32,
                            n_kv_heads=8, ffn_dim=14336),
}


def get_config(name: str, **overrides) -> LlamaConfig:
    """The preset `name` with some fields replaced."""
    if name not in PRESETS:
        raise ValueError(f"Unknown Llama preset {name!r}; choose one of {list(PRESETS)}.")
    return dataclasses.replace(PRESETS[name], **overrides)


def expected_param_count(cfg: LlamaConfig) -> int:
    """Closed form: embedding and head ``2 V d``, per layer ``d (d + 2 kv_dim + d)``
    (q, k, v, o) + ``3 d ffn`` (w1, w2, w3) + ``2 d`` (two norms), and the final norm ``d``;
    ``kv_dim = n_kv_heads * head_dim``."""
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    per_layer = d * (2 * d + 2 * kv) + 3 * d * cfg.ffn_dim + 2 * d
    return 2 * cfg.vocab_size * d + cfg.n_layers * per_layer + d


# ----------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2, -1) + eps)`` computed in float32, cast back to the input's
    dtype (``dtype`` when set), times the gain ``weight`` (ones at init)."""

    eps: float = 1e-5
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        dtype = self.dtype or x.dtype
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return normed.astype(dtype) * weight.astype(dtype)


def rope_frequencies(head_dim: int, seq_len: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) of the rotation angles ``t * theta^(-2i/head_dim)``, float32, shape
    ``(seq_len, head_dim // 2)``."""
    freqs = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = jnp.outer(jnp.arange(seq_len, dtype=jnp.float32), freqs)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary_emb(x, cos, sin):
    """Rotates the pairs ``(x[..., 2i], x[..., 2i+1])`` of ``x`` (batch, seq, heads,
    head_dim) by the angles of (cos, sin) (seq, head_dim // 2), in float32; the result in
    ``x``'s dtype."""
    b, t, h, hd = x.shape
    xr = x.astype(jnp.float32).reshape(b, t, h, hd // 2, 2)
    re, im = xr[..., 0], xr[..., 1]
    cos, sin = cos[None, :t, None, :], sin[None, :t, None, :]
    out = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1)
    return out.reshape(b, t, h, hd).astype(x.dtype)


def _dense(features: int, dtype, cfg: LlamaConfig, name: str) -> nn.Dense:
    return nn.Dense(features, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
                    kernel_init=nn.initializers.normal(cfg.init_std), dot_general_cls=cfg.dot_general_cls,
                    name=name)


def attention_implementation(attention: str, dtype) -> str | None:
    """``jax.nn.dot_product_attention``'s implementation for `attention` (ATTENTIONS) and
    q/k/v of `dtype`: None (XLA's) or "cudnn"."""
    if attention == "auto":
        sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        attention = "cudnn" if sixteen_bit and jax.default_backend() == "gpu" else "xla"
    return None if attention == "xla" else attention


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings (module doc)."""

    cfg: LlamaConfig
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x, cos, sin):
        cfg = self.cfg
        b, t, _ = x.shape
        hd = cfg.head_dim
        q = _dense(cfg.n_heads * hd, self.dtype, cfg, "wq")(x).reshape(b, t, cfg.n_heads, hd)
        k = _dense(cfg.n_kv_heads * hd, self.dtype, cfg, "wk")(x).reshape(b, t, cfg.n_kv_heads, hd)
        v = _dense(cfg.n_kv_heads * hd, self.dtype, cfg, "wv")(x).reshape(b, t, cfg.n_kv_heads, hd)
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                         implementation=attention_implementation(cfg.attention, q.dtype))
        return _dense(cfg.d_model, self.dtype, cfg, "wo")(y.reshape(b, t, cfg.n_heads * hd))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    cfg: LlamaConfig
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        gate = nn.silu(_dense(cfg.ffn_dim, self.dtype, cfg, "w1")(x))
        up = _dense(cfg.ffn_dim, self.dtype, cfg, "w3")(x)
        return _dense(cfg.d_model, self.dtype, cfg, "w2")(gate * up)


class Block(nn.Module):
    """``h = x + attention(attention_norm(x))``; ``h + feed_forward(ffn_norm(h))``."""

    cfg: LlamaConfig
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x, cos, sin):
        cfg = self.cfg
        h = x + Attention(cfg, self.dtype, name="attention")(
            RMSNorm(cfg.norm_eps, self.dtype, name="attention_norm")(x), cos, sin)
        return h + FeedForward(cfg, self.dtype, name="feed_forward")(RMSNorm(cfg.norm_eps, self.dtype,
                                                                             name="ffn_norm")(h))


class Llama(nn.Module):
    """``Llama(cfg)(tokens) -> logits``: int tokens (batch, seq <= cfg.seq_len) to logits
    (batch, seq, vocab_size) in ``dtype``."""

    cfg: LlamaConfig
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        x = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=self.dtype, param_dtype=jnp.float32,
                     embedding_init=nn.initializers.normal(cfg.init_std), name="tok_embeddings")(tokens)
        cos, sin = rope_frequencies(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        for i in range(cfg.n_layers):
            x = Block(cfg, self.dtype, name=f"layers_{i}")(x, cos, sin)
        x = RMSNorm(cfg.norm_eps, self.dtype, name="norm")(x)
        return _dense(cfg.vocab_size, self.dtype, cfg, "lm_head")(x)
