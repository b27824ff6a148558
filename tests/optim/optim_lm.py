"""A tiny word-level language model whose Adam moments are the "real" moments of the
quantisation reproductions (tests and benchmarks/optim_memory.py).

Corpus: the WikiText-103 validation split (`wiki.valid.tokens`) of the directory named by
the environment variable SCALIFY_WIKITEXT_DIR when it is set, else the Python
documentation topics shipped with CPython (`pydoc_data.topics`, always available offline). Vocabulary: the 1023 most frequent words
plus <unk>. Model: predict a word from the two previous ones: embeddings (1024 x 32) ->
concat -> tanh layer (64 -> 128) -> output layer (128 x 1024). 40 steps of float32 Adam
(lr 1e-3, batch 256). Word frequencies make the moments of the embedding and output rows
very uneven across rows -- the case block-wise quantisation is designed for.
"""
from __future__ import annotations

import collections
import functools
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

VOCAB, DIM, HIDDEN, BATCH, STEPS = 1024, 32, 128, 256, 40
_WIKITEXT_DIR = os.environ.get("SCALIFY_WIKITEXT_DIR")
_WIKITEXT = pathlib.Path(_WIKITEXT_DIR) / "wiki.valid.tokens" if _WIKITEXT_DIR else None


@functools.cache
def corpus() -> tuple[np.ndarray, str]:
    """Token ids (int32) and the corpus name."""
    if _WIKITEXT is not None:
        words, name = _WIKITEXT.read_text(encoding="utf-8").split(), "WikiText-103 valid"
    else:
        from pydoc_data.topics import topics

        words, name = " ".join(topics[k] for k in sorted(topics)).split(), "pydoc topics"
    words = words[:200_000]
    vocab = {w: i + 1 for i, (w, _) in enumerate(collections.Counter(words).most_common(VOCAB - 1))}
    return np.asarray([vocab.get(w, 0) for w in words], np.int32), name


def init_params(seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "emb": jax.random.normal(k[0], (VOCAB, DIM)) * 0.1,
        "hidden": {"w": jax.random.normal(k[1], (2 * DIM, HIDDEN)) / np.sqrt(2 * DIM), "b": jnp.zeros(HIDDEN)},
        "out": {"w": jax.random.normal(k[2], (HIDDEN, VOCAB)) / np.sqrt(HIDDEN), "b": jnp.zeros(VOCAB)},
    }


def loss_fn(params, ctx, target):
    x = params["emb"][ctx].reshape(ctx.shape[0], -1)
    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
    logits = h @ params["out"]["w"] + params["out"]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, target).mean()


@functools.cache
def adam_moments(steps: int = STEPS):
    """(params, optax.ScaleByAdamState) after `steps` of float32 Adam on the corpus."""
    tokens, _ = corpus()
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(tokens) - 3, size=(steps, BATCH))
    ctx = np.stack([tokens[starts], tokens[starts + 1]], -1)
    tgt = tokens[starts + 2]
    tx = optax.scale_by_adam()

    @jax.jit
    def train(params, ctx, tgt):
        def body(carry, batch):
            p, s = carry
            loss, g = jax.value_and_grad(loss_fn)(p, *batch)
            u, s = tx.update(g, s, p)
            return (jax.tree.map(lambda a, b: a - 1e-3 * b, p, u), s), loss

        return jax.lax.scan(body, (params, tx.init(params)), (ctx, tgt))

    params = init_params()
    (params, state), _ = train(params, jnp.asarray(ctx), jnp.asarray(tgt))
    return params, state
