"""Scale health: where in a step the data of a ScaledArray leaves the range its dtype holds.

Scale rules assume unit data (RMS near 1); the scale carries the magnitude. Where a rule's
static assumption is wrong (weights that are not unit-scaled, a cotangent that shrinks at
every layer) the data drifts away from 1 while the value stays right, until a square
underflows or an FP8 cast flushes. `scale_health(fn, *args)` runs `jax.jit(scalify(fn))` and,
for every equation with a scaled float output, records

  log2 scale, log2 RMS(data), log2 max|data|, the share of non-zero data that is subnormal,
  the number of non-finite data,

and flags it:

  - ``nonfinite``: the equation creates non-finite data: a nan from inputs that hold none,
    or an inf from inputs that hold none (an inf carried from an input, e.g. a `-inf`
    attention mask through `where` and `x - max`, is counted but not flagged);
  - ``overflow``: max|data| within 2^1 of the dtype's max (the next doubling overflows;
    not for FP8, whose casts saturate and fill the format by design);
  - ``underflow``: more than 1% of the non-zero data are subnormal (or flushed to zero
    while the RMS says they should not be): precision is being lost;
  - ``drift``: |log2 RMS(data)| > `drift_bits` (default: the dtype's mantissa bits, at least
    4, so rules that assume unit data are off by more than the dtype resolves; FP8:
    log2 of the format's max, E4M3 8).

For a drifted value, a `scalify.dynamic_rescale_l2` at its source line (forward values) or a
`scalify.dynamic_rescale_l2_grad` on the forward value whose gradient drifts (backward
values, recognised by JAX's ``transpose`` name stack) brings the data back to unit RMS.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from scalify.core import observe
from scalify.core.scaled_array import ScaledArray
from scalify.interpreter import _source_line, scalify

__all__ = ["EquationHealth", "ScaleHealth", "scale_health"]


@dataclasses.dataclass(frozen=True)
class EquationHealth:
    """The data statistics of one scaled output of one equation."""

    index: int  # order in which the equation ran
    primitive: str
    source: str  # the user's line
    backward: bool  # an equation of a transpose (the backward pass)
    dtype: str
    shape: tuple
    log2_scale: float  # of the largest scale, for per-channel scales
    log2_rms: float  # -inf for all-zero data
    log2_amax: float
    subnormal_share: float
    nonfinite: int
    flags: tuple[str, ...]

    def advice(self) -> str:
        """What to do about the flags, in one line."""
        if "nonfinite" in self.flags:
            return "non-finite data: find the first such row; the values before it went out of range"
        if "drift" in self.flags or "underflow" in self.flags:
            if self.backward:
                return ("wrap the forward value of this line in scalify.dynamic_rescale_l2_grad "
                        "(its gradient drifts)")
            return "wrap this value in scalify.dynamic_rescale_l2 (its data drift from unit RMS)"
        if "overflow" in self.flags:
            return "wrap this value in scalify.dynamic_rescale_max (data near the dtype's max)"
        return ""


@dataclasses.dataclass
class ScaleHealth:
    """The report of `scale_health`: one row per scaled float output, in execution order."""

    rows: list[EquationHealth]
    drift_bits: dict

    @property
    def flagged(self) -> list[EquationHealth]:
        return [r for r in self.rows if r.flags]

    def first(self, flag: str) -> EquationHealth | None:
        """The earliest row with `flag` (where a problem starts)."""
        return next((r for r in self.rows if flag in r.flags), None)

    def __str__(self) -> str:
        counts = {f: sum(f in r.flags for r in self.rows) for f in ("nonfinite", "overflow", "underflow", "drift")}
        head = (f"scale health: {len(self.rows)} scaled outputs, "
                + ", ".join(f"{n} {f}" for f, n in counts.items()))
        lines = [head]
        seen = set()
        for r in self.flagged:
            key = (r.source, r.primitive, r.flags)
            if key in seen:
                continue
            seen.add(key)
            lines.append(
                f"  #{r.index:<5} {r.primitive:<18} {r.dtype:<8} log2 rms {r.log2_rms:7.1f} "
                f"scale 2^{r.log2_scale:<6.0f} {','.join(r.flags):<18} {r.source}"
                + (" [backward]" if r.backward else "")
            )
            if len(seen) >= 40:
                lines.append(f"  ... {len(self.flagged) - 40} more flagged rows")
                break
        first = self.first("nonfinite") or self.first("drift") or self.first("underflow")
        if first is not None:
            lines.append(f"first problem: #{first.index} at {first.source}: {first.advice()}")
        return "\n".join(lines)

    def plot(self, path: str | None = None, ax=None):
        """log2 RMS of the data per equation against the data dtype's normal range (needs
        matplotlib); saved to `path` if given. Returns the matplotlib Axes."""
        try:
            import matplotlib

            if path is not None and ax is None:
                matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("ScaleHealth.plot needs matplotlib: pip install matplotlib") from err
        if ax is None:
            _, ax = plt.subplots(figsize=(10, 4))
        idx = np.array([r.index for r in self.rows])
        rms = np.array([r.log2_rms for r in self.rows])
        back = np.array([r.backward for r in self.rows])
        ax.scatter(idx[~back], rms[~back], s=6, label="forward")
        ax.scatter(idx[back], rms[back], s=6, label="backward")
        bad = np.array([bool(r.flags) for r in self.rows])
        ax.scatter(idx[bad], rms[bad], s=20, facecolors="none", edgecolors="red", label="flagged")
        for dtype in sorted({r.dtype for r in self.rows}):
            fi = ml_dtypes.finfo(np.dtype(dtype))
            ax.axhspan(np.log2(float(fi.tiny)), np.log2(float(fi.max)), alpha=0.08)
            ax.text(idx.max() if len(idx) else 0, np.log2(float(fi.max)), f" {dtype} max", fontsize=7)
        ax.set_xlabel("equation (execution order)")
        ax.set_ylabel("log2 RMS of the data")
        ax.axhline(0, color="k", lw=0.5)
        ax.legend(loc="lower left", fontsize=7)
        if path is not None:
            ax.figure.savefig(path, dpi=120, bbox_inches="tight")
        return ax


def _default_drift_bits(dtype) -> int:
    """The mantissa bits (at least 4); FP8 data are placed to fill the format (an amax-scaled
    cast puts the max at the format's max), so for them: log2 of the format's max."""
    fi = ml_dtypes.finfo(dtype)
    if np.dtype(dtype).itemsize == 1:
        return int(np.floor(np.log2(float(fi.max))))
    return max(int(fi.nmant), 4)


def _input_flags(ins):
    """Whether any float input of an equation holds a nan / an inf (in-graph booleans)."""
    in_nan = in_inf = jnp.zeros((), bool)
    for x in ins:
        x = x.data if isinstance(x, ScaledArray) else x
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            x = jnp.asarray(x)  # literals are Python/NumPy-typed floats
            in_nan = in_nan | jnp.any(jnp.isnan(x))
            in_inf = in_inf | jnp.any(jnp.isinf(x))
    return in_nan, in_inf


def _statistics(out: ScaledArray):
    """In-graph statistics of `out`'s data (float32): max|d|, mean((d/max)^2) (normalised
    first, so that the squares of drifted data do not underflow), non-zero count, subnormal
    count, nan count, inf count and the largest |scale|."""
    d = out.data.astype(jnp.float32)
    finite = jnp.isfinite(d)
    a = jnp.where(finite, jnp.abs(d), 0.0)
    m = jnp.max(a) if a.size else jnp.zeros((), jnp.float32)
    safe = jnp.where(m > 0, m, 1.0)
    ms = jnp.mean(jnp.square(a / safe)) if a.size else jnp.zeros((), jnp.float32)
    tiny = float(ml_dtypes.finfo(out.dtype).tiny)
    nonzero = a > 0
    return (m, ms, jnp.sum(nonzero), jnp.sum(nonzero & (a < tiny)), jnp.sum(jnp.isnan(d)),
            jnp.sum(jnp.isinf(d)), jnp.max(jnp.abs(jnp.asarray(out.scale, jnp.float32))))


def _row(index, meta, stats, drift_bits) -> EquationHealth:
    primitive, source, backward, dtype, shape = meta
    m, ms, nz, sub, nan, inf, scale, in_nan, in_inf = (np.asarray(v, np.float64) for v in stats)
    nonfin = nan + inf
    fi = ml_dtypes.finfo(np.dtype(dtype))
    with np.errstate(divide="ignore", invalid="ignore"):
        amax = float(np.log2(m))
        rms = float(np.log2(m) + 0.5 * np.log2(ms)) if m > 0 else float("-inf")
        log2_scale = float(np.log2(scale))
    share = float(sub / nz) if nz else 0.0
    bits = drift_bits.get(dtype, _default_drift_bits(np.dtype(dtype)))
    flags = []
    if (nan and not in_nan) or (inf and not in_inf):  # created here, not carried from an input
        flags.append("nonfinite")
    if m > 0 and amax > np.log2(float(fi.max)) - 1 and np.dtype(dtype).itemsize > 1:  # FP8 casts saturate by design
        flags.append("overflow")
    if share > 0.01 or (nz and rms < np.log2(float(fi.tiny)) + fi.nmant):
        flags.append("underflow")
    if np.isfinite(rms) and abs(rms) > bits:
        flags.append("drift")
    return EquationHealth(
        index=index, primitive=primitive, source=source, backward=backward, dtype=dtype,
        shape=shape, log2_scale=log2_scale, log2_rms=rms, log2_amax=amax,
        subnormal_share=share, nonfinite=int(nonfin), flags=tuple(flags),
    )


def scale_health(fn: Callable, *args, drift_bits: dict | None = None, **kwargs):
    """Run `jax.jit(scalify(fn))(*args, **kwargs)` and report the data statistics of every
    scaled float value it computes (see the module docstring).

    Args:
      fn: the (unscalified) step, as you would pass it to `scalify.scalify`.
      drift_bits: {dtype name: bits}: the |log2 RMS| above which data count as drifted
        (default per dtype: its mantissa bits, at least 4; float32 23, float16 10).
    Returns:
      (outputs of the call, ScaleHealth).

    The statistics are computed in the compiled step and sent out with
    `jax.debug.callback`, so values inside loops (one row per iteration), conditionals and
    custom derivatives are seen too. Call it outside `jax.jit`.
    """
    leaves = jax.tree_util.tree_leaves((args, kwargs), is_leaf=lambda t: isinstance(t, ScaledArray))
    if any(isinstance(getattr(x, "data", x), jax.core.Tracer) for x in leaves):
        raise TypeError(
            "scalify.inspect.scale_health needs concrete inputs: call it outside jax.jit / "
            "jax.grad (it compiles and runs the step itself to read the data of every equation)."
        )
    bits = {str(np.dtype(k)): int(v) for k, v in (drift_bits or {}).items()}
    rows: list[EquationHealth] = []
    count = [0]

    def receive(index, meta, *stats):
        rows.append(_row(index, meta, stats, bits))

    def record(eqn, outs, ins):
        flags = None
        for o in outs:
            if isinstance(o, ScaledArray) and jnp.issubdtype(o.dtype, jnp.floating):
                stack = str(getattr(eqn.source_info, "name_stack", ""))
                meta = (eqn.primitive.name, _source_line(eqn), "transpose" in stack,
                        str(np.dtype(o.dtype)), tuple(o.shape))
                flags = _input_flags(ins) if flags is None else flags  # once per equation
                jax.debug.callback(functools.partial(receive, count[0], meta), *_statistics(o), *flags)
                count[0] += 1

    with observe.observing(record):
        outputs = jax.jit(scalify(fn))(*args, **kwargs)
        jax.block_until_ready(outputs)
    jax.effects_barrier()
    rows.sort(key=lambda r: r.index)
    return outputs, ScaleHealth(rows, bits)
