"""Metrics of NanoGPT runs: the per-step rows (``metrics.jsonl`` and ``metrics.csv``), the
logging of dispatched train steps with their timing, and the summary table of a folder of
runs (``summary.md``).

A row: ``step, split ("train" | "valid"), loss, lr, tokens, tokens_per_s, step_time_ms,
elapsed_s`` (``CSV_FIELDS``); validation rows have no timing.
"""
from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import jax

from experiments.nanogpt import configs as C

__all__ = ["CSV_FIELDS", "MetricsWriter", "read_metrics", "StepLog", "summary_table"]

CSV_FIELDS = ("step", "split", "loss", "lr", "tokens", "tokens_per_s", "step_time_ms", "elapsed_s")


class MetricsWriter:
    """Appends metric rows to ``metrics.jsonl`` and ``metrics.csv`` (flushed per write);
    with ``files=False`` keeps them in `rows` only (the processes but the first of a
    multi-process run)."""

    def __init__(self, run_dir: Path, resume_step: int | None = None, files: bool = True):
        self.jsonl = run_dir / "metrics.jsonl"
        self.csv = run_dir / "metrics.csv"
        self.files = files
        rows = read_metrics(run_dir) if resume_step is not None else []
        # On resume, drop rows logged after the checkpoint (they will be logged again).
        rows = [r for r in rows if resume_step is not None and r["step"] <= resume_step]
        self.rows = rows
        if not files:
            return
        with open(self.jsonl, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        with open(self.csv, "w", newline="") as f:
            w = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)

    def write(self, row: dict) -> None:
        self.rows.append(row)
        if not self.files:
            return
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        with open(self.csv, "a", newline="") as f:
            csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore").writerow(row)


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl`` ([] without the file)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class StepLog:
    """Logs train steps dispatched back to back.

    The loop calls `begin` before dispatching a step and `add` with its (unread) loss;
    `flush` waits for the last pending loss (the host's dispatch of one step overlaps the
    device's work on the previous) and writes one row per pending step, each with the
    mean step time of the interval: ``(t_flush - t_begin) / pending``. The first step,
    which compiles, is flushed alone by the loop.
    """

    def __init__(self, writer: MetricsWriter, lr_at: Callable[[int], float], tokens_per_step: int):
        self.writer, self.lr_at, self.tokens_per_step = writer, lr_at, tokens_per_step
        self.pending: list[tuple[int, Any]] = []  # (step, loss) dispatched since the last flush
        self.step_times: list[float] = []
        self.last_train: float | None = None
        self.diverged = False
        self.elapsed0, self.t_sync = time.time(), time.perf_counter()

    def begin(self) -> None:
        """Starts the timed interval at the first step after a flush (evaluations and
        checkpoints are outside the intervals)."""
        if not self.pending:
            self.t_sync = time.perf_counter()

    def add(self, step: int, loss) -> None:
        self.pending.append((step, loss))

    def flush(self) -> None:
        if not self.pending:
            return
        jax.block_until_ready(self.pending[-1][1])
        dt = (time.perf_counter() - self.t_sync) / len(self.pending)
        for s, loss_arr in self.pending:
            loss = float(loss_arr)
            self.last_train = loss
            self.diverged = self.diverged or not math.isfinite(loss)
            self.step_times.append(dt)
            self.writer.write(dict(step=s, split="train", loss=loss, lr=self.lr_at(s - 1),
                                   tokens=s * self.tokens_per_step,
                                   tokens_per_s=self.tokens_per_step / dt, step_time_ms=1e3 * dt,
                                   elapsed_s=time.time() - self.elapsed0))
        self.pending.clear()

    def valid(self, step: int, loss: float) -> None:
        """Writes a validation row."""
        self.writer.write(dict(step=step, split="valid", loss=loss, lr=self.lr_at(step - 1),
                               tokens=step * self.tokens_per_step,
                               elapsed_s=time.time() - self.elapsed0))

    def tokens_per_s(self) -> float:
        """Of the last logged step."""
        return self.tokens_per_step / self.step_times[-1]


def _fmt(x, spec=".4f") -> str:
    return "-" if x is None else format(x, spec)


def _table_row(r: dict, ref: float | None) -> str:
    v = r["final_valid_loss"]
    rel = "-" if (ref is None or v is None) else f"{100 * (v - ref) / ref:+.2f}%"
    return (f"| {r['config']} | {r['paper'] or '-'} | {r['steps']} | {r['tokens']:,} | "
            f"{_fmt(r['final_train_loss_mean'])} | {_fmt(v)} | {rel} | "
            f"{_fmt(r['tokens_per_s_median'], ',.0f')} | {_fmt(r['step_time_ms_median'], '.2f')} |")


def summary_table(out: str | Path) -> str:
    """A markdown table of every ``OUT/*/summary.json``: final losses and the relative
    difference of the validation loss to ``fp32``, ``(v - v_fp32) / v_fp32`` (written to
    ``OUT/summary.md``)."""
    out = Path(out)
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("*/summary.json"))]
    order = {n: i for i, n in enumerate(list(C.RECIPES))}
    rows.sort(key=lambda r: order.get(r["config"], len(order)))
    ref = next((r["final_valid_loss"] for r in rows if r["config"] == "fp32"), None)
    lines = ["| config | paper | steps | tokens | final train loss | final valid loss | vs fp32 | "
             "tokens/s | step (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [_table_row(r, ref) for r in rows]
    if rows:
        r0 = rows[0]
        lines.append(f"\nModel `{r0['model']}` ({r0['parameters']:,} parameters), batch {r0['batch_size']} x "
                     f"seq {r0['seq_len']}, {r0['device']} ({r0['backend']}), jax {r0['jax']}.  \n"
                     f"Data: {r0['data']}.  \nFinal train loss: mean of the last logged steps; "
                     f"valid loss: mean over the first evaluation batches of the validation split.")
    table = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(table)
    return table
