"""Scale health: where in a step the data of a ScaledArray leave the range its dtype holds.

Scale rules assume unit data (RMS near 1); the scale carries the magnitude. Where a rule's
static assumption is wrong (weights that are not unit-scaled, a cotangent that shrinks at
every layer) the data drift away from 1 while the value stays right, until a square
underflows or an FP8 cast flushes; where a value itself is out of range (the exp of a large
logit), or a product of data is, the data overflow. `scale_health(fn, *args)` runs
`scalify(fn)` eagerly, equation by equation, and for every equation with a scaled float
output records

  log2 scale, log2 RMS(data), log2 max|data|, the share of non-zero data that is subnormal,
  the number of non-finite data, the rows that produced its scaled inputs,

the user's source line (the innermost frame of the equation's traceback outside JAX,
Flax, optax, Equinox, NumPy and scalify; for an equation inside a library's jitted
function, that of the user's call of it) and its phase: ``forward``, ``backward`` (an
equation of a transpose: JAX's name stack holds ``transpose(``) or ``optimizer``
(outside differentiation, after the backward pass). Each row is flagged:

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

The report leads with the first data out of range (`ScaleHealth.first_out_of_range`): the
first equation that creates non-finite data that reach the step's outputs (non-finite data
that a later equation drops, a `-inf` mask under a softmax, are listed as absorbed), else
the first overflow, with the chain of rows that led to it (its inputs' producers, a few
back, with their max|data|).

For a drifted value, a `scalify.dynamic_rescale_l2` at its source line (forward values) or a
`scalify.dynamic_rescale_l2_grad` on the forward value whose gradient drifts (backward
values) brings the data back to unit RMS.
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
from scalify.core.scaled_array import ScaledArray, is_scaled_leaf
from scalify.interpreter import source_line, format_frame, scalify, user_frame

__all__ = ["EquationHealth", "ScaleHealth", "scale_health"]

PHASES = ("forward", "backward", "optimizer")
# Primitives whose output value can leave every float range from a value in range.
_VALUE_GROWTH = {"exp", "exp2", "pow", "integer_pow", "sinh", "cosh", "expm1"}


@dataclasses.dataclass(frozen=True)
class EquationHealth:
    """The data statistics of one scaled output of one equation."""

    index: int  # order in which the equation ran
    primitive: str
    source: str  # the user's line
    phase: str  # "forward", "backward" or "optimizer"
    dtype: str
    shape: tuple
    log2_scale: float  # of the largest scale, for per-channel scales
    log2_rms: float  # -inf for all-zero data
    log2_amax: float  # of the finite data; -inf when none is non-zero
    subnormal_share: float
    nonfinite: int
    flags: tuple[str, ...]
    inputs: tuple[int, ...] = ()  # the rows that produced its scaled inputs (eager rows)

    @property
    def backward(self) -> bool:
        """An equation of a transpose (the backward pass)."""
        return self.phase == "backward"

    @property
    def out_of_range(self) -> bool:
        """Its data left the dtype's range: non-finite data created here, or max|data|
        within a factor 2 of the dtype's max."""
        return "nonfinite" in self.flags or "overflow" in self.flags

    def advice(self) -> str:
        """What to do about the flags, in one line."""
        if "nonfinite" in self.flags or "overflow" in self.flags:
            what = ("non-finite data created here" if "nonfinite" in self.flags
                    else "data within a factor 2 of the dtype's max")
            if self.primitive in _VALUE_GROWTH:
                return (f"{what}: the value itself leaves the range ({self.primitive} of a large "
                        "input); bound the input at this line (subtract the max before exp, clip)")
            where = ("the forward value of this line in scalify.dynamic_rescale_max_grad"
                     if self.backward else "an input of this line in scalify.dynamic_rescale_max")
            return (f"{what}: the data of its inputs (the rows that produced them: `chain`) "
                    f"combine past the dtype's max; wrap {where}, or compute this line in float32")
        if "drift" in self.flags or "underflow" in self.flags:
            if self.backward:
                return ("wrap the forward value of this line in scalify.dynamic_rescale_l2_grad "
                        "(its gradient drifts)")
            return "wrap this value in scalify.dynamic_rescale_l2 (its data drift from unit RMS)"
        return ""

    def describe(self) -> str:
        """One line: index, primitive, phase, data statistics, flags and source."""
        amax = "none" if not np.isfinite(self.log2_amax) else f"2^{self.log2_amax:.1f}"
        rms = "0" if not np.isfinite(self.log2_rms) else f"2^{self.log2_rms:.1f}"
        flags = f" {','.join(self.flags)}" if self.flags else ""
        bad = f" ({self.nonfinite} non-finite)" if self.nonfinite else ""
        return (f"#{self.index} {self.primitive} [{self.phase}] {self.dtype}{list(self.shape)} "
                f"max|data| {amax}{bad} rms {rms} scale 2^{self.log2_scale:.0f}{flags} at {self.source}")


@dataclasses.dataclass
class ScaleHealth:
    """The report of `scale_health`: one row per scaled float output, in execution order."""

    rows: list[EquationHealth]
    drift_bits: dict
    outputs_nonfinite: bool = False  # whether the step's outputs hold non-finite data
    output_rows: frozenset = frozenset()  # the rows whose values the step returned

    @property
    def flagged(self) -> list[EquationHealth]:
        return [r for r in self.rows if r.flags]

    def first(self, flag: str) -> EquationHealth | None:
        """The earliest row with `flag` (where a problem starts)."""
        return next((r for r in self.rows if flag in r.flags), None)

    def _by_index(self) -> dict:
        return {r.index: r for r in self.rows}

    def _reaching_outputs(self) -> set:
        """The rows whose non-finite data flow, through rows that all hold non-finite data,
        into a value the step returned (walked back from the returned values)."""
        by_index = self._by_index()
        todo = [by_index[i] for i in self.output_rows if i in by_index and by_index[i].nonfinite]
        seen = {r.index for r in todo}
        while todo:
            r = todo.pop()
            for i in r.inputs:
                p = by_index.get(i)
                if p is not None and p.nonfinite and i not in seen:
                    seen.add(i)
                    todo.append(p)
        return seen

    def absorbed(self) -> list[EquationHealth]:
        """Rows that create non-finite data which no returned value inherits (a `-inf`
        mask that a softmax turns into zeros): not the cause of non-finite outputs."""
        created = [r for r in self.rows if "nonfinite" in r.flags]
        if not self.outputs_nonfinite:
            return created
        if not self.output_rows:  # the outputs' producers are unknown: nothing is cleared
            return []
        reaching = self._reaching_outputs()
        return [r for r in created if r.index not in reaching]

    def first_out_of_range(self) -> EquationHealth | None:
        """The first equation whose data leave the dtype's range: the first that creates
        non-finite data reaching the step's outputs (if they hold non-finite data; the
        first that creates any when their path cannot be followed, e.g. from a loop body),
        else the first with max|data| near the dtype's max."""
        created = [r for r in self.rows if "nonfinite" in r.flags]
        if created and self.outputs_nonfinite:
            reaching = self._reaching_outputs()
            return next((r for r in created if r.index in reaching), created[0])
        return self.first("overflow")

    def chain(self, row: EquationHealth, depth: int = 4, width: int = 3) -> list[tuple[int, EquationHealth]]:
        """The rows that led to `row`: the producers of its scaled inputs, theirs, ... up
        to `depth` levels back (at most `width` per row, the largest max|data| first), as
        (level, row) pairs in print order."""
        by_index = self._by_index()
        out: list[tuple[int, EquationHealth]] = []
        seen = {row.index}

        def visit(r, level):
            if level > depth:
                return
            producers = [by_index[i] for i in r.inputs if i in by_index and i not in seen]
            producers.sort(key=lambda p: -p.log2_amax if np.isfinite(p.log2_amax) else np.inf)
            for p in producers[:width]:
                seen.add(p.index)
                out.append((level, p))
                visit(p, level + 1)

        visit(row, 1)
        return out

    def __str__(self) -> str:
        counts = {f: sum(f in r.flags for r in self.rows) for f in ("nonfinite", "overflow", "underflow", "drift")}
        phases = {p: sum(r.phase == p for r in self.rows) for p in PHASES}
        lines = [f"scale health: {len(self.rows)} scaled outputs ("
                 + ", ".join(f"{p} {n}" for p, n in phases.items() if n) + "): "
                 + ", ".join(f"{n} {f}" for f, n in counts.items())]
        out = self.first_out_of_range()
        if out is not None:
            lines.append(f"first data out of range: #{out.index} {out.primitive} [{out.phase}] at {out.source}")
            lines.append(f"  {out.describe()}")
            lines.append(f"  what to do: {out.advice()}")
            chain = self.chain(out)
            if chain:
                lines.append("  how the data got there (the rows that produced its inputs):")
                lines += [f"  {'  ' * level}<- {r.describe()}" for level, r in chain]
            elif not out.inputs:
                lines.append("  (its inputs are arguments or unscaled values of the step)")
        # Non-finite data made before the cause and dropped later (after it, every row may
        # hold some: those are consequences).
        absorbed = [r for r in self.absorbed() if out is None or r.index < out.index]
        if absorbed:
            lines.append(f"non-finite data created and dropped later (not a cause; e.g. a -inf mask): "
                         f"{len(absorbed)} rows, first #{absorbed[0].index} {absorbed[0].primitive} "
                         f"[{absorbed[0].phase}] at {absorbed[0].source}")
        seen, shown = set(), 0
        flagged = [r for r in self.flagged if r is not out and r not in absorbed]
        if flagged:
            lines.append("flagged rows (the first of each line and flags):")
        for r in flagged:
            key = (r.source, r.primitive, r.flags)
            if key in seen:
                continue
            seen.add(key)
            shown += 1
            lines.append(
                f"  #{r.index:<5} {r.primitive:<18} {r.dtype:<8} log2 rms {r.log2_rms:7.1f} "
                f"scale 2^{r.log2_scale:<6.0f} {','.join(r.flags):<18} [{r.phase}] {r.source}"
            )
            if shown >= 40:
                lines.append(f"  ... {len(flagged) - sum(1 for x in flagged if x.index <= r.index)} more flagged rows")
                break
        first = out or self.first("nonfinite") or self.first("drift") or self.first("underflow")
        if first is not None:
            lines.append(f"first problem: #{first.index} [{first.phase}] at {first.source}: {first.advice()}")
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
        phase = np.array([r.phase for r in self.rows])
        for p in PHASES:
            sel = phase == p
            if sel.any():
                ax.scatter(idx[sel], rms[sel], s=6, label=p)
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


def _float_leaf(x):
    """The float array of a value (a ScaledArray's data), or None."""
    x = x.data if isinstance(x, ScaledArray) else x
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return None


def _input_flags(ins):
    """Whether any float input of an equation holds a nan / an inf (in-graph booleans)."""
    in_nan = in_inf = jnp.zeros((), bool)
    for x in ins:
        x = _float_leaf(x)
        if x is not None:
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


def _host_statistics(out: ScaledArray):
    """`_statistics` of a concrete value, computed by NumPy on the host (float64: the same
    numbers; no compilation per shape)."""
    d = np.asarray(out.data).astype(np.float64)
    finite = np.isfinite(d)
    a = np.where(finite, np.abs(d), 0.0)
    m = a.max() if a.size else 0.0
    ms = np.mean(np.square(a / (m if m > 0 else 1.0))) if a.size else 0.0
    tiny = float(ml_dtypes.finfo(out.dtype).tiny)
    nonzero = a > 0
    scale = np.max(np.abs(np.asarray(out.scale, np.float64)))
    return (m, ms, nonzero.sum(), (nonzero & (a < tiny)).sum(), np.isnan(d).sum(), np.isinf(d).sum(), scale)


@jax.jit
def _device_statistics(out: ScaledArray):
    return _statistics(out)


def _concrete_statistics(out: ScaledArray):
    """The statistics of a concrete value: on the host for data in host memory (CPU),
    else reduced on the device (one small compiled reduction per shape) and fetched."""
    devices = getattr(out.data, "devices", None)
    if devices is None or all(d.platform == "cpu" for d in devices()):
        return _host_statistics(out)
    return jax.device_get(_device_statistics(out))


def _row(index, meta, stats, drift_bits, inputs=()) -> EquationHealth:
    primitive, source, phase, dtype, shape = meta
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
        index=index, primitive=primitive, source=source, phase=phase, dtype=dtype,
        shape=shape, log2_scale=log2_scale, log2_rms=rms, log2_amax=amax,
        subnormal_share=share, nonfinite=int(nonfin), flags=tuple(flags), inputs=tuple(inputs),
    )


def _is_traced(x) -> bool:
    return isinstance(getattr(x, "data", x), jax.core.Tracer) or isinstance(getattr(x, "scale", None), jax.core.Tracer)


class _Recorder:
    """The observer of `scale_health`: one row per scaled float output of each equation.

    Concrete outputs (the step runs eagerly) are measured on the spot and linked to the rows
    that produced their inputs (by the identity of the values, which the interpreter passes
    on unchanged: the recorder keeps them alive so that identities are not reused). Outputs
    that are traced (inside a loop body, a conditional or a custom derivative, which their
    rules trace) get in-graph statistics sent out with `jax.debug.callback`, one row per
    iteration."""

    def __init__(self, drift_bits):
        self.bits = drift_bits
        self.rows: list[EquationHealth] = []
        self.count = 0
        self.producer: dict[int, int] = {}  # id(value) -> row index
        self.nonfinite: dict[int, tuple[bool, bool]] = {}  # id(value) -> (has nan, has inf)
        self.keep: list = []  # the recorded values (their ids stay theirs)
        self.seen_backward = False

    # -- where and when ---------------------------------------------------------------
    def _phase(self, stack) -> str:
        names = "/".join(str(getattr(e.source_info, "name_stack", "")) for e in stack)
        if "transpose(" in names:
            self.seen_backward = True
            return "backward"
        if "jvp(" in names or not self.seen_backward:
            return "forward"
        return "optimizer"

    @staticmethod
    def _source(stack, eqn) -> str:
        for e in reversed(stack):  # the equation itself, then the calls that contain it
            fr = user_frame(e)
            if fr is not None:
                return format_frame(fr)
        return source_line(eqn)

    # -- input flags ------------------------------------------------------------------
    def _has_nonfinite(self, x) -> tuple[bool, bool]:
        known = self.nonfinite.get(id(x))
        if known is not None:
            return known
        d = _float_leaf(x)
        if d is None:
            return False, False
        d = np.asarray(d)
        if d.dtype.itemsize < 4:
            d = d.astype(np.float32)
        return bool(np.isnan(d).any()), bool(np.isinf(d).any())

    def __call__(self, eqn, outs, ins):
        scaled = [o for o in outs if isinstance(o, ScaledArray) and jnp.issubdtype(o.dtype, jnp.floating)]
        if not scaled:
            return
        stack = observe.enclosing() or (eqn,)
        phase, source = self._phase(stack), self._source(stack, eqn)
        if any(_is_traced(o) for o in scaled) or any(_is_traced(x) for x in ins):
            self._record_traced(eqn, scaled, ins, phase, source)
            return
        inputs = tuple(sorted({self.producer[id(x)] for x in ins if id(x) in self.producer}))
        in_nan = in_inf = False
        for x in ins:
            n, i = self._has_nonfinite(x)
            in_nan, in_inf = in_nan or n, in_inf or i
        for o in scaled:
            if id(o) in self.producer:  # passed through (a jit returns its body's values)
                continue
            meta = (eqn.primitive.name, source, phase, str(np.dtype(o.dtype)), tuple(o.shape))
            stats = _concrete_statistics(o)
            row = _row(self.count, meta, (*stats, in_nan, in_inf), self.bits, inputs)
            self.rows.append(row)
            self.producer[id(o)] = self.count
            self.nonfinite[id(o)] = (bool(stats[4]), bool(stats[5]))
            self.keep.append(o)
            self.count += 1

    def _record_traced(self, eqn, scaled, ins, phase, source):
        flags = _input_flags(ins)
        for o in scaled:
            meta = (eqn.primitive.name, source, phase, str(np.dtype(o.dtype)), tuple(o.shape))
            jax.debug.callback(functools.partial(self._receive, self.count, meta), *_statistics(o), *flags)
            self.count += 1

    def _receive(self, index, meta, *stats):
        self.rows.append(_row(index, meta, stats, self.bits))


def scale_health(fn: Callable, *args, drift_bits: dict | None = None, **kwargs):
    """Run `scalify(fn)(*args, **kwargs)` eagerly and report the data statistics of every
    scaled float value it computes (see the module docstring).

    Args:
      fn: the (unscalified) step, as you would pass it to `scalify.scalify`.
      drift_bits: {dtype name: bits}: the |log2 RMS| above which data count as drifted
        (default per dtype: its mantissa bits, at least 4; float32 23, float16 10).
    Returns:
      (outputs of the call, ScaleHealth). `print(report)` leads with the first data out of
      range, its source line, phase and the rows that led there.

    The step runs op by op (each primitive compiled once, as in eager JAX, instead of one
    program with a statistic per equation), so it takes seconds on a small model; values
    equal those of the compiled step up to XLA's fusion of elementwise operations. Values
    inside loop bodies, conditionals and custom derivatives, which their rules trace, are
    measured in the compiled loop and sent out with `jax.debug.callback` (one row per
    iteration). Every scaled value of the step is kept alive until the report is built.
    Call it outside `jax.jit`.
    """
    leaves = jax.tree_util.tree_leaves((args, kwargs), is_leaf=is_scaled_leaf)
    if any(_is_traced(x) for x in leaves):
        raise TypeError(
            "scalify.inspect.scale_health needs concrete inputs: call it outside jax.jit / "
            "jax.grad (it runs the step itself to read the data of every equation)."
        )
    bits = {str(np.dtype(k)): int(v) for k, v in (drift_bits or {}).items()}
    recorder = _Recorder(bits)
    with observe.observing(recorder):
        outputs = scalify(fn)(*args, **kwargs)
        jax.block_until_ready(outputs)
    jax.effects_barrier()
    rows = sorted(recorder.rows, key=lambda r: r.index)
    out_leaves = jax.tree_util.tree_leaves(outputs, is_leaf=is_scaled_leaf)
    output_rows = frozenset(recorder.producer[id(x)] for x in out_leaves if id(x) in recorder.producer)
    outputs_nonfinite = any(bool(np.any(n) or np.any(i)) for n, i in map(recorder._has_nonfinite, out_leaves))
    return outputs, ScaleHealth(rows, bits, outputs_nonfinite, output_rows)
