"""Delayed statistics: data-dependent scale decisions taken from the previous step.

A drift guard (`scale_flow.rebalance_drift`) or a measured placement
(`rules.common.place_measured`) reads m = max |data| and then moves the data by a power of
two that depends on m: the data pass waits for the reduction, two passes over the tensor.
Inside `delayed_statistics(previous)` the i-th such site of the trace instead decides from
`previous[i]`, and records what it measures now for the next step:

    record:    e_i = floor(log2 m) + log2(scale)       the exponent of max |value|
    next step: m_est = 2^(e_i - log2(scale'))          the data max it implies at scale'

so the reduction no longer gates the data and XLA computes it in the same pass (the
delayed scaling of TransformerEngine, applied to scalify's guards). Values, not data, are
recorded: an earlier site that moves a power of two between data and scale changes the
data a later site sees but not the values, so one step's records hold for the next
whatever the earlier sites decided. A record of -inf (the first step, all-zero or
non-finite values) leaves the propagated scale as it is.

Sites under a sub-trace (a loop body, a `cond` branch, a re-traced call) measure as they do
without statistics. `previous=None` counts the sites: each measures as without statistics
and records (`DelayedStatistics.recorded`), e.g. under `jax.eval_shape` to size the vector.
"""
from __future__ import annotations

import contextlib
import threading

import jax.numpy as jnp
from jax.extend import core as jex_core

__all__ = ["DelayedStatistics", "delayed_statistics", "active", "NO_RECORD"]

# The record of a site that saw no finite, non-zero value (and of a fresh vector).
NO_RECORD = float("-inf")

_LOCAL = threading.local()


class DelayedStatistics:
    """The records of one trace: `previous` (float32[n] or None to count) in, `recorded()` out."""

    def __init__(self, previous=None):
        if previous is not None:
            previous = jnp.asarray(previous)
            if previous.ndim != 1 or previous.dtype != jnp.float32:
                raise ValueError(f"Delayed statistics are a float32 vector, got {previous.dtype}{list(previous.shape)}.")
        self.previous = previous
        self._now = []
        self._trace = jex_core.get_opaque_trace_state()

    def at_top(self) -> bool:
        """Whether the current trace is the one the statistics were opened in."""
        return jex_core.get_opaque_trace_state() == self._trace

    def exchange(self, now):
        """Record `now` (a float32 scalar) for this site; return the previous step's record
        of the same site, or None when counting."""
        i = len(self._now)
        self._now.append(jnp.reshape(jnp.asarray(now, jnp.float32), ()))
        if self.previous is None:
            return None
        if i >= self.previous.shape[0]:
            raise ValueError(self._mismatch(f"more than {self.previous.shape[0]}"))
        return self.previous[i]

    def recorded(self):
        """float32[n]: this trace's records, one per site in trace order."""
        if self.previous is not None and len(self._now) != self.previous.shape[0]:
            raise ValueError(self._mismatch(str(len(self._now))))
        if not self._now:
            return jnp.zeros((0,), jnp.float32)
        return jnp.stack(self._now)

    @property
    def count(self) -> int:
        return len(self._now)

    def _mismatch(self, seen: str) -> str:
        return (f"The state's delayed statistics have {self.previous.shape[0]} records and this step "
                f"has {seen} measured sites: the state was made for another step (another model, "
                "recipe or input shape). Start from the step's own init(params).")


def active() -> DelayedStatistics | None:
    """The statistics open in the current trace, else None."""
    stats = getattr(_LOCAL, "stats", None)
    return stats if stats is not None and stats.at_top() else None


@contextlib.contextmanager
def delayed_statistics(previous=None):
    """Context manager: the measured sites traced inside it decide from `previous` and
    record for the next step (module doc); yields the `DelayedStatistics`."""
    saved = getattr(_LOCAL, "stats", None)
    _LOCAL.stats = stats = DelayedStatistics(previous)
    try:
        yield stats
    finally:
        _LOCAL.stats = saved
