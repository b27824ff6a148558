"""Where a compiled step spends device time: kernels grouped by HLO op, from a JAX profile.

``profile_kernels(run, n, hlo_text)`` runs ``run()`` ``n`` times under ``jax.profiler.trace``
with a Perfetto trace (plain JSON, no extra package), and sums the device events per HLO
instruction (``args.hlo_op``) and per category:

- ``gemm-fp8``: the kernels of ``__cublas$lt$matmul$f8`` custom calls (found in ``hlo_text``);
- ``gemm``: other GEMMs (cuBLAS / cuBLASLt custom calls, Triton GEMM fusions, or kernels
  named like GEMMs);
- ``reduce``: fusions whose HLO computation contains a ``reduce`` (norms, max-abs, sums);
- ``scalar``: other fusions with at most 64 output elements (scale arithmetic: such a
  kernel costs a launch, not bandwidth);
- ``elementwise``: other fusions (loop fusions: casts, scale multiplies, activations);
- ``copy``: copies, transposes, memcpy/memset; ``other``: the rest.

Times are per step (total / n), in microseconds. ``busy_us`` is the sum of kernel times,
which can be compared with the step's wall time: a step much longer than its busy time is
bound by kernel launches, not by the GPU. On CPU the XLA host ops are reported instead (the
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

__all__ = ["profile_kernels", "profile_train_steps", "summarize_trace", "hlo_op_kinds", "markdown_profile"]

_GEMM_NAME = re.compile(r"gemm|xmma|cutlass|nvjet|cublas|matmul", re.I)
_FP8_NAME = re.compile(r"e4m3|e5m2|f8|fp8", re.I)


def _kernel_names(kinds: dict[str, str]) -> dict[str, str]:
    """Kernel name -> category: XLA names a fusion's kernel after it, with '.' and '-' as '_'."""
    return {**{re.sub(r"[.\-]", "_", k): v for k, v in kinds.items()}, **kinds}


def hlo_op_kinds(hlo_text: str) -> dict[str, str]:
    """Category of each instruction of an optimized HLO module text (see module doc)."""
    reduce_comps, comp = set(), None
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if m and "=" not in line.split("{")[0]:
            comp = m.group(1)
        elif comp and re.search(r"=\s*\S+\s+reduce\(", line):
            reduce_comps.add(comp)
    kinds = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)
        if not m:
            continue
        name, rest = m.groups()
        if "__cublas$lt$matmul$f8" in rest:
            kinds[name] = "gemm-fp8"
        elif "custom-call(" in rest and re.search(r"cublas|gemm|matmul", rest):
            kinds[name] = "gemm"
        elif " fusion(" in rest and ("__triton_gemm" in rest or name.startswith("gemm_fusion")):
            kinds[name] = "gemm"  # a GEMM emitted by XLA's Triton backend
        elif " fusion(" in rest:
            called = re.search(r"calls=%?([\w.\-]+)", rest)
            if called and called.group(1) in reduce_comps:
                kinds[name] = "reduce"
            else:
                kinds[name] = "scalar" if _output_elements(rest) <= 64 else "elementwise"
        elif re.search(r"\s(copy|transpose|copy-start|copy-done)\(", rest):
            kinds[name] = "copy"
    return kinds


def _output_elements(rest: str) -> int:
    """Number of output elements of an HLO instruction (its text after ``=``)."""
    head = rest.split(" fusion(")[0]
    total = 0
    for dims in re.findall(r"\w+\[([\d,]*)\]", head):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n
    return total


def _device_pids(meta_events) -> set:
    gpu = {e["pid"] for e in meta_events if e.get("name") == "process_name"
           and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    return gpu


def summarize_trace(events: list[dict], n_steps: int, kinds: dict[str, str] | None = None) -> dict:
    """Per-step device time by category and by HLO op from Perfetto trace events."""
    kinds = _kernel_names(kinds or {})
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
    }


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
    with gzip.open(paths[-1]) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    return summarize_trace(events, n_steps, hlo_op_kinds(hlo_text))


def profile_train_steps(compiled, state, x, y, n_steps: int, hlo_text: str = ""):
    """`profile_kernels` of `n_steps` calls of a compiled train step `(state, x, y) ->
    (state, loss)` (the state is threaded through, as donated buffers require).
    Returns (profile, the final state)."""
    holder = [state]

    def run():
        holder[0], loss = compiled(holder[0], x, y)
        jax.block_until_ready((holder[0], loss))

    return profile_kernels(run, n_steps, hlo_text), holder[0]


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
    lines += ["", "| HLO op | kind | us/step | kernels/step |", "|---|---|---|---|"]
    for r in prof["top_ops"][:25]:
        lines.append(f"| `{r['op']}` | {r['kind'] or '-'} | {r['us']:,.1f} | {r['calls']:g} |")
    return "\n".join(lines) + "\n"
