"""Architectures of the zoo in Flax NNX and Equinox, written with each library's layers.

NNX: Llama (`nnx.Embed`, `nnx.Linear`, a hand-written RMSNorm `nnx.Param`, rotary
embeddings, grouped-query attention) and MLP-Mixer (`nnx.Conv`, `nnx.LayerNorm`,
`nnx.Linear`). Their constructors take `dtype` (compute; parameters float32) and the
`dot_general` of their `nnx.Linear` layers (the FP8 swap). Attention is hand-written:
`nnx.MultiHeadAttention` with float16 compute asks for float16 x float16 -> float32
logits, which XLA:CPU does not implement.

Equinox: GPT-2 (`eqx.nn.Embedding`, `eqx.nn.LayerNorm`, `eqx.nn.MultiheadAttention`,
`eqx.nn.Linear`, tied head) and ViT (`eqx.nn.Conv2d` patches, class token,
`eqx.nn.MultiheadAttention`, `eqx.nn.MLP`). They map one example (vmapped over the batch).
"""
from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import nnx

from .models_linen import D, HEAD_DIM, HEADS, HIDDEN, IMAGE, KV_HEADS, PATCH, apply_rotary
from .tasks import SEQ, VOCAB, classification, next_token


# ---------------------------------------------------------------------------------------
# NNX Llama
# ---------------------------------------------------------------------------------------
class RMSNorm(nnx.Module):
    """Hugging Face's Llama RMSNorm: normalised in float32, cast back, times the weight."""

    def __init__(self, dim, *, dtype, eps=1e-6):
        self.weight = nnx.Param(jnp.ones((dim,)))
        self.eps, self.dtype = eps, dtype

    def __call__(self, x):
        x = x.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x.astype(self.dtype)


class LlamaBlock(nnx.Module):
    def __init__(self, *, dtype, dot_general, rngs):
        def linear(i, o):
            return nnx.Linear(i, o, use_bias=False, dtype=dtype, dot_general=dot_general, rngs=rngs)

        self.input_norm, self.post_norm = RMSNorm(D, dtype=dtype), RMSNorm(D, dtype=dtype)
        self.q_proj, self.o_proj = linear(D, HEADS * HEAD_DIM), linear(HEADS * HEAD_DIM, D)
        self.k_proj, self.v_proj = linear(D, KV_HEADS * HEAD_DIM), linear(D, KV_HEADS * HEAD_DIM)
        self.w1, self.w3, self.w2 = linear(D, HIDDEN), linear(D, HIDDEN), linear(HIDDEN, D)
        self.dtype = dtype

    def attention(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, HEADS, HEAD_DIM)
        k = self.k_proj(x).reshape(b, t, KV_HEADS, HEAD_DIM)
        v = self.v_proj(x).reshape(b, t, KV_HEADS, HEAD_DIM)
        q, k = apply_rotary(q, jnp.arange(t)), apply_rotary(k, jnp.arange(t))
        k, v = jnp.repeat(k, HEADS // KV_HEADS, axis=2), jnp.repeat(v, HEADS // KV_HEADS, axis=2)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(HEAD_DIM).astype(self.dtype)
        mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
        logits = jnp.where(mask, logits, jnp.finfo(self.dtype).min)
        probs = jax.nn.softmax(logits, axis=-1)
        return self.o_proj(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, D))

    def __call__(self, x):
        x = x + self.attention(self.input_norm(x))
        h = self.post_norm(x)
        return x + self.w2(nnx.silu(self.w1(h)) * self.w3(h))


class NnxLlama(nnx.Module):
    def __init__(self, dtype=jnp.float32, dot_general=jax.lax.dot_general, *, rngs):
        self.embed = nnx.Embed(VOCAB, D, dtype=dtype, rngs=rngs)
        self.block = LlamaBlock(dtype=dtype, dot_general=dot_general, rngs=rngs)
        self.norm = RMSNorm(D, dtype=dtype)
        self.lm_head = nnx.Linear(D, VOCAB, use_bias=False, dtype=dtype, dot_general=dot_general, rngs=rngs)

    def __call__(self, tokens):
        return self.lm_head(self.norm(self.block(self.embed(tokens))))


# ---------------------------------------------------------------------------------------
# NNX MLP-Mixer
# ---------------------------------------------------------------------------------------
class MlpBlock(nnx.Module):
    def __init__(self, dim, hidden, *, dtype, dot_general, rngs):
        self.fc1 = nnx.Linear(dim, hidden, dtype=dtype, dot_general=dot_general, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, dim, dtype=dtype, dot_general=dot_general, rngs=rngs)

    def __call__(self, x):
        return self.fc2(nnx.gelu(self.fc1(x)))


class NnxMixer(nnx.Module):
    def __init__(self, dtype=jnp.float32, dot_general=jax.lax.dot_general, *, rngs, classes=10):
        tokens = (IMAGE // PATCH) ** 2
        kw = dict(dtype=dtype, dot_general=dot_general, rngs=rngs)
        self.stem = nnx.Conv(3, D, (PATCH, PATCH), strides=(PATCH, PATCH), padding="VALID", dtype=dtype, rngs=rngs)
        self.norm1, self.norm2, self.pre_head_norm = (nnx.LayerNorm(D, dtype=dtype, rngs=rngs) for _ in range(3))
        self.token_mixing = MlpBlock(tokens, 2 * tokens, **kw)
        self.channel_mixing = MlpBlock(D, HIDDEN, **kw)
        self.head = nnx.Linear(D, classes, **kw)

    def __call__(self, images):
        x = self.stem(images)
        b, h, w, c = x.shape
        x = x.reshape(b, h * w, c)
        x = x + jnp.swapaxes(self.token_mixing(jnp.swapaxes(self.norm1(x), 1, 2)), 1, 2)
        x = x + self.channel_mixing(self.norm2(x))
        return self.head(self.pre_head_norm(x).mean(axis=1))


# ---------------------------------------------------------------------------------------
# Equinox GPT-2
# ---------------------------------------------------------------------------------------
class EqxGPT2(eqx.Module):
    wte: eqx.nn.Embedding
    wpe: eqx.nn.Embedding
    ln_1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln_2: eqx.nn.LayerNorm
    c_fc: eqx.nn.Linear
    c_proj: eqx.nn.Linear
    ln_f: eqx.nn.LayerNorm

    def __init__(self, key):
        k = jax.random.split(key, 5)
        self.wte = eqx.nn.Embedding(weight=0.02 * jax.random.normal(k[0], (VOCAB, D)))
        self.wpe = eqx.nn.Embedding(weight=0.01 * jax.random.normal(k[1], (SEQ, D)))
        self.ln_1, self.ln_2, self.ln_f = (eqx.nn.LayerNorm(D, eps=1e-5) for _ in range(3))
        self.attn = eqx.nn.MultiheadAttention(HEADS, D, use_query_bias=True, use_key_bias=True,
                                              use_value_bias=True, use_output_bias=True, key=k[2])
        self.c_fc, self.c_proj = eqx.nn.Linear(D, 4 * D, key=k[3]), eqx.nn.Linear(4 * D, D, key=k[4])

    def __call__(self, tokens):  # (seq,) -> (seq, vocab)
        t = tokens.shape[0]
        x = jax.vmap(self.wte)(tokens) + jax.vmap(self.wpe)(jnp.arange(t))
        h = jax.vmap(self.ln_1)(x)
        x = x + self.attn(h, h, h, mask=jnp.tril(jnp.ones((t, t), bool)))
        h = jax.nn.gelu(jax.vmap(self.c_fc)(jax.vmap(self.ln_2)(x)), approximate=True)
        x = x + jax.vmap(self.c_proj)(h)
        return jax.vmap(self.ln_f)(x) @ self.wte.weight.T  # tied head


# ---------------------------------------------------------------------------------------
# Equinox ViT
# ---------------------------------------------------------------------------------------
class EqxViT(eqx.Module):
    patch: eqx.nn.Conv2d
    cls: jax.Array
    pos: jax.Array
    ln_1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln_2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key, classes=10):
        k = jax.random.split(key, 5)
        tokens = (IMAGE // PATCH) ** 2 + 1
        self.patch = eqx.nn.Conv2d(3, D, PATCH, stride=PATCH, key=k[0])
        self.cls = jnp.zeros((1, D))
        self.pos = 0.02 * jax.random.normal(k[1], (tokens, D))
        self.ln_1, self.ln_2, self.norm = (eqx.nn.LayerNorm(D) for _ in range(3))
        self.attn = eqx.nn.MultiheadAttention(HEADS, D, use_query_bias=True, use_key_bias=True,
                                              use_value_bias=True, use_output_bias=True, key=k[2])
        self.mlp = eqx.nn.MLP(D, D, HIDDEN, depth=1, activation=jax.nn.gelu, key=k[3])
        self.head = eqx.nn.Linear(D, classes, key=k[4])

    def __call__(self, image):  # (height, width, 3) -> (classes,)
        x = self.patch(jnp.transpose(image, (2, 0, 1)))  # (D, h, w): Equinox convs are channel-first
        x = jnp.concatenate([self.cls, x.reshape(D, -1).T]) + self.pos
        h = jax.vmap(self.ln_1)(x)
        x = x + self.attn(h, h, h)
        x = x + jax.vmap(self.mlp)(jax.vmap(self.ln_2)(x))
        return self.head(self.norm(x[0]))


NNX_SPECS = {
    "nnx-llama": (lambda dtype, **kw: NnxLlama(dtype, rngs=nnx.Rngs(0), **kw), next_token),
    "nnx-mlp-mixer": (lambda dtype, **kw: NnxMixer(dtype, rngs=nnx.Rngs(0), **kw),
                      classification(image=IMAGE, classes=10)),
}
EQX_SPECS = {
    "eqx-gpt2": (EqxGPT2, next_token),
    "eqx-vit": (EqxViT, classification(image=IMAGE, classes=10)),
}
