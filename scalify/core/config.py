"""Global scalify configuration, set with a context manager.

    with scalify.ScalifyConfig(rounding_mode="nearest"):
        out = scalify.scalify(step)(params, batch)

The configuration is read when a function is traced, so it is part of the trace cache key
of `scalify`. An enclosing `jax.jit` (or `jax.make_jaxpr`) keeps its own cache keyed on the
function and its arguments only: after changing the configuration, jit a new function (or
call `jax.clear_caches()`) to see the change.
"""
from __future__ import annotations

import dataclasses
import enum
import threading

import jax.numpy as jnp
import numpy as np


class Pow2RoundMode(enum.Enum):
    """How a positive value is rounded to a power of two.

    DOWN: 2^floor(log2 x) -- the default (the paper's choice: data closest to unit scale).
    NEAREST: 2^round(log2 x) (in log space: x in [2^k * sqrt(1/2), 2^k * sqrt(2)) -> 2^k).
    UP: 2^ceil(log2 x).
    """

    DOWN = "down"
    NEAREST = "nearest"
    UP = "up"


FP8_OPERAND_LAYOUTS = ("barrier", "transpose", "none")
NARROW_DOT_ACCUMULATORS = ("float32", "bfloat16")
NARROW_DOT_PLACEMENTS = ("auto", "bound", "measure")


@dataclasses.dataclass(frozen=True)
class ScalifyConfig:
    """Options of the scalify transform.

    Each option says what it does and when to change it. The guards (the ``*_drift_window``
    and ``narrow_dot_*`` options) only move data and scale by the same power of two, so
    values never change (barring underflow); each costs one reduction where it runs.

    Attributes:
      rounding_mode: how rule output scales are rounded to powers of two ("down":
        2^floor(log2 x), the default; "nearest"; "up"). Change it only to study scale
        placement.
      scale_dtype: dtype of the scales scalify creates (float32). Keep float32: scales are
        powers of two, exact in any float dtype whose exponent range holds them.
      scale_barrier: every how many levels of scale computation (rules that compute a new
        scale; pass-through rules do not count) the scale is divided by a run-time 1, an op
        XLA does not duplicate into consumer fusions. Without it, scale chains through deep
        networks are re-fused into every consumer and compile time grows quadratically
        with depth; with 1, every barrier is a small kernel of its own on the GPU. The same
        division cuts the drift guards' factors, the power of two of a traced constant and
        the scale of a measured placement where they are made (`scale_flow.cut_scale`). 0 (or False) turns it off, True
        means 1. Default 4. Lower it if compile time grows quickly with depth.
      data_barrier: divide the float32 sum of an additive rule (add, sub, add_any) of
        float16 or FP8 data by the same run-time 1 before it is narrowed
        (`scale_flow.cut_data`). Without it XLA may re-compute a chain of such sums (the
        residual stream and its gradient) inside every fusion that reads it, and the
        compiled program grows with depth. Default True; turn it off only to compare
        compiled programs.
      carry_drift_window: guard of loop carries: at the end of every iteration of a
        `scan`/`while`, a scaled float carry (or scan output) whose data max-abs lies
        outside [2^-W, 2^W] moves to unit max-abs. Static scales assume unit data; where
        data and scale disagree, non-linear rules multiply the mismatch and the iterations
        compound it until scales leave float32's range. Default 8; None turns it off
        (loops whose carries stay unit-scaled).
      power_drift_window: the same guard on the input of `square` / `integer_pow` /
        `x * x`, whose rules multiply a data/scale mismatch (data 2^-100 squared underflows
        float32; Adam's second moment of a drifted gradient becomes 0). "auto" (default):
        `guards.power_window`, where the power of the data's max-abs m would lose the
        mantissa to subnormals or overflow (float32 squares: m outside [2^-51, 2^52];
        float16: [2^-2, 2^2]); an int W uses [2^-W, 2^W]; None turns it off.
      dot_drift_window: the same guard on the float32 outputs of float32 x float32
        `dot_general` and `conv_general_dilated`. Their static output scale
        sa * sb * sqrt(K) assumes unit-variance operands; where they are not (weights
        entered at scale 1, a deep ReLU stack) the data shrink or grow by a constant factor
        per layer until float32 flushes small elements. An output whose data max-abs lies
        outside [2^-W, 2^W] moves to unit max-abs. Default None (off): parameters entered at
        their RMS (`as_scaled_array`'s default) keep unit-variance data. Turn it on (32 is a
        good W) for float32 parameters entered at a fixed scale in a deep network.
      input_drift_window: the guard on the scaled float arguments of `scalify(fn)`: "auto"
        (default) moves a float32/bfloat16 argument whose max |data| lies outside
        [2^-2, 2^2] to unit max |data| (float16 and FP8 arguments are left as their
        producer placed them), so that a drift in one training step does not carry into
        the next. An int W uses [2^-W, 2^W] for every float dtype; None turns it off.
      cast_drift_window: the guard on a conversion of scaled data to float16 from a dtype
        with a wider exponent range (float32, bfloat16): data whose max |d| is below 2^-W,
        or at least 2^16 (beyond float16's max), go to unit max |d| first, so that values
        far below their scale do not become float16 subnormals or zeros (e.g. Adam's
        `1e-3 * g^2` stored in float16 moments). The same guard runs on FP8 casts
        (`scalify.ops.cast`) of float32/bfloat16 data with the format's top binade: data
        below 2^-W or at least 2^(floor(log2 max) + 1) (E4M3: 512, E5M2: 2^16) go to unit
        max-abs (`scalify.ops.casts.fp8_cast_window`); float16 and FP8 sources, and data
        widened from them, are not measured. "auto" (default): W = 4; None turns it off.
      narrow_dot_rescale: float16 outputs of `dot_general` (from any operands) accumulate
        in float32 and leave with data placed by `narrow_dot_placement`
        (`scalify.rules.linalg`): the static scale sa * sb * sqrt(K) assumes uncorrelated
        operands, trained weights correlate with the gradients that flow through them, and
        float16 overflows at 2^16. FP8 x FP8 -> float16 dots are always placed (their raw
        product overflows float16). Default True; False keeps the static scale.
      narrow_dot_placement: how those float16 outputs are placed. "measure": the power of
        two from the max |output| (one reduction over the output): unit max-abs data.
        "bound": from the operands, before the dot: the L2 norms of the lhs rows and rhs
        columns over the contracting dims bound every output (Cauchy-Schwarz), so the
        output leaves with data below 2^8 whatever the operands' correlation (one
        reduction over each operand). "auto" (default): "bound" where the output has more
        elements than the two operands together (a forward matmul into a wider layer),
        else "measure" (whichever reduction reads fewer elements).
      narrow_dot_accumulator: the dtype an FP8 x FP8 dot with a float16 output writes
        before that placement: "bfloat16" (default: cuBLASLt's FP8 GEMM writes it
        directly, half the bytes of float32; one extra rounding of 2^-9 relative, far below
        the FP8 operands' own 2^-4 or 2^-3) or "float32". Non-FP8 operands always
        accumulate in float32.
      fp8_operand_layout: how FP8 dot operands whose contracting dims are not minor are
        laid out for cuBLASLt FP8's "TN" layout (`scalify.rules.linalg.fp8_operands_tn`):
        "barrier" (default) transposes them explicitly behind an optimization_barrier, so
        XLA emits its tiled transpose and cannot fold it back into the dot (where the GEMM
        rewriter would re-insert a slow loop transpose); "transpose" without the barrier;
        "none" leaves the layout to XLA. Values are identical; change it only to compare
        (`benchmarks/fp8_layout.py`).
      rule_scopes: name the operations each scale rule emits after the rule's primitive
        (a `jax.named_scope` "scalify.<primitive>" inside the user's name stack), so that
        the compiled program's op names, and the kernels of a GPU profile, say which rule
        made each instruction. Off by default; it changes metadata only, never the
        program: turn it on to profile by rule.

    Used as a context manager, it becomes the active configuration inside the block.
    """

    rounding_mode: Pow2RoundMode | str = Pow2RoundMode.DOWN
    scale_dtype: object = jnp.float32
    scale_barrier: int = 4

    data_barrier: bool = True
    carry_drift_window: int | None = 8
    power_drift_window: int | str | None = "auto"
    dot_drift_window: int | None = None
    input_drift_window: int | str | None = "auto"
    cast_drift_window: int | str | None = "auto"
    narrow_dot_rescale: bool = True
    narrow_dot_placement: str = "auto"
    narrow_dot_accumulator: str = "bfloat16"
    fp8_operand_layout: str = "barrier"
    rule_scopes: bool = False

    def __post_init__(self):
        object.__setattr__(self, "rounding_mode", Pow2RoundMode(self.rounding_mode))
        dtype = np.dtype(self.scale_dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"ScalifyConfig.scale_dtype must be a float dtype, got {dtype}.")
        object.__setattr__(self, "scale_dtype", dtype)
        b = self.scale_barrier
        if not isinstance(b, (int, np.integer)) or b < 0:
            raise ValueError(f"ScalifyConfig.scale_barrier must be an int >= 0 (0: off), got {b!r}.")
        object.__setattr__(self, "scale_barrier", int(b))
        if not isinstance(self.data_barrier, (bool, np.bool_)):
            raise ValueError(f"ScalifyConfig.data_barrier must be a bool, got {self.data_barrier!r}.")
        object.__setattr__(self, "data_barrier", bool(self.data_barrier))
        for name in ("carry_drift_window", "dot_drift_window"):
            w = getattr(self, name)
            if w is not None and (not isinstance(w, int) or w < 0):
                raise ValueError(f"ScalifyConfig.{name} must be None or an int >= 0, got {w!r}.")
        for name in ("power_drift_window", "input_drift_window", "cast_drift_window"):
            w = getattr(self, name)
            if w is not None and w != "auto" and (not isinstance(w, int) or w < 0):
                raise ValueError(f"ScalifyConfig.{name} must be None, 'auto' or an int >= 0, got {w!r}.")

        if self.narrow_dot_placement not in NARROW_DOT_PLACEMENTS:
            raise ValueError(
                f"ScalifyConfig.narrow_dot_placement must be one of {NARROW_DOT_PLACEMENTS}, "
                f"got {self.narrow_dot_placement!r}."
            )
        if self.narrow_dot_accumulator not in NARROW_DOT_ACCUMULATORS:
            raise ValueError(
                f"ScalifyConfig.narrow_dot_accumulator must be one of {NARROW_DOT_ACCUMULATORS}, "
                f"got {self.narrow_dot_accumulator!r}."
            )
        if self.fp8_operand_layout not in FP8_OPERAND_LAYOUTS:
            raise ValueError(
                f"ScalifyConfig.fp8_operand_layout must be one of {FP8_OPERAND_LAYOUTS}, got "
                f"{self.fp8_operand_layout!r}."
            )

    def __enter__(self) -> "ScalifyConfig":
        _stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _stack().pop()


_DEFAULT = ScalifyConfig()
_LOCAL = threading.local()


def _stack() -> list[ScalifyConfig]:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


def get_config() -> ScalifyConfig:
    """The active ScalifyConfig (innermost `with ScalifyConfig(...)` block, else default)."""
    stack = _stack()
    return stack[-1] if stack else _DEFAULT
