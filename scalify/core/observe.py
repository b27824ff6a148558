"""Observers of the interpreter: callables that see every equation's inputs and scaled outputs.

`scalify.inspect.scale_health` uses this to read the data and scales of a step as it runs
eagerly. While an observer is active, the jit rule interprets its sub-jaxpr inline (instead
of inside a new `jax.jit`), so that the observer sees concrete values there too.
"""
from __future__ import annotations

import contextlib
from typing import Callable

_OBSERVERS: list[Callable] = []


def active() -> bool:
    """Whether an observer is installed."""
    return bool(_OBSERVERS)


def notify(eqn, outs, ins=()) -> None:
    """Called by the interpreter after each equation with its outputs and inputs."""
    for observer in _OBSERVERS:
        observer(eqn, outs, ins)


@contextlib.contextmanager
def observing(observer: Callable):
    """Install `observer(eqn, outs, ins)` for the duration of the block."""
    _OBSERVERS.append(observer)
    try:
        yield observer
    finally:
        _OBSERVERS.remove(observer)
