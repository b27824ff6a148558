"""`benchmarks/concurrent_kernels.py`: the kernels of a device's other streams that overlap
each kernel matching a pattern, from synthetic Perfetto events."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from concurrent_kernels import concurrent, markdown, summary  # noqa: E402


def _k(ts, dur, op, tid, pid=1):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": op, "args": {"hlo_op": op}}


EVENTS = [
    {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
    {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "Stream #8(Compute)"}},
    {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:1"}},
    # GPU 0: a concatenation alone, then one under an all-reduce of the other stream.
    _k(0, 10, "wrapped_concatenate.1", 7), _k(20, 40, "wrapped_concatenate.2", 7),
    _k(15, 30, "all-reduce-start.3", 8), _k(70, 5, "fusion.1", 7),
    # GPU 1 (ignored: the first device only).
    _k(0, 99, "wrapped_concatenate.9", 7, pid=2),
]


def test_overlaps_on_other_streams_of_the_first_device():
    rows = concurrent(EVENTS, r"concatenate")
    assert [r["op"] for r in rows] == ["wrapped_concatenate.1", "wrapped_concatenate.2"]
    assert rows[0]["next_to"] == []
    assert rows[1]["next_to"] == [("all-reduce-start.3", 25.0)] and rows[1]["us"] == 40.0
    s = summary(rows)
    assert s["wrapped_concatenate.1"] == {"alone": [10.0], "shared": []}
    assert s["wrapped_concatenate.2"] == {"alone": [], "shared": [40.0]}
    assert "`all-reduce-start.3`: 25" in markdown("t", rows, 1)
