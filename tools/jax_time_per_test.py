"""Where the test suite's time goes: JAX's trace, lowering and XLA compile time per test.

A pytest plugin: JAX reports the duration of each trace, lowering and backend compile
through `jax.monitoring`; this sums them per test (and the test's wall time) and writes
one JSON file per pytest process. Run the suite (or part of it) with it, then merge:

    python -m pytest -q -n 2 -p tools.jax_time_per_test tests/e2e
    python tools/jax_time_per_test.py            # totals and the slowest tests

Files go to `$JAX_TIME_PER_TEST` (default: `jax_time_per_test`), one
`<prefix>_<worker>.json` per process. Cache hits of the persistent compilation cache
cost no compile time, so a program compiled by two tests counts once.
"""
from __future__ import annotations

import collections
import glob
import json
import os
import sys
import time

import jax.monitoring
import pytest

EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
_PREFIX = os.environ.get("JAX_TIME_PER_TEST", "jax_time_per_test")
_current: list = [None]
_times: dict = collections.defaultdict(collections.Counter)


def _listener(event: str, duration: float, **_) -> None:
    if _current[0] is not None and event in EVENTS:
        _times[_current[0]][EVENTS[event]] += duration


def pytest_configure(config) -> None:
    jax.monitoring.register_event_duration_secs_listener(_listener)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _current[0] = item.nodeid
    start = time.perf_counter()
    yield
    _times[item.nodeid]["wall"] += time.perf_counter() - start
    _current[0] = None


def pytest_sessionfinish(session) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(f"{_PREFIX}_{worker}.json", "w") as f:
        json.dump({k: dict(v) for k, v in _times.items()}, f)


def main(prefix: str = _PREFIX, top: int = 25) -> str:
    """Merge the per-process files: totals, then the `top` tests by wall time."""
    times: dict = {}
    for path in sorted(glob.glob(f"{prefix}_*.json")):
        with open(path) as f:
            times.update(json.load(f))
    cols = ("wall", "compile", "trace", "lower")
    total = {c: sum(t.get(c, 0.0) for t in times.values()) for c in cols}
    lines = [f"{len(times)} tests; seconds of test calls (setup and fixtures excluded):", "",
             "| | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols),
             "| all | " + " | ".join(f"{total[c]:.1f}" for c in cols) + " |"]
    for name, t in sorted(times.items(), key=lambda kv: -kv[1].get("wall", 0.0))[:top]:
        lines.append(f"| `{name}` | " + " | ".join(f"{t.get(c, 0.0):.1f}" for c in cols) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(main(*sys.argv[1:2]))
