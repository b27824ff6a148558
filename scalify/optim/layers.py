"""Flax layers that go with the low-precision optimizers."""
from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["StableEmbedding"]


class StableEmbedding(nn.Module):
    """Embedding with Xavier uniform init and a LayerNorm on its output (Dettmers et al.
    2022, "8-bit Optimizers via Block-wise Quantization", Sec. 2.3; bitsandbytes
    `StableEmbedding`).

    Rare tokens get rare, large gradients; the paper found that with 8-bit optimizers the
    usual N(0, 1) embedding init makes training unstable, and that Xavier uniform init
    (`U(-a, a)`, `a = sqrt(6 / (num_embeddings + features))`) followed by a layer norm
    of the output, before adding position embeddings, keeps the output variance near 1.
    bitsandbytes also keeps this layer's optimizer state in 32 bits: route its params to
    `optax.adamw` with `optax.multi_transform` (docs/optimizers.md), or rely on
    `adamw_8bit(min_size=...)` for small vocabularies.

    Attributes:
      num_embeddings: vocabulary size.
      features: embedding size.
      dtype: dtype of the output (default: inferred, float32 with float32 params).
      param_dtype: dtype of the embedding table and LayerNorm params.
      embedding_init: initializer of the table (Xavier uniform).
      epsilon: LayerNorm epsilon.
    """

    num_embeddings: int
    features: int
    dtype: Optional[Any] = None
    param_dtype: Any = jnp.float32
    embedding_init: Callable = nn.initializers.xavier_uniform()
    epsilon: float = 1e-5

    def setup(self):
        self.embedding = self.param(
            "embedding", self.embedding_init, (self.num_embeddings, self.features), self.param_dtype
        )
        self.norm = nn.LayerNorm(epsilon=self.epsilon, dtype=self.dtype, param_dtype=self.param_dtype)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Normalised embeddings of integer `inputs`: `LayerNorm(table[inputs])`."""
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"StableEmbedding expects integer token ids, got dtype {inputs.dtype}.")
        table = self.embedding if self.dtype is None else self.embedding.astype(self.dtype)
        return self.norm(jnp.take(table, inputs, axis=0))

    def attend(self, query: jax.Array) -> jax.Array:
        """Logits of a tied output head: `query @ table.T` (no LayerNorm, as `nn.Embed`)."""
        table = self.embedding if self.dtype is None else self.embedding.astype(self.dtype)
        return jnp.dot(query, table.T)
