"""tools/jax_time_per_test.py: the per-test times JAX reports are summed per test and the
merged table adds up the files of every pytest process."""
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from tools import jax_time_per_test as tool


def test_listener_sums_jax_durations_of_the_running_test():
    tool._times.clear()
    jax.monitoring.register_event_duration_secs_listener(tool._listener)
    try:
        tool._current[0] = "t::a"
        jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)(jnp.arange(7.0)).block_until_ready()  # a new program
        tool._current[0] = None
        jax.jit(lambda x: jnp.cos(x) - 2.0)(jnp.arange(5.0)).block_until_ready()  # no test running
    finally:
        jax.monitoring.unregister_event_duration_listener(tool._listener)
    times = tool._times
    assert set(times) == {"t::a"}
    assert {"trace", "lower", "compile"} <= set(times["t::a"]) and all(v > 0 for v in times["t::a"].values())


def test_main_merges_the_processes_and_sorts_by_wall_time(tmp_path):
    prefix = str(tmp_path / "jt")
    Path(f"{prefix}_gw0.json").write_text(json.dumps({"t::slow": {"wall": 5.0, "compile": 3.0, "trace": 1.0}}))
    Path(f"{prefix}_gw1.json").write_text(json.dumps({"t::fast": {"wall": 1.0, "compile": 0.5, "lower": 0.25}}))
    lines = tool.main(prefix).splitlines()
    assert lines[0].startswith("2 tests")
    assert "| all | 6.0 | 3.5 | 1.0 | 0.2 |" in lines
    assert lines.index("| `t::slow` | 5.0 | 3.0 | 1.0 | 0.0 |") < lines.index("| `t::fast` | 1.0 | 0.5 | 0.0 | 0.2 |")
