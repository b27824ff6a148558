"""The kernel profile's trace summary (experiments/nanogpt/kernel_profile.py).

The HLO classification it uses is tested in tests/inspect/test_hlo.py."""
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments.nanogpt.kernel_profile import (host_calls, hlo_op_kinds, markdown_host_calls, markdown_profile,
                                               markdown_timeline, profile_kernels, summarize_trace, timeline)

HLO = (Path(__file__).resolve().parents[1] / "data" / "hlo" / "kinds.hlo").read_text()  # see tests/inspect


def test_summarize_trace_sums_device_events_per_step():
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "name": "nvjet_tst_e4m3", "dur": 30.0, "args": {"hlo_op": "g"}},
        {"ph": "X", "pid": 1, "name": "reduce_kernel", "dur": 10.0, "args": {"hlo_op": "amax"}},
        {"ph": "X", "pid": 1, "name": "reduce_kernel", "dur": 10.0, "args": {"hlo_op": "amax"}},
        {"ph": "X", "pid": 1, "name": "Memset", "dur": 4.0, "args": {}},
        {"ph": "X", "pid": 1, "name": "loop_mul_fusion_2", "dur": 6.0, "args": {"hlo_op": "command_buffer_1"}},
        {"ph": "X", "pid": 2, "name": "host work", "dur": 999.0, "args": {"hlo_op": "g"}},
    ]
    sources = {"amax": "forward lm_head", "loop_mul_fusion.2": "backward lm_head"}
    prof = summarize_trace(events, n_steps=2, kinds={**hlo_op_kinds(HLO), "loop_mul_fusion.2": "scalar"},
                           sources=sources)
    assert prof["device_events"]
    assert prof["kernels_per_step"] == 2.5
    assert prof["busy_us"] == 30.0
    assert prof["by_category_us"] == {"gemm-fp8": 15.0, "reduce": 10.0, "scalar": 3.0, "copy": 2.0}
    assert prof["top_ops"][0] == {"op": "g", "us": 15.0, "calls": 0.5, "kind": "gemm-fp8"}
    assert prof["kernels_under_5us_per_step"] == 0.5
    # the kernels that are not GEMMs by source; the memset has no HLO op
    assert prof["by_source"] == [{"source": "forward lm_head", "us": 10.0, "kernels": 1.0},
                                 {"source": "backward lm_head", "us": 3.0, "kernels": 0.5},
                                 {"source": "(no op name)", "us": 2.0, "kernels": 0.5}]
    md = markdown_profile("x", prof, step_ms=0.1)
    assert "gemm-fp8 | 15" in md and "| `forward lm_head` | 10.0 | 1 |" in md


def test_profile_kernels_on_this_backend(tmp_path):
    f = jax.jit(lambda x: jnp.tanh(x) @ x)
    x = jnp.ones((64, 64))
    compiled = f.lower(x).compile()
    compiled(x).block_until_ready()
    prof = profile_kernels(lambda: compiled(x).block_until_ready(), 2, compiled.as_text(), str(tmp_path))
    assert prof["kernels_per_step"] >= 1
    assert prof["busy_us"] > 0


def test_timeline_cuts_steps_at_the_longest_gaps_and_reports_idle_inside():
    def k(ts, dur, op, tid=7):
        return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": op, "args": {"hlo_op": op}}

    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "tid": 3, "name": "thread_name", "args": {"name": "python"}},
        # step 1: g [0, 10), overlapping s [5, 12), gap 30, amax [42, 50)
        k(0, 10, "g"), k(5, 7, "s", tid=8), k(42, 8, "amax"),
        # step 2 after a 1000 us gap: g [1050, 1060), gap 4, amax [1064, 1070)
        k(1050, 10, "g"), k(1064, 6, "amax"),
        k(0, 2000, "derived", tid=9),  # a derived line: ignored
        {"ph": "X", "pid": 2, "tid": 3, "ts": 0, "dur": 100, "name": "Execute"},
        {"ph": "X", "pid": 2, "tid": 3, "ts": 20, "dur": 10, "name": "cuLaunchKernel"},
    ]
    tl = timeline(events, n_steps=2, kinds=hlo_op_kinds(HLO))
    assert tl["between_steps_us"] == 1000
    assert tl["span_us"] == (50 + 20) / 2
    assert tl["busy_union_us"] == (12 + 8 + 10 + 6) / 2
    assert tl["idle_in_step_us"] == (30 + 4) / 2
    assert {h["gap"]: h["gaps"] for h in tl["gap_histogram"] if h["gaps"]} == {"2-5 us": 0.5, "10-50 us": 0.5}
    assert tl["idle_before"][0] == {"family": "amax", "kind": "reduce", "us": 17.0, "gaps": 1.0}
    first = tl["longest_gaps"][0]
    assert (first["us"], first["before"], first["after"]) == (30, "s", "amax")
    assert first["host"] == {"python": "cuLaunchKernel"}
    assert "| 30.0 | `s` | `amax` | python: cuLaunchKernel |" in "\n".join(markdown_timeline(tl))


def test_host_calls_time_from_dispatch_to_first_kernel_and_after_the_last():
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 2, "tid": 3, "ts": 0, "dur": 50, "name": "PjitFunction(jit(step))"},
        {"ph": "X", "pid": 2, "tid": 3, "ts": 0, "dur": 50, "name": "PjitFunction(jit(step))"},  # nested twin
        {"ph": "X", "pid": 2, "tid": 3, "ts": 10, "dur": 30, "name": "cuGraphLaunch"},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 20, "dur": 100, "name": "k", "args": {}},
        {"ph": "X", "pid": 2, "tid": 3, "ts": 200, "dur": 40, "name": "PjitFunction(jit(step))"},
        {"ph": "X", "pid": 2, "tid": 3, "ts": 205, "dur": 20, "name": "cuGraphLaunch"},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 230, "dur": 100, "name": "k", "args": {}},
    ]
    hc = host_calls(events)
    assert [(r["host_us"], r["to_first_kernel_us"], r["after_last_kernel_us"]) for r in hc["calls"]] == [
        (50, 20, 80), (40, 30, None)]
    assert {r["name"]: r["us_per_call"] for r in hc["events"]}["cuGraphLaunch"] == 25
    assert "| `PjitFunction(jit(step))` | 50 | 20 | 80 |" in "\n".join(markdown_host_calls(hc))
