"""PNG plots of NanoGPT runs (matplotlib, Agg backend): loss curves and scale histograms.

    python -m experiments.nanogpt.plots OUT     # OUT/loss.png, OUT/*/scales.png, OUT/summary.md

- `plot_losses(out_dir, png)`: train loss (thin) and validation loss (markers) against
  tokens for every ``OUT/*/metrics.jsonl``.
- `plot_scales(scales_json, png)`: histograms of log2 of the per-tensor scales of weights,
  activations, gradients and optimizer state, at the first and the last snapshot
  (``scales.json`` written by ``train.py``). Scales are powers of two, so the bins are the
  integer exponents.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments.nanogpt.metrics import summary_table  # noqa: E402

__all__ = ["plot_losses", "plot_scales", "main"]

# Plot order and colours: the paper's configurations, then the baselines.
_ORDER = ("fp32", "fp16", "fp16-master", "fp8", "fp8-fp16-state", "bf16", "flax-fp8", "fp32-plain")


def _runs(out_dir: Path) -> list[tuple[str, list[dict]]]:
    runs = []
    for path in sorted(Path(out_dir).glob("*/metrics.jsonl")):
        rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
        if rows:
            runs.append((path.parent.name, rows))
    rank = {n: i for i, n in enumerate(_ORDER)}
    return sorted(runs, key=lambda r: (rank.get(r[0], len(rank)), r[0]))


def _smooth(y: np.ndarray, k: int) -> np.ndarray:
    if k <= 1 or len(y) < k:
        return y
    c = np.cumsum(np.insert(y, 0, 0.0))
    head = c[1:k] / np.arange(1, k)
    return np.concatenate([head, (c[k:] - c[:-k]) / k])


def plot_losses(out_dir: str | Path, png: str | Path, title: str | None = None, smooth: int = 10) -> Path | None:
    """Train/validation loss against tokens for every run under `out_dir`; None if no run."""
    runs = _runs(Path(out_dir))
    if not runs:
        return None
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    cmap = plt.get_cmap("tab10")
    for i, (name, rows) in enumerate(runs):
        color = cmap(i % 10)
        tr = [(r["tokens"], r["loss"]) for r in rows if r["split"] == "train" and r["loss"] is not None]
        va = [(r["tokens"], r["loss"]) for r in rows if r["split"] == "valid" and r["loss"] is not None]
        if tr:
            t, l = map(np.asarray, zip(*tr))
            ax_t.plot(t, _smooth(l, smooth), color=color, lw=1.2, label=name)
        if va:
            t, l = map(np.asarray, zip(*va))
            ax_v.plot(t, l, "o-", color=color, ms=3, lw=1.2, label=name)
    for ax, what in ((ax_t, f"train loss (moving mean of {smooth})"), (ax_v, "validation loss")):
        ax.set_xlabel("tokens")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or f"NanoGPT: {Path(out_dir).name}")
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


_KINDS = ("weights", "activations", "gradients", "optimizer_state")


def plot_scales(scales_json: str | Path, png: str | Path, title: str | None = None) -> Path | None:
    """Histograms of log2(scale) per kind of tensor, first vs last snapshot; None if empty."""
    snaps = json.loads(Path(scales_json).read_text())
    if not snaps:
        return None
    steps = sorted(snaps, key=int)
    first, last = steps[0], steps[-1]
    kinds = [k for k in _KINDS if any(snaps[s].get(k) for s in steps)]
    if not kinds:
        return None
    fig, axes = plt.subplots(1, len(kinds), figsize=(4 * len(kinds), 3.6), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        values = {s: np.asarray(list(snaps[s].get(kind, {}).values()), float) for s in (first, last)}
        finite = np.concatenate([v[np.isfinite(v)] for v in values.values()] + [np.zeros(0)])
        if finite.size == 0:
            ax.set_title(f"{kind} (none)")
            continue
        bins = np.arange(np.floor(finite.min()) - 0.5, np.ceil(finite.max()) + 1.5)
        for s, color in ((first, "tab:blue"), (last, "tab:orange")):
            v = values[s][np.isfinite(values[s])]
            if v.size and (s == first or last != first):
                ax.hist(v, bins=bins, alpha=0.55, color=color, label=f"step {s} ({v.size})")
        ax.set_title(kind.replace("_", " "))
        ax.set_xlabel("log2(scale)")
        ax.set_ylabel("tensors")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title or "per-tensor scales")
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> None:
    """Regenerates OUT/loss.png, OUT/*/scales.png and OUT/summary.md from the run files."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m experiments.nanogpt.plots OUT")
    out = Path(argv[0])
    made = [plot_losses(out, out / "loss.png")]
    for sj in sorted(out.glob("*/scales.json")):
        made.append(plot_scales(sj, sj.with_suffix(".png"), title=sj.parent.name))
    print(summary_table(out))
    for m in made:
        if m is not None:
            print(m)


if __name__ == "__main__":
    main()
