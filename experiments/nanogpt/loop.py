"""The NanoGPT training loop: dispatch steps back to back, read the loss only when logging,
evaluate and checkpoint on a schedule, stop at the first non-finite loss.

The device runs step ``s`` while the host dispatches step ``s + 1``; reading a loss waits
for its step, so the loop reads losses only every ``log_every`` steps (`metrics.StepLog`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

from experiments.nanogpt.metrics import StepLog

__all__ = ["Schedule", "Progress", "run"]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Steps ``start + 1 .. stop``; logs, evaluations and checkpoints every so many steps
    and at `stop` (``checkpoint_every = 0``: no checkpoints)."""

    start: int
    stop: int
    log_every: int
    eval_every: int
    checkpoint_every: int

    def logs(self, s: int) -> bool:
        return s == self.start + 1 or s % self.log_every == 0 or s == self.stop  # the first step compiles

    def evaluates(self, s: int) -> bool:
        return s % self.eval_every == 0 or s == self.stop

    def checkpoints(self, s: int) -> bool:
        return bool(self.checkpoint_every) and (s % self.checkpoint_every == 0 or s == self.stop)


class Progress:
    """A tqdm progress bar, or nothing when disabled or when tqdm is missing."""

    def __init__(self, total: int, initial: int, desc: str, enabled: bool):
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:  # the device machine may lack tqdm
                return
            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=True)

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def postfix(self, **values: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix(**values)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(state, train_step: Callable, batches: Iterator, schedule: Schedule, log: StepLog,
        evaluate: Callable[[Any], float], save: Callable[[Any, int], None],
        progress: Progress) -> tuple[Any, int]:
    """Trains from ``schedule.start`` to ``schedule.stop`` (or to the first non-finite loss);
    returns the state and its step. `evaluate(state)` is the validation loss, `save(state,
    step)` writes a checkpoint."""
    s = schedule.start
    while s < schedule.stop and not log.diverged:
        x, y = next(batches)
        log.begin()
        state, loss = train_step(state, x, y)
        s += 1
        log.add(s, loss)
        progress.update()
        if schedule.logs(s):
            log.flush()
            progress.postfix(loss=f"{log.last_train:.4f}", tok_s=f"{log.tokens_per_s():,.0f}")
        if schedule.evaluates(s) and not log.diverged:
            log.flush()
            valid = evaluate(state)
            log.valid(s, valid)
            progress.postfix(loss=f"{log.last_train:.4f}", valid=f"{valid:.4f}")
        if schedule.checkpoints(s) and not log.diverged:
            save(state, s)
    log.flush()
    progress.close()
    return state, s
