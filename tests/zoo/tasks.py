"""The zoo's synthetic tasks: one fixed random batch each (batch 4), memorised in a few
Adam steps, so that the loss goes down. A task is its batch and its objective; the
objective casts the model's output to float32, as training code does with float16
logits."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
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


def _tokens():
    tokens = jax.random.randint(jax.random.PRNGKey(11), (BATCH, SEQ + 1), 0, VOCAB)
    return tokens[:, :-1], tokens[:, 1:]


# next-token prediction on a fixed batch of random tokens
next_token = Task("next_token", _tokens, _cross_entropy)

# a label per token (an encoder's token classification): random tokens, random labels
per_token = Task("per_token", lambda: (_tokens()[0], jax.random.randint(jax.random.PRNGKey(12), (BATCH, SEQ), 0, VOCAB)),
                 _cross_entropy)


def classification(classes, tokens=False, image=None):
    """Random labels for random sequences (tokens=True: padded with 0 after lengths 8, 6,
    5, 3) or random images (image x image x 3)."""
    def batch():
        labels = jax.random.randint(jax.random.PRNGKey(13), (BATCH,), 0, classes)
        if tokens:
            x = jax.random.randint(jax.random.PRNGKey(14), (BATCH, SEQ), 1, VOCAB)
            lengths = jnp.array([8, 6, 5, 3])
            return jnp.where(jnp.arange(SEQ)[None] < lengths[:, None], x, 0), labels
        return jax.random.normal(jax.random.PRNGKey(14), (BATCH, image, image, 3)), labels

    return Task(f"classification{classes}", batch, _cross_entropy)
