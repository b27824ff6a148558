"""Delayed statistics: data-dependent scale decisions taken from the previous step.

A drift guard (`guards.rebalance_drift`), a measured placement
(`rules.common.place_measured`) or a whole-tensor rescale (`ops.rescale.unit_rescale`)
reads a norm m of its data (max |data|, the RMS) and then moves the data by a power of two
that depends on m: the data pass waits for the reduction, two passes over the tensor.
Inside `delayed_statistics(previous)` the i-th such site of the trace instead decides from
`previous[i]`, and records what it measures now for the next step:

    record:    r_i = 2^floor(log2 m) * scale        the norm of the values, a power of two
    next step: m_est = r_i / scale'                 the data norm it implies at scale'

so the reduction no longer gates the data and XLA computes it apart (the delayed scaling of
TransformerEngine, applied to scalify's guards). Values, not data, are recorded: an earlier
site that moves a power of two between data and scale changes the data a later site sees
but not the values, so one step's records hold for the next whatever the earlier sites
decided. A record is NaN where there is none (the first step; zero, non-finite or
below-float32-normal values): the site keeps the propagated scale.

Sites under a sub-trace (a loop body, a `cond` branch, a re-traced call) measure as they do
without statistics. `previous=None` counts the sites: each measures as without statistics
and records (`DelayedStatistics.recorded`), e.g. under `jax.eval_shape` to size the vector.
"""
from __future__ import annotations

import contextlib
import threading

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from scalify.core.pow2 import clear_mantissa

__all__ = ["DelayedStatistics", "delayed_statistics", "active", "NO_RECORD"]

# The record of a site with nothing recorded (and of a fresh vector).
NO_RECORD = float("nan")

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

    def exchange(self, now, scale):
        """Record the norm `now` of data at the 0-d power-of-two `scale` (float32 scalars)
        for this site; return the previous step's record of the same site (a float32 value,
        NaN for none), or None when counting."""
        i = len(self._now)
        self._now.append((jnp.reshape(jnp.asarray(now, jnp.float32), ()),
                          jnp.reshape(jnp.asarray(scale, jnp.float32), ())))
        if self.previous is None:
            return None
        if i >= self.previous.shape[0]:
            raise ValueError(self._mismatch(f"more than {self.previous.shape[0]}"))
        return self.previous[i]

    def recorded(self):
        """float32[n]: this trace's records, one per site in trace order (module doc)."""
        if self.previous is not None and len(self._now) != self.previous.shape[0]:
            raise ValueError(self._mismatch(str(len(self._now))))
        if not self._now:
            return jnp.zeros((0,), jnp.float32)
        norms, scales = (jnp.stack(x) for x in zip(*self._now))
        values = clear_mantissa(norms) * scales
        kept = lax.is_finite(values) & (values >= np.float32(2.0**-126))
        return jnp.where(kept, values, np.float32(NO_RECORD))

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
