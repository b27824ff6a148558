"""The zoo's Flax linen models, written as their authors write them, at tiny sizes (d_model
32, one layer, batch 4, sequences of 8): Llama, GPT-2, BERT, a T5 encoder, ViT, ResNet,
ConvNeXt, MLP-Mixer, a top-k mixture of experts, an LSTM language model and Gemma; and a
two-block Mamba (selective state space), which tests/recipes trains through the recipes.

Every model takes its compute dtype as the field `dtype` (parameters stay float32, Flax's
`param_dtype` default). `SPECS` pairs each with its task (tests/zoo/tasks.py), whose
objective casts the output to float32.
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .tasks import SEQ, VOCAB, classification, next_token, per_token

D, HEADS, KV_HEADS, HIDDEN = 32, 4, 2, 64
HEAD_DIM = D // HEADS


# ---------------------------------------------------------------------------------------
# 1. Llama / Mistral: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU
# ---------------------------------------------------------------------------------------
class LlamaRMSNorm(nn.Module):
    """`x * rsqrt(mean(x * x) + eps) * w` in the compute dtype (the NNX Llama's RMSNorm
    computes in float32, as Hugging Face's does)."""

    eps: float = 1e-6
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight.astype(self.dtype)


def rotate_half(x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rotary(x, positions, theta=10000.0):
    """x (batch, seq, heads, head_dim): Llama's rotary embedding (the `rotate_half` form)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    freqs = positions[:, None].astype(jnp.float32) * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb)[None, :, None, :], jnp.sin(emb)[None, :, None, :]
    return (x * cos.astype(x.dtype) + rotate_half(x) * sin.astype(x.dtype)).astype(x.dtype)


class LlamaAttention(nn.Module):
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=self.dtype, name=name)  # noqa: E731
        q = dense(HEADS * HEAD_DIM, "q_proj")(x).reshape(b, t, HEADS, HEAD_DIM)
        k = dense(KV_HEADS * HEAD_DIM, "k_proj")(x).reshape(b, t, KV_HEADS, HEAD_DIM)
        v = dense(KV_HEADS * HEAD_DIM, "v_proj")(x).reshape(b, t, KV_HEADS, HEAD_DIM)
        positions = jnp.arange(t)
        q, k = apply_rotary(q, positions), apply_rotary(k, positions)
        k = jnp.repeat(k, HEADS // KV_HEADS, axis=2)
        v = jnp.repeat(v, HEADS // KV_HEADS, axis=2)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(HEAD_DIM).astype(self.dtype)
        mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
        logits = jnp.where(mask, logits, jnp.finfo(self.dtype).min)
        probs = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, D)
        return dense(D, "o_proj")(out)


class LlamaMLP(nn.Module):
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=self.dtype, name=name)  # noqa: E731
        return dense(D, "w2")(nn.silu(dense(HIDDEN, "w1")(x)) * dense(HIDDEN, "w3")(x))


class Llama(nn.Module):
    dtype: Any = jnp.float32
    layers: int = 1

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D, dtype=self.dtype)(tokens)
        for _ in range(self.layers):
            x = x + LlamaAttention(self.dtype)(LlamaRMSNorm(dtype=self.dtype)(x))
            x = x + LlamaMLP(self.dtype)(LlamaRMSNorm(dtype=self.dtype)(x))
        x = LlamaRMSNorm(dtype=self.dtype)(x)
        return nn.Dense(VOCAB, use_bias=False, dtype=self.dtype, name="lm_head")(x)


# ---------------------------------------------------------------------------------------
# 2. GPT-2: pre-LayerNorm, fused c_attn, GELU MLP, learned positions, tied head
# ---------------------------------------------------------------------------------------
class GPT2Block(nn.Module):
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, mask):
        b, t, _ = x.shape
        h = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="ln_1")(x)
        qkv = nn.Dense(3 * D, dtype=self.dtype, name="c_attn")(h)
        q, k, v = (a.reshape(b, t, HEADS, HEAD_DIM) for a in jnp.split(qkv, 3, axis=-1))
        a = nn.dot_product_attention(q, k, v, mask=mask, dtype=self.dtype)
        x = x + nn.Dense(D, dtype=self.dtype, name="c_proj")(a.reshape(b, t, D))
        h = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="ln_2")(x)
        h = nn.gelu(nn.Dense(4 * D, dtype=self.dtype, name="c_fc")(h), approximate=True)
        return x + nn.Dense(D, dtype=self.dtype, name="mlp_c_proj")(h)


class GPT2(nn.Module):
    dtype: Any = jnp.float32
    layers: int = 1

    @nn.compact
    def __call__(self, tokens):
        wte = nn.Embed(VOCAB, D, embedding_init=nn.initializers.normal(0.02), dtype=self.dtype, name="wte")
        wpe = nn.Embed(SEQ, D, embedding_init=nn.initializers.normal(0.01), dtype=self.dtype, name="wpe")
        x = wte(tokens) + wpe(jnp.arange(tokens.shape[1])[None])
        mask = nn.make_causal_mask(tokens)
        for i in range(self.layers):
            x = GPT2Block(self.dtype, name=f"h_{i}")(x, mask)
        x = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="ln_f")(x)
        return wte.attend(x)


# ---------------------------------------------------------------------------------------
# 3. BERT: post-LayerNorm, padding mask, Flax's MultiHeadDotProductAttention, pooler and
#    classification head
# ---------------------------------------------------------------------------------------
class Bert(nn.Module):
    dtype: Any = jnp.float32
    layers: int = 1
    classes: int = 3

    @nn.compact
    def __call__(self, tokens):
        dt = self.dtype

        def emb(n, name):
            return nn.Embed(n, D, embedding_init=nn.initializers.normal(0.02), dtype=dt, name=name)

        x = emb(VOCAB, "word_embeddings")(tokens) + emb(SEQ, "position_embeddings")(jnp.arange(tokens.shape[1])[None])
        x = x + emb(2, "token_type_embeddings")(jnp.zeros_like(tokens))
        x = nn.LayerNorm(epsilon=1e-12, dtype=dt, name="embeddings_ln")(x)
        mask = nn.make_attention_mask(tokens > 0, tokens > 0)
        for i in range(self.layers):
            attention = nn.MultiHeadDotProductAttention(HEADS, dtype=dt, deterministic=True, name=f"attention_{i}")
            a = attention(x, mask=mask)
            x = nn.LayerNorm(epsilon=1e-12, dtype=dt, name=f"attention_ln_{i}")(x + a)
            h = nn.gelu(nn.Dense(HIDDEN, dtype=dt, name=f"intermediate_{i}")(x), approximate=False)
            h = nn.Dense(D, dtype=dt, name=f"output_{i}")(h)
            x = nn.LayerNorm(epsilon=1e-12, dtype=dt, name=f"output_ln_{i}")(x + h)
        pooled = nn.tanh(nn.Dense(D, dtype=dt, name="pooler")(x[:, 0]))
        return nn.Dense(self.classes, dtype=dt, name="classifier")(pooled)


# ---------------------------------------------------------------------------------------
# 4. T5 encoder: relative position bias buckets, T5 RMSNorm, gated-GELU FFN (T5 v1.1)
# ---------------------------------------------------------------------------------------
class T5LayerNorm(nn.Module):
    eps: float = 1e-6
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        variance = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        x = x * jax.lax.rsqrt(variance + self.eps)
        return weight * x.astype(self.dtype)


def relative_position_bucket(relative_position, num_buckets=8, max_distance=16):
    """T5's bidirectional buckets: half for each sign, exact below num_buckets // 4, then
    logarithmic up to max_distance."""
    num_buckets //= 2
    buckets = (relative_position > 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(relative_position)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (jnp.log(n.astype(jnp.float32) / max_exact + np.finfo(np.float32).eps)
                         / np.log(max_distance / max_exact) * (num_buckets - max_exact)).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return buckets + jnp.where(is_small, n, large)


class T5Encoder(nn.Module):
    dtype: Any = jnp.float32
    layers: int = 1
    num_buckets: int = 8

    @nn.compact
    def __call__(self, tokens):
        dt = self.dtype
        b, t = tokens.shape
        x = nn.Embed(VOCAB, D, embedding_init=nn.initializers.normal(1.0), dtype=dt, name="shared")(tokens)
        context, memory = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
        buckets = relative_position_bucket(memory - context, self.num_buckets)
        rel_bias = nn.Embed(self.num_buckets, HEADS, dtype=dt, name="relative_attention_bias")(buckets)
        position_bias = jnp.transpose(rel_bias, (2, 0, 1))[None]  # (1, heads, q, k)
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=dt, name=name)  # noqa: E731
        for i in range(self.layers):
            h = T5LayerNorm(dtype=dt, name=f"ln_attn_{i}")(x)
            q, k, v = (dense(D, f"{n}_{i}")(h).reshape(b, t, HEADS, HEAD_DIM) for n in "qkv")
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) + position_bias  # T5: no 1/sqrt(d)
            weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(dt)
            a = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, D)
            x = x + dense(D, f"o_{i}")(a)
            h = T5LayerNorm(dtype=dt, name=f"ln_ff_{i}")(x)
            h = nn.gelu(dense(HIDDEN, f"wi_0_{i}")(h), approximate=True) * dense(HIDDEN, f"wi_1_{i}")(h)
            x = x + dense(D, f"wo_{i}")(h)
        x = T5LayerNorm(dtype=dt, name="final_layer_norm")(x)
        return dense(VOCAB, "lm_head")(x)


# ---------------------------------------------------------------------------------------
# 5. ViT: patches by a strided Conv, class token, pre-LayerNorm encoder
# ---------------------------------------------------------------------------------------
PATCH, IMAGE = 4, 16


class ViT(nn.Module):
    dtype: Any = jnp.float32
    layers: int = 1
    classes: int = 10

    @nn.compact
    def __call__(self, images):
        dt = self.dtype
        x = nn.Conv(D, (PATCH, PATCH), strides=(PATCH, PATCH), padding="VALID", dtype=dt, name="embedding")(images)
        b, h, w, c = x.shape
        x = x.reshape(b, h * w, c)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
        x = jnp.concatenate([jnp.tile(cls, (b, 1, 1)).astype(x.dtype), x], axis=1)
        pos = self.param("pos_embedding", nn.initializers.normal(stddev=0.02), (1, h * w + 1, c))
        x = x + pos.astype(x.dtype)
        for i in range(self.layers):
            y = nn.LayerNorm(dtype=dt)(x)
            x = x + nn.MultiHeadDotProductAttention(HEADS, dtype=dt, deterministic=True)(y, y)
            y = nn.LayerNorm(dtype=dt)(x)
            y = nn.Dense(D, dtype=dt)(nn.gelu(nn.Dense(HIDDEN, dtype=dt)(y)))
            x = x + y
        x = nn.LayerNorm(dtype=dt, name="encoder_norm")(x)
        return nn.Dense(self.classes, dtype=dt, name="head")(x[:, 0])


# ---------------------------------------------------------------------------------------
# 6a. ResNet: a basic residual block with BatchNorm (train mode, batch_stats mutable; the
#     block's last BatchNorm scale starts at zero, as in Flax's ResNet example)
# ---------------------------------------------------------------------------------------
class ResNetBlock(nn.Module):
    filters: int
    strides: int = 1
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        def conv(features, size, strides=1):
            return nn.Conv(features, (size, size), (strides, strides), use_bias=False, dtype=self.dtype)

        def norm(**kw):
            return nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5, dtype=self.dtype, **kw)

        y = nn.relu(norm()(conv(self.filters, 3, self.strides)(x)))
        y = norm(scale_init=nn.initializers.zeros)(conv(self.filters, 3)(y))
        if x.shape != y.shape:
            x = norm()(conv(self.filters, 1, self.strides)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    dtype: Any = jnp.float32
    classes: int = 10

    @nn.compact
    def __call__(self, images):
        x = nn.Conv(8, (3, 3), use_bias=False, dtype=self.dtype, name="conv_init")(images)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, dtype=self.dtype, name="bn_init")(x))
        x = ResNetBlock(8, dtype=self.dtype)(x)
        return nn.Dense(self.classes, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))


# ---------------------------------------------------------------------------------------
# 6b. ConvNeXt: patchify stem, depthwise 7x7 conv, LayerNorm, GELU MLP, layer scale 1e-6
# ---------------------------------------------------------------------------------------
class ConvNeXtBlock(nn.Module):
    dtype: Any = jnp.float32
    layer_scale_init: float = 1e-6

    @nn.compact
    def __call__(self, x):
        c = x.shape[-1]
        y = nn.Conv(c, (7, 7), padding=3, feature_group_count=c, dtype=self.dtype, name="dwconv")(x)
        y = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype, name="norm")(y)
        y = nn.Dense(4 * c, dtype=self.dtype, name="pwconv1")(y)
        y = nn.Dense(c, dtype=self.dtype, name="pwconv2")(nn.gelu(y))
        gamma = self.param("gamma", nn.initializers.constant(self.layer_scale_init), (c,))
        return x + gamma * y


class ConvNeXt(nn.Module):
    dtype: Any = jnp.float32
    classes: int = 10

    @nn.compact
    def __call__(self, images):
        x = nn.Conv(D, (4, 4), strides=(4, 4), dtype=self.dtype, name="stem")(images)
        x = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype, name="stem_norm")(x)
        x = ConvNeXtBlock(self.dtype)(x)
        x = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype, name="norm")(jnp.mean(x, axis=(1, 2)))
        return nn.Dense(self.classes, dtype=self.dtype, name="head")(x)


# ---------------------------------------------------------------------------------------
# 7. MLP-Mixer: token-mixing and channel-mixing MLPs
# ---------------------------------------------------------------------------------------
class MlpBlock(nn.Module):
    mlp_dim: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        y = nn.gelu(nn.Dense(self.mlp_dim, dtype=self.dtype)(x))
        return nn.Dense(x.shape[-1], dtype=self.dtype)(y)


class MlpMixer(nn.Module):
    dtype: Any = jnp.float32
    layers: int = 1
    classes: int = 10

    @nn.compact
    def __call__(self, images):
        dt = self.dtype
        x = nn.Conv(D, (PATCH, PATCH), strides=(PATCH, PATCH), dtype=dt, name="stem")(images)
        b, h, w, c = x.shape
        x = x.reshape(b, h * w, c)
        for _ in range(self.layers):
            y = nn.LayerNorm(dtype=dt)(x)
            y = jnp.swapaxes(y, 1, 2)
            y = MlpBlock(2 * h * w, dt, name=None)(y)
            x = x + jnp.swapaxes(y, 1, 2)
            y = nn.LayerNorm(dtype=dt)(x)
            x = x + MlpBlock(HIDDEN, dt)(y)
        x = nn.LayerNorm(dtype=dt, name="pre_head_layer_norm")(x)
        return nn.Dense(self.classes, dtype=dt, name="head")(x.mean(axis=1))


# ---------------------------------------------------------------------------------------
# 8. Top-k mixture of experts: softmax router, lax.top_k, gated expert outputs,
#    Switch-style load-balancing loss
# ---------------------------------------------------------------------------------------
class MoE(nn.Module):
    """Every expert computed densely, then combined with the gates of its top-k tokens (the
    reference form of sparse MoE layers); the expert weights are stacked in `nn.Einsum`
    layers."""

    experts: int = 4
    top_k: int = 2
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        router_logits = nn.Dense(self.experts, use_bias=False, dtype=self.dtype, name="router")(x)
        router_probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
        gates, index = jax.lax.top_k(router_probs, self.top_k)
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        dispatch = jax.nn.one_hot(index, self.experts, dtype=router_probs.dtype)  # (b, t, k, e)
        combine = jnp.einsum("btk,btke->bte", gates, dispatch).astype(self.dtype)
        h = nn.Einsum((self.experts, x.shape[-1], HIDDEN), "btd,edh->bteh", dtype=self.dtype, name="wi")(x)
        out = nn.Einsum((self.experts, HIDDEN, x.shape[-1]), "bteh,ehd->bted", dtype=self.dtype, name="wo")(nn.gelu(h))
        y = jnp.einsum("bte,bted->btd", combine, out)
        # load balancing (Switch Transformer): experts x sum_e (fraction routed to e) x (mean prob of e)
        fraction = jnp.mean(jnp.sum(dispatch, axis=-2), axis=(0, 1)) / self.top_k
        aux = self.experts * jnp.sum(fraction * jnp.mean(router_probs, axis=(0, 1)))
        return y, aux


class MoELM(nn.Module):
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D, dtype=self.dtype)(tokens)
        y, aux = MoE(dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
        x = nn.LayerNorm(dtype=self.dtype)(x + y)
        return nn.Dense(VOCAB, dtype=self.dtype)(x), aux


# ---------------------------------------------------------------------------------------
# 9. LSTM language model: nn.RNN(nn.LSTMCell)
# ---------------------------------------------------------------------------------------
class LSTMLM(nn.Module):
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D, dtype=self.dtype)(tokens)
        x = nn.RNN(nn.LSTMCell(D, dtype=self.dtype))(x)
        return nn.Dense(VOCAB, dtype=self.dtype)(x)


# ---------------------------------------------------------------------------------------
# 10. Gemma: RMSNorm with (1 + w), multi-query attention, GeGLU, scaled embeddings, tied
#     head, tanh soft-capping of attention and final logits (Gemma 2)
# ---------------------------------------------------------------------------------------
class GemmaRMSNorm(nn.Module):
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros, (x.shape[-1],))
        var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        normed = x.astype(jnp.float32) * jax.lax.rsqrt(var + 1e-6)
        return (normed * (1 + scale)).astype(self.dtype)


class Gemma(nn.Module):
    dtype: Any = jnp.float32
    attn_softcap: float = 50.0
    final_softcap: float = 30.0

    @nn.compact
    def __call__(self, tokens):
        dt = self.dtype
        b, t = tokens.shape
        embedder = nn.Embed(VOCAB, D, embedding_init=nn.initializers.normal(0.01), dtype=dt, name="embedder")
        x = embedder(tokens) * jnp.sqrt(D).astype(dt)
        h = GemmaRMSNorm(dt, name="pre_attention_norm")(x)
        q = nn.DenseGeneral((HEADS, HEAD_DIM), use_bias=False, dtype=dt, name="q_einsum")(h)
        kv = nn.DenseGeneral((2, HEAD_DIM), use_bias=False, dtype=dt, name="kv_einsum")(h)  # one kv head
        k, v = kv[:, :, 0], kv[:, :, 1]
        q, k = apply_rotary(q, jnp.arange(t)), apply_rotary(k[:, :, None], jnp.arange(t))[:, :, 0]
        logits = jnp.einsum("bqhd,bkd->bhqk", q * HEAD_DIM**-0.5, k)
        logits = jnp.tanh(logits / self.attn_softcap) * self.attn_softcap
        mask = jnp.tril(jnp.ones((t, t), bool))
        logits = jnp.where(mask, logits, -2.3819763e38)  # Gemma's K_MASK
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        a = jnp.einsum("bhqk,bkd->bqhd", probs, v)
        x = x + nn.DenseGeneral(D, axis=(-2, -1), use_bias=False, dtype=dt, name="attn_vec_einsum")(a)
        h = GemmaRMSNorm(dt, name="pre_ffw_norm")(x)
        gate = nn.gelu(nn.Dense(HIDDEN, use_bias=False, dtype=dt, name="gating_0")(h))
        up = nn.Dense(HIDDEN, use_bias=False, dtype=dt, name="gating_1")(h)
        h = nn.Dense(D, use_bias=False, dtype=dt, name="linear")(gate * up)
        x = GemmaRMSNorm(dt, name="final_norm")(x + h)
        logits = embedder.attend(x)
        return jnp.tanh(logits / self.final_softcap) * self.final_softcap


# ---------------------------------------------------------------------------------------
# 11. Mamba: a selective state-space block (causal depthwise convolution, softplus step,
#     exp discretisation, an associative scan over time, SiLU gating), two blocks deep
# ---------------------------------------------------------------------------------------
class MambaBlock(nn.Module):
    states: int = 8
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        dt, e = self.dtype, 2 * D
        u, z = jnp.split(nn.Dense(2 * e, use_bias=False, dtype=dt)(nn.RMSNorm(dtype=dt)(x)), 2, axis=-1)
        u = nn.silu(nn.Conv(e, (4,), feature_group_count=e, padding=[(3, 0)], dtype=dt)(u))
        step = nn.softplus(nn.Dense(e, dtype=dt)(u))
        b = nn.Dense(self.states, use_bias=False, dtype=dt)(u).astype(jnp.float32)
        c = nn.Dense(self.states, use_bias=False, dtype=dt)(u).astype(jnp.float32)
        a_log = self.param("A_log", lambda k, s: jnp.log(jnp.tile(jnp.arange(1.0, s[1] + 1), (s[0], 1))),
                           (e, self.states))
        decay = jnp.exp(step[..., None].astype(jnp.float32) * -jnp.exp(a_log))  # (b, t, e, n)
        drive = (step * u)[..., None].astype(jnp.float32) * b[:, :, None, :]
        _, h = jax.lax.associative_scan(lambda p, q: (p[0] * q[0], q[0] * p[1] + q[1]), (decay, drive), axis=1)
        y = jnp.einsum("bten,btn->bte", h, c).astype(u.dtype)
        y = (y + u * self.param("D", nn.initializers.ones, (e,))) * nn.silu(z)
        return x + nn.Dense(D, use_bias=False, dtype=dt)(y)


class Mamba(nn.Module):
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D, dtype=self.dtype)(tokens)
        x = MambaBlock(dtype=self.dtype)(MambaBlock(dtype=self.dtype)(x))
        return nn.Dense(VOCAB, dtype=self.dtype)(nn.RMSNorm(dtype=self.dtype)(x))


# ---------------------------------------------------------------------------------------
# 12. DiT (Peebles & Xie): a diffusion transformer predicting the noise of 8x8x4 latents in
#     patches of 2, conditioned on the time step and a class; adaLN-Zero modulation (its
#     projections and the final layer zero-initialised: every gate starts at exactly 0)
#     and LayerNorms without parameters
# ---------------------------------------------------------------------------------------
def modulate(x, shift, scale):
    return x * (1 + scale[:, None]) + shift[:, None]


class TimestepEmbedder(nn.Module):
    dtype: Any = jnp.float32
    freq: int = 64

    @nn.compact
    def __call__(self, t):
        half = self.freq // 2
        freqs = jnp.exp(-math.log(10000) * jnp.arange(half, dtype=jnp.float32) / half)
        args = t[:, None].astype(jnp.float32) * freqs[None]
        emb = jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)
        return nn.Dense(D, dtype=self.dtype)(nn.silu(nn.Dense(D, dtype=self.dtype)(emb)))


def _plain_norm(dtype):
    return nn.LayerNorm(use_bias=False, use_scale=False, epsilon=1e-6, dtype=dtype)


class DiTBlock(nn.Module):
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, c):
        dt = self.dtype
        mod = nn.Dense(6 * D, kernel_init=nn.initializers.zeros, dtype=dt)(nn.silu(c))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = jnp.split(mod, 6, axis=-1)
        h = modulate(_plain_norm(dt)(x), shift_msa, scale_msa)
        h = nn.MultiHeadDotProductAttention(num_heads=HEADS, dtype=dt)(h, h)
        x = x + gate_msa[:, None] * h
        h = modulate(_plain_norm(dt)(x), shift_mlp, scale_mlp)
        h = nn.Dense(D, dtype=dt)(nn.gelu(nn.Dense(4 * D, dtype=dt)(h), approximate=True))
        return x + gate_mlp[:, None] * h


class DiT(nn.Module):
    dtype: Any = jnp.float32
    patch: int = 2
    classes: int = 10

    @nn.compact
    def __call__(self, x, t, y):
        dt, (b, h, w, ch) = self.dtype, x.shape
        x = nn.Conv(D, (self.patch, self.patch), strides=self.patch, dtype=dt)(x).reshape(b, -1, D)
        x = x + self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], D))
        c = TimestepEmbedder(dtype=dt)(t) + nn.Embed(self.classes + 1, D, dtype=dt)(y)
        for _ in range(2):
            x = DiTBlock(dtype=dt)(x, c)
        shift, scale = jnp.split(nn.Dense(2 * D, kernel_init=nn.initializers.zeros, dtype=dt)(nn.silu(c)), 2, -1)
        x = modulate(_plain_norm(dt)(x), shift, scale)
        x = nn.Dense(self.patch * self.patch * ch, kernel_init=nn.initializers.zeros, dtype=dt)(x)
        hp = h // self.patch
        return x.reshape(b, hp, hp, self.patch, self.patch, ch).transpose(0, 1, 3, 2, 4, 5).reshape(b, h, w, ch)


def dit_batch(seed, batch=16):
    """Noised latents (a cosine schedule at random time steps), time steps, classes and the
    noise, the DiT's regression target."""
    rng = np.random.default_rng(seed)
    x0 = np.random.default_rng(0).standard_normal((batch, 8, 8, 4)) * 0.5 + np.linspace(-1, 1, 4)
    t = rng.integers(0, 1000, batch)
    keep = np.cos((t / 1000 + 0.008) / 1.008 * np.pi / 2) ** 2
    noise = rng.standard_normal(x0.shape)
    xt = np.sqrt(keep)[:, None, None, None] * x0 + np.sqrt(1 - keep)[:, None, None, None] * noise
    labels = np.random.default_rng(1).integers(0, 10, batch)
    return xt.astype(np.float32), t.astype(np.int32), labels.astype(np.int32), noise.astype(np.float32)


def dit_loss(model):
    def loss_fn(params, batch):
        xt, t, y, noise = batch
        return jnp.mean((model.apply({"params": params}, xt, t, y).astype(jnp.float32) - noise) ** 2)

    return loss_fn


# ---------------------------------------------------------------------------------------
# 13. LoRA: each Dense of a small language model plus a low-rank update B A x, with B
#     zero-initialised (the update starts at exactly 0)
# ---------------------------------------------------------------------------------------
class LoRADense(nn.Module):
    features: int
    rank: int = 4
    alpha: float = 8.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        base = nn.Dense(self.features, name="base", dtype=self.dtype)(x)
        a = nn.Dense(self.rank, use_bias=False, name="lora_a", dtype=self.dtype,
                     kernel_init=nn.initializers.normal(1 / self.rank))(x)
        b = nn.Dense(self.features, use_bias=False, name="lora_b", dtype=self.dtype,
                     kernel_init=nn.initializers.zeros)(a)
        return base + (self.alpha / self.rank) * b


class LoRALM(nn.Module):
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D, dtype=self.dtype)(tokens)
        for _ in range(2):
            h = nn.RMSNorm(dtype=self.dtype)(x)
            x = x + LoRADense(D, dtype=self.dtype)(nn.silu(LoRADense(2 * D, dtype=self.dtype)(h)))
        return nn.Dense(VOCAB, dtype=self.dtype)(nn.RMSNorm(dtype=self.dtype)(x))


SPECS = {
    "llama": (Llama, next_token),
    "gpt2": (GPT2, next_token),
    "bert": (Bert, classification(tokens=True, classes=3)),
    "t5-encoder": (T5Encoder, per_token),
    "vit": (ViT, classification(image=IMAGE, classes=10)),
    "resnet": (ResNet, classification(image=8, classes=10)),
    "convnext": (ConvNeXt, classification(image=IMAGE, classes=10)),
    "mlp-mixer": (MlpMixer, classification(image=IMAGE, classes=10)),
    "moe": (MoELM, next_token),
    "lstm": (LSTMLM, next_token),
    "gemma": (Gemma, next_token),
}
