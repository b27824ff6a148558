"""The XLA flag the NanoGPT example sets before JAX starts: no excess precision.

By default XLA may keep a value in more precision than the program asks for
(``--xla_allow_excess_precision``, on by default). It then folds the pair
``convert(convert(x_f32, f16), f32)`` into ``x_f32``. Scalify's rules compute in float32
and cast their output to the 16-bit data dtype, and the next rule widens that data again,
so XLA drops the 16-bit rounding and stores the float32 value where the program stores
16-bit data: float32 residual-stream gradients and LayerNorm inputs, twice the bytes.

With the flag off, the casts stay, and the step reads and writes the 16-bit tensors it
was written for: the scalified steps read and write fewer bytes, plain bf16 does not
change (its casts are the same either way).

The numerics are the program's own: every 16-bit cast rounds, as on any backend without
this liberty.

XLA reads ``XLA_FLAGS`` once, when JAX starts its backend (the first computation or
``jax.devices()``), so `configure` must run before that. ``python -m
experiments.nanogpt.train`` and ``bench`` call it first thing; ``--xla-excess-precision``
leaves XLA's default. A value already in ``XLA_FLAGS`` wins.
"""
from __future__ import annotations

import os
import sys

FLAG = "--xla_allow_excess_precision"


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge  # internal; public JAX has no such query

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # pragma: no cover - depends on JAX internals
        return False


def configure(excess_precision: bool = False) -> str:
    """Set ``--xla_allow_excess_precision`` in ``XLA_FLAGS`` (see the module docstring).

    Leaves ``XLA_FLAGS`` alone when it already sets the flag (the user's choice) or when
    JAX's backend has already started (XLA would ignore the change; a note goes to stderr).
    Returns ``XLA_FLAGS`` as it stands afterwards.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if FLAG in flags or excess_precision:
        return flags
    if _backend_started():
        print(f"[xla_flags] JAX's backend already started: {FLAG}=false not applied "
              "(set it in XLA_FLAGS before JAX starts).", file=sys.stderr)
        return flags
    flags = f"{flags} {FLAG}=false".strip()
    os.environ["XLA_FLAGS"] = flags
    return flags
