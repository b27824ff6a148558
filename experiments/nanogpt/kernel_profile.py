"""Where a compiled step spends device time: kernels grouped by HLO op, from a JAX profile.

``profile_kernels(run, n, hlo_text)`` runs ``run()`` ``n`` times under ``jax.profiler.trace``
with a Perfetto trace (plain JSON, no extra package), and sums the device events per HLO
instruction (``args.hlo_op``) and per category:

- ``gemm-fp8``: the kernels of ``__cublas$lt$matmul$f8`` custom calls (found in ``hlo_text``);
- ``gemm``: other GEMMs (cuBLAS / cuBLASLt custom calls, Triton GEMM fusions, or kernels
  named like GEMMs);
- ``reduce``: fusions that reduce and write less than they read (max-abs statistics, sums,
  norms' statistics); a fusion that writes its operand's size and reduces on the side (an
  optimizer update with the new parameters' max) counts as ``elementwise``;
- ``scalar``: other fusions with at most 64 output elements (scale arithmetic: such a
  kernel costs a launch, not bandwidth);
- ``elementwise``: other fusions (loop fusions: casts, scale multiplies, activations);
- ``copy``: copies, transposes, memcpy/memset; ``other``: the rest.

The kernels that are not GEMMs are also summed by source (``by_source``): the pass and the
module path of the JAX op each HLO instruction comes from (`scalify.inspect.hlo_op_sources`,
e.g. ``backward layers_*/feed_forward/w1``; ``-`` outside any module: the loss, the
optimizer), so that two programs of one model compare part by part.

Times are per step (total / n), in microseconds. ``busy_us`` is the sum of kernel times,
which can be compared with the step's wall time: a step much longer than its busy time is
bound by kernel launches, not by the GPU.

``timeline`` says where the rest of the wall time goes. It merges the device events into one
busy/idle timeline, cuts it into the ``n`` steps at its ``n - 1`` longest gaps (each profiled
call ends with ``block_until_ready``, so the host's return and next dispatch sit between
steps), and reports per step the device span (first kernel start to last kernel end), the
idle time inside the span as a histogram of gap lengths, the longest gaps with the kernels on
either side and what each host thread was doing in the middle of the gap (its innermost
event there), and the time between steps. On CPU the XLA host ops are reported instead (the
numbers then say little about a GPU).

"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile

import jax

from scalify.inspect.hlo import hlo_op_kinds, hlo_op_sources

__all__ = ["profile_kernels", "profile_train_steps", "summarize_trace", "timeline", "host_calls",
           "hlo_op_kinds", "markdown_profile", "markdown_timeline", "markdown_host_calls",
           "read_text", "read_trace"]

_GEMM_NAME = re.compile(r"gemm|xmma|cutlass|nvjet|cublas|matmul", re.I)
# FP8 in a kernel's name; cuBLASLt's nvjet kernels name operand types after "sm90_" (q E4M3,
# r E5M2: nvjet_sm90_qrtst is an E4M3 x E5M2 GEMM).
_FP8_NAME = re.compile(r"e4m3|e5m2|f8|fp8|sm90_[qr]{2}", re.I)


def _kernel_names(kinds: dict[str, str]) -> dict[str, str]:
    """Kernel name -> category: XLA names a fusion's kernel after it, with '.' and '-' as '_'."""
    return {**{re.sub(r"[.\-]", "_", k): v for k, v in kinds.items()}, **kinds}


def _device_pids(meta_events) -> set:
    gpu = {e["pid"] for e in meta_events if e.get("name") == "process_name"
           and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    return gpu


def summarize_trace(events: list[dict], n_steps: int, kinds: dict[str, str] | None = None,
                    sources: dict[str, str] | None = None) -> dict:
    """Per-step device time by category, by HLO op and (with ``sources``, HLO instruction ->
    `scalify.inspect.source_label`) by source for the kernels that are not GEMMs, from
    Perfetto trace events."""
    kinds = _kernel_names(kinds or {})
    sources = _kernel_names(sources or {})
    by_source = collections.defaultdict(lambda: [0.0, 0])
    meta = [e for e in events if e.get("ph") == "M"]
    pids = _device_pids(meta)
    on_device = bool(pids)
    by_op = collections.defaultdict(lambda: [0.0, 0, ""])
    by_cat = collections.defaultdict(float)
    kernels = 0
    tiny = [0, 0.0]  # kernels under 5 us: count, time
    for e in events:
        if e.get("ph") != "X":
            continue
        args = e.get("args") or {}
        if on_device:
            if e.get("pid") not in pids:
                continue
        elif "hlo_op" not in args:  # CPU: only XLA ops
            continue
        name = str(e.get("name", ""))
        op = str(args.get("hlo_op") or name or "?")
        if op.startswith("command_buffer"):  # a CUDA graph: its kernels are named after fusions
            op = name
        dur = float(e.get("dur", 0.0))
        cat = kinds.get(op)
        if cat is None:
            if re.search(r"memcpy|memset", name, re.I):
                cat = "copy"
            elif _GEMM_NAME.search(name):
                cat = "gemm-fp8" if _FP8_NAME.search(name) else "gemm"
            else:
                cat = "other"
        if dur < 5.0:
            tiny[0] += 1
            tiny[1] += dur
        by_op[op][0] += dur
        by_op[op][1] += 1
        by_op[op][2] = cat
        by_cat[cat] += dur
        kernels += 1
        if not cat.startswith("gemm"):
            src = by_source[sources.get(op, "(no op name)")]
            src[0] += dur
            src[1] += 1
    ops = sorted(((op, t / n_steps, c / n_steps, k) for op, (t, c, k) in by_op.items()),
                 key=lambda r: -r[1])
    families = collections.defaultdict(lambda: [0.0, 0.0])
    for op, t, c, k in ops:
        fam = families[(re.sub(r"[._]\d+$", "", op)[:60], k)]
        fam[0] += t
        fam[1] += c
    fams = sorted(families.items(), key=lambda kv: -kv[1][0])
    return {
        "device_events": on_device,
        "families": [{"family": f, "kind": k, "us": round(t, 2), "kernels": c} for (f, k), (t, c) in fams[:40]],
        "kernels_per_step": kernels / n_steps,
        "busy_us": sum(by_cat.values()) / n_steps,
        "kernels_under_5us_per_step": tiny[0] / n_steps,
        "kernels_under_5us_us": tiny[1] / n_steps,
        "by_category_us": {k: v / n_steps for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_ops": [{"op": o, "us": round(t, 2), "calls": c, "kind": k} for o, t, c, k in ops[:40]],
        "by_source": [{"source": src, "us": round(t / n_steps, 2), "kernels": c / n_steps}
                      for src, (t, c) in sorted(by_source.items(), key=lambda kv: -kv[1][0])],
    }


_GAP_BUCKETS_US = (2.0, 5.0, 10.0, 50.0, 200.0, 1000.0)
_DERIVED_LINES = re.compile(r"XLA Modules|XLA Ops|Steps|Framework|Source code", re.I)


def _thread_names(meta_events) -> dict:
    return {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", ""))
            for e in meta_events if e.get("name") == "thread_name"}


def _split_events(events: list[dict]):
    """(thread names, device kernels as sorted (start, end, event), host events) of a trace;
    the derived lines of the device (XLA Modules / Ops, ...) repeat its kernels and are left out."""
    meta = [e for e in events if e.get("ph") == "M"]
    pids, names = _device_pids(meta), _thread_names(meta)
    device, host = [], []
    for e in events:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        if e.get("pid") not in pids:
            host.append(e)
        elif not _DERIVED_LINES.search(names.get((e["pid"], e.get("tid")), "")):
            device.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e))
    return names, sorted(device, key=lambda iv: iv[0]), host


def _merge(intervals):
    """Sorted (start, end, event) -> merged [start, end, first event, last event]."""
    merged = []
    for start, end, e in sorted(intervals, key=lambda iv: iv[0]):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1][1], merged[-1][3] = end, e
        else:
            merged.append([start, end, e, e])
    return merged


def _op(e) -> str:
    args = e.get("args") or {}
    op = str(args.get("hlo_op") or e.get("name", "?"))
    return str(e.get("name", "?")) if op.startswith("command_buffer") else op


def _family(op: str) -> str:
    return re.sub(r"[._]\d+$", "", op)[:60]


def _host_activity(host_events, t: float, names: dict) -> dict:
    """Innermost host event of each thread that covers time ``t``."""
    inner = {}
    for e in host_events:
        if e["ts"] <= t <= e["ts"] + e.get("dur", 0.0):
            key = names.get((e["pid"], e.get("tid")), str(e.get("tid")))
            if key not in inner or e.get("dur", 0.0) < inner[key].get("dur", 0.0):
                inner[key] = e
    return {k: str(e.get("name", "?"))[:80] for k, e in sorted(inner.items())}


def _step_cuts(merged, n_steps: int) -> list[int]:
    """Indices i of a merged busy timeline after which a step ends: its n - 1 longest idle
    gaps (each profiled call ends with ``block_until_ready``)."""
    gaps = [(merged[i + 1][0] - merged[i][1], i) for i in range(len(merged) - 1)]
    return sorted(i for _, i in sorted(gaps, reverse=True)[:max(n_steps - 1, 0)])


def timeline(events: list[dict], n_steps: int, kinds: dict[str, str] | None = None,
             top_gaps: int = 12) -> dict:
    """Busy and idle time of the device per step, and the longest idle gaps (module doc)."""
    kinds = _kernel_names(kinds or {})
    names, device, host = _split_events(events)
    if not device:
        return {"error": "no device events in the trace"}
    merged = _merge(device)
    gaps = [(merged[i + 1][0] - merged[i][1], i) for i in range(len(merged) - 1)]
    cuts = _step_cuts(merged, n_steps)
    cut_set = set(cuts)
    between = [g for g, i in gaps if i in cut_set]
    inside = [(g, i) for g, i in gaps if i not in cut_set]
    span = sum(merged[j][1] for j in cuts + [len(merged) - 1]) - sum(
        merged[j][0] for j in [0] + [c + 1 for c in cuts])
    busy = sum(end - start for start, end, _, _ in merged)
    edges = (0.0,) + _GAP_BUCKETS_US + (float("inf"),)
    hist = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = [g for g, _ in inside if lo <= g < hi]
        label = f">= {lo:g} us" if hi == float("inf") else f"{lo:g}-{hi:g} us"
        hist.append({"gap": label, "gaps": len(sel) / n_steps, "us": sum(sel) / n_steps})
    by_next = collections.defaultdict(lambda: [0.0, 0])
    for g, i in inside:
        op = _op(merged[i + 1][2])
        key = (_family(op), kinds.get(op, ""))
        by_next[key][0] += g
        by_next[key][1] += 1
    longest = []
    for g, i in sorted(inside, reverse=True)[:top_gaps]:
        before, after = merged[i][3], merged[i + 1][2]
        longest.append({"us": round(g, 2), "before": _op(before)[:60], "after": _op(after)[:60],
                        "host": _host_activity(host, merged[i][1] + g / 2, names)})
    return {
        "device_lines": sorted({names.get((e["pid"], e.get("tid")), str(e.get("tid")))
                                for _, _, e in device}),
        "span_us": span / n_steps,
        "busy_union_us": busy / n_steps,
        "idle_in_step_us": sum(g for g, _ in inside) / n_steps,
        "between_steps_us": (sum(between) / len(between)) if between else None,
        "gap_histogram": hist,
        "idle_before": [{"family": f, "kind": k, "us": round(t / n_steps, 1), "gaps": c / n_steps}
                        for (f, k), (t, c) in sorted(by_next.items(), key=lambda kv: -kv[1][0])[:15]],
        "longest_gaps": longest,
    }


def host_calls(events: list[dict], top: int = 12) -> dict:
    """What the host does in each profiled call of a jitted function (module doc).

    A call is an outermost ``PjitFunction(...)`` event of the host. Per call: its host time,
    the time from its start to the first device kernel after it (``to_first_kernel_us``),
    and from the last kernel before the next call to that call's start (``after_last_kernel_us``:
    the wait's return, the Python around the call, the next dispatch's start). ``events``
    sums the host events inside the calls by name (nested events are each counted).
    """
    _, kernels, host = _split_events(events)
    device = [(start, end) for start, end, _ in kernels]
    calls = sorted((e for e in host if str(e.get("name", "")).startswith("PjitFunction(")),
                   key=lambda e: (e["ts"], -e["dur"]))
    outer = []
    for e in calls:
        if not outer or e["ts"] >= outer[-1]["ts"] + outer[-1]["dur"]:
            outer.append(e)
    if not outer or not device:
        return {"error": "no PjitFunction calls or no device events in the trace"}
    rows = []
    for i, c in enumerate(outer):
        start, end = float(c["ts"]), float(c["ts"]) + float(c["dur"])
        nxt = float(outer[i + 1]["ts"]) if i + 1 < len(outer) else float("inf")
        first = next((a for a, _ in device if a >= start), None)
        last = max((b for a, b in device if start <= a < nxt), default=None)
        rows.append({"call": str(c["name"])[:60], "host_us": round(end - start, 1),
                     "to_first_kernel_us": None if first is None else round(first - start, 1),
                     "after_last_kernel_us": None if (last is None or nxt == float("inf"))
                     else round(nxt - last, 1)})
    inside = collections.defaultdict(lambda: [0.0, 0])
    for e in host:
        t = float(e["ts"])
        if any(c["ts"] <= t <= c["ts"] + c["dur"] for c in outer):
            entry = inside[str(e.get("name", "?"))[:70]]
            entry[0] += float(e.get("dur", 0.0))
            entry[1] += 1
    n = len(outer)
    return {"calls": rows,
            "events": [{"name": k, "us_per_call": round(t / n, 1), "count_per_call": c / n}
                       for k, (t, c) in sorted(inside.items(), key=lambda kv: -kv[1][0])[:top]]}


def markdown_host_calls(hc: dict) -> list[str]:
    """Lines of markdown for a `host_calls` result."""
    if "error" in hc:
        return [f"host calls unavailable: {hc['error']}"]
    lines = ["| call | host time (us) | call start to first kernel (us) | last kernel to next call (us) |",
             "|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:,.0f}"  # noqa: E731
    lines += [f"| `{r['call']}` | {fmt(r['host_us'])} | {fmt(r['to_first_kernel_us'])} | "
              f"{fmt(r['after_last_kernel_us'])} |" for r in hc["calls"]]
    lines += ["", "| host event inside the calls | us/call | count/call |", "|---|---|---|"]
    lines += [f"| `{r['name']}` | {r['us_per_call']:,.0f} | {r['count_per_call']:g} |" for r in hc["events"]]
    return lines


def read_trace(path: str) -> list[dict]:
    """The events of a (gzipped) Perfetto JSON trace."""
    with gzip.open(path) as f:
        doc = json.load(f)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def read_text(path: str) -> str:
    """A text file, gzipped when its name ends in .gz (optimized HLO dumps)."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return f.read()


def _profile_events(events: list[dict], n_steps: int, hlo_text: str) -> dict:
    """`summarize_trace`, plus `timeline` and `host_calls` when the trace has device events."""
    kinds = hlo_op_kinds(hlo_text)
    prof = summarize_trace(events, n_steps, kinds, hlo_op_sources(hlo_text))
    if prof["device_events"]:
        prof["timeline"] = timeline(events, n_steps, kinds)
        prof["host_calls"] = host_calls(events)
    return prof


def profile_kernels(run, n_steps: int, hlo_text: str = "", trace_dir: str | None = None) -> dict:
    """Profiles ``n_steps`` calls of ``run`` (which must block); see the module doc."""
    trace_dir = trace_dir or tempfile.mkdtemp(prefix="kernel-profile-")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(n_steps):
            run()
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        return {"error": f"no perfetto_trace.json.gz under {trace_dir}"}
    prof = _profile_events(read_trace(paths[-1]), n_steps, hlo_text)
    prof["trace_path"] = paths[-1]
    return prof


def profile_train_steps(compiled, state, x, y, n_steps: int, hlo_text: str = "",
                        trace_dir: str | None = None):
    """`profile_kernels` of `n_steps` calls of a compiled train step `(state, x, y) ->
    (state, loss)` (the state is threaded through, as donated buffers require).
    Returns (profile, the final state)."""
    holder = [state]

    def run():
        holder[0], loss = compiled(holder[0], x, y)
        jax.block_until_ready((holder[0], loss))

    return profile_kernels(run, n_steps, hlo_text, trace_dir), holder[0]


def markdown_profile(name: str, prof: dict, step_ms: float | None = None) -> str:
    """One config's profile as markdown: categories, then the top HLO ops."""
    if "error" in prof:
        return f"### {name}\n\nprofile unavailable: {prof['error']}\n"
    wall = f", step wall time {1e3 * step_ms:,.0f} us" if step_ms else ""
    lines = [f"### {name}", "",
             f"{prof['kernels_per_step']:,.0f} kernels per step, device busy {prof['busy_us']:,.0f} us"
             f"{wall}{'' if prof['device_events'] else ' (host XLA ops: no device events)'}; "
             f"{prof['kernels_under_5us_per_step']:,.0f} kernels under 5 us "
             f"({prof['kernels_under_5us_us']:,.0f} us)", "",
             "| category | us/step | share |", "|---|---|---|"]
    busy = prof["busy_us"] or 1.0
    for k, v in prof["by_category_us"].items():
        lines.append(f"| {k} | {v:,.0f} | {100 * v / busy:.1f}% |")
    lines += ["", "| kernel family (name without its number) | kind | us/step | kernels/step |",
              "|---|---|---|---|"]
    for r in prof.get("families", [])[:25]:
        lines.append(f"| `{r['family']}` | {r['kind'] or '-'} | {r['us']:,.1f} | {r['kernels']:g} |")
    if prof.get("by_source"):
        lines += ["", "| source of the kernels that are not GEMMs (pass, module) | us/step | kernels/step |",
                  "|---|---|---|"]
        for r in prof["by_source"][:30]:
            lines.append(f"| `{r['source']}` | {r['us']:,.1f} | {r['kernels']:g} |")
    lines += ["", "| HLO op | kind | us/step | kernels/step |", "|---|---|---|---|"]
    for r in prof["top_ops"][:25]:
        lines.append(f"| `{r['op']}` | {r['kind'] or '-'} | {r['us']:,.1f} | {r['calls']:g} |")
    if "timeline" in prof:
        lines += [""] + markdown_timeline(prof["timeline"])
    if "host_calls" in prof:
        lines += [""] + markdown_host_calls(prof["host_calls"])
    return "\n".join(lines) + "\n"


def markdown_timeline(tl: dict) -> list[str]:
    """Lines of markdown for a `timeline` result."""
    if "error" in tl:
        return [f"timeline unavailable: {tl['error']}"]
    between = tl["between_steps_us"]
    lines = [f"Timeline per step: device span {tl['span_us']:,.0f} us, busy (union of kernels) "
             f"{tl['busy_union_us']:,.0f} us, idle inside the span {tl['idle_in_step_us']:,.0f} us"
             + (f"; {between:,.0f} us between steps (host return and dispatch)" if between else "")
             + f". Device lines: {', '.join(tl['device_lines'])}.", "",
             "| idle gap | gaps/step | us/step |", "|---|---|---|"]
    lines += [f"| {h['gap']} | {h['gaps']:,.1f} | {h['us']:,.0f} |" for h in tl["gap_histogram"]]
    lines += ["", "| idle before (kernel family) | kind | us/step | gaps/step |", "|---|---|---|---|"]
    lines += [f"| `{r['family']}` | {r['kind'] or '-'} | {r['us']:,.1f} | {r['gaps']:g} |"
              for r in tl["idle_before"]]
    lines += ["", "| longest gaps (us) | kernel before the gap | kernel after it | host threads in the gap (innermost event) |",
              "|---|---|---|---|"]
    for g in tl["longest_gaps"]:
        host = "; ".join(f"{k}: {v}" for k, v in g["host"].items()) or "-"
        lines.append(f"| {g['us']:,.1f} | `{g['before']}` | `{g['after']}` | {host} |")
    return lines
