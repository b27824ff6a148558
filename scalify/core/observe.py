"""Observers of the interpreter: callables that see every equation's inputs and scaled outputs.

`scalify.inspect.scale_health` uses this to read the data and scales of a step as it runs
eagerly. While an observer is active, the jit rule interprets its sub-jaxpr inline (instead
of inside a new `jax.jit`), so that the observer sees concrete values there too, and the
interpreter keeps the stack of equations being run (`enclosing`): an equation of an
inlined sub-jaxpr (a `jnp` function's jit) is reached from the user's equation that
called it, whose source line and name stack (`transpose(...)` for the backward pass) the
inner equation lacks.
"""
from __future__ import annotations

import contextlib
from typing import Callable

_OBSERVERS: list[Callable] = []
_RUNNING: list = []  # equations being run, outermost first (only while observing)


def active() -> bool:
    """Whether an observer is installed."""
    return bool(_OBSERVERS)


def notify(eqn, outs, ins=()) -> None:
    """Called by the interpreter after each equation with its outputs and inputs."""
    for observer in _OBSERVERS:
        observer(eqn, outs, ins)


@contextlib.contextmanager
def running(eqn):
    """The interpreter runs `eqn` (and the sub-jaxprs its rule interprets) in this block."""
    _RUNNING.append(eqn)
    try:
        yield
    finally:
        _RUNNING.pop()


def enclosing() -> tuple:
    """The equations being run, outermost first: the last is the one being observed, the
    others the call equations (jit, scan, ...) whose sub-jaxpr contains it."""
    return tuple(_RUNNING)


@contextlib.contextmanager
def observing(observer: Callable):
    """Install `observer(eqn, outs, ins)` for the duration of the block."""
    _OBSERVERS.append(observer)
    try:
        yield observer
    finally:
        _OBSERVERS.remove(observer)
