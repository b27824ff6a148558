"""Evaluation of a NanoGPT training state: the validation loss and the snapshots of the
per-tensor scales (``scales.json``).

A snapshot holds, per kind of tensor (weights, activations, gradients, optimizer state),
``log2(scale)`` of every ScaledArray, from one forward/backward pass on a fixed batch.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from experiments.nanogpt import step as S

__all__ = ["evaluate", "mean_loss", "scale_snapshot", "ScaleSnapshots"]


def evaluate(eval_step, state, dataset, batch_size: int, seq_len: int, max_batches: int) -> float:
    """Mean validation loss over the first `max_batches` fixed batches."""
    return mean_loss(lambda x, y: eval_step(state.params, state.extra, x, y), dataset, batch_size, seq_len,
                     max_batches)


def mean_loss(loss_of, dataset, batch_size: int, seq_len: int, max_batches: int) -> float:
    """Mean of ``loss_of(tokens, targets)`` over the first `max_batches` fixed batches of
    the validation split."""
    losses = [loss_of(x, y) for x, y in dataset.eval_batches(batch_size, seq_len, max_batches)]
    if not losses:
        raise ValueError(
            f"The validation split has too few tokens ({len(dataset.valid_tokens)}) for one batch "
            f"of {batch_size} x {seq_len}: lower --batch-size or --seq-len.")
    return float(np.mean([float(l) for l in losses]))


def scale_snapshot(diag, state, batch) -> dict:
    """log2 of the scales of the state and of one step's activations and gradients;
    `diag` is `step.make_diagnostics_fn`'s function."""
    loss, acts, grads = diag(state.params, state.extra, *batch)
    return {
        "weights": S.scale_summary(state.params),
        "activations": S.scale_summary(acts),
        "gradients": S.scale_summary(grads),
        "optimizer_state": S.scale_summary(state.opt_state),
    }


class ScaleSnapshots:
    """Snapshots by step (``{"STEP": snapshot}``) kept in ``path``; on resume the file's
    snapshots are kept. Without `diag` (configs without scalify, ``--no-scales``) or
    `batch` (no validation batch) it takes none and writes nothing."""

    def __init__(self, path: Path, diag, batch, resume: bool):
        self.path, self.diag, self.batch = path, diag, batch
        self.snapshots = json.loads(path.read_text()) if (resume and path.exists()) else {}

    @property
    def enabled(self) -> bool:
        return self.diag is not None and self.batch is not None

    def take(self, step: int, state) -> None:
        if self.enabled:
            self.snapshots[str(step)] = scale_snapshot(self.diag, state, self.batch)

    def save(self) -> None:
        if self.enabled:
            self.path.write_text(json.dumps(self.snapshots, indent=1))
