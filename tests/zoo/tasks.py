"""The zoo's synthetic tasks: one fixed random batch each (batch 4), memorised in a few
Adam steps, so that the loss goes down. A task is its batch and its objective; the
objective casts the model's output to float32, as training code does with float16
logits."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np
import optax

BATCH, SEQ, VOCAB = 4, 8, 64
AUX_WEIGHT = 0.01  # of a mixture of experts' load-balancing loss


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    batch: Callable[[], tuple]  # () -> (inputs, targets)
    objective: Callable  # (model output, targets) -> float32 scalar


def _cross_entropy(out, labels):
    """Mean cross-entropy of float32 logits; a model that also returns an auxiliary loss
    (a router's load balancing) returns (logits, aux)."""
    aux = 0.0
    if isinstance(out, tuple):
        out, aux = out
    ce = optax.softmax_cross_entropy_with_integer_labels(out.astype(jnp.float32), labels)
    return jnp.mean(ce) + AUX_WEIGHT * aux


# The batches come from NumPy's generator: drawn with jax.random op by op, each draw would
# compile a program of its own.
def _rng(seed):
    return np.random.default_rng(seed)


def _tokens():
    tokens = _rng(11).integers(0, VOCAB, (BATCH, SEQ + 1), dtype=np.int32)
    return jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])


# next-token prediction on a fixed batch of random tokens
next_token = Task("next_token", _tokens, _cross_entropy)


def _token_labels():
    return _tokens()[0], jnp.asarray(_rng(12).integers(0, VOCAB, (BATCH, SEQ), dtype=np.int32))


# a label per token (an encoder's token classification): random tokens, random labels
per_token = Task("per_token", _token_labels, _cross_entropy)


def classification(classes, tokens=False, image=None):
    """Random labels for random sequences (tokens=True: padded with 0 after lengths 8, 6,
    5, 3) or random images (image x image x 3)."""
    def batch():
        labels = jnp.asarray(_rng(13).integers(0, classes, (BATCH,), dtype=np.int32))
        if tokens:
            x = _rng(14).integers(1, VOCAB, (BATCH, SEQ), dtype=np.int32)
            lengths = np.array([8, 6, 5, 3])
            return jnp.asarray(np.where(np.arange(SEQ)[None] < lengths[:, None], x, 0)), labels
        return jnp.asarray(_rng(14).standard_normal((BATCH, image, image, 3), dtype=np.float32)), labels

    return Task(f"classification{classes}", batch, _cross_entropy)
