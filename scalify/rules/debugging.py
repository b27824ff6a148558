"""Debugging primitives: `jax.debug.print` and `jax.debug.callback` on ScaledArrays.

The rule materialises every ScaledArray operand (`data * scale`, computed and printed in
float32, or float64 for float64 data) and binds the primitive on the values, so what is
printed or passed to the callback is the value, exactly as in the program without scalify.
Plain operands are passed as they are. The primitives have no outputs.
"""
from __future__ import annotations

from scalify.core.scaled_array import ScaledArray
from scalify.core.lax_utils import bind_as_is
from scalify.core.registry import register_call_rule
from scalify.rules.common import materialize, named_rule

try:  # no public handle in jax.extend for these primitives
    from jax._src.debugging import debug_callback_p, debug_print_p

    _PRIMITIVES = [debug_callback_p, debug_print_p]
except ImportError:  # pragma: no cover - older/newer JAX: keep what exists
    try:
        from jax._src.debugging import debug_callback_p

        _PRIMITIVES = [debug_callback_p]
    except ImportError:
        _PRIMITIVES = []


def _value(x):
    if isinstance(x, ScaledArray):
        return materialize(x)
    return x


def _debug_rule(primitive):
    def rule(invals, scalars, **params):
        """Bind `primitive` on the values of the operands (scaled ones materialised)."""
        return bind_as_is(primitive, params, [_value(x) for x in invals])

    return named_rule(primitive, rule)


for _p in _PRIMITIVES:
    register_call_rule(_p)(_debug_rule(_p))
