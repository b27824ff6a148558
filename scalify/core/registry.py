"""The rule tables: which function computes the scaled result of which primitive.

A "scale rule" `fn(*inputs, **params)` gets the equation's float inputs as ScaledArray
(unscaled ones promoted) and its integer/bool inputs as plain arrays. A "call rule"
`fn(invals, scalars, **params)` gets the raw inputs and their broadcast-scalar metadata
and interprets the sub-jaxpr(s) itself. Rule modules (`scalify/rules`, `scalify/ops`)
register into this table when imported; `import scalify` imports them all, so built-in
rules are in place before any user rule is registered. The interpreter only reads the
table (`lookup`), so it never imports a rule module.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

__all__ = ["RuleInfo", "register_scale_rule", "register_call_rule", "registered_rules", "lookup"]


@dataclasses.dataclass(frozen=True)
class RuleInfo:
    """A registered rule: `fn`, its kind ("scale" or "call") and its family module."""

    primitive: Any
    fn: Callable
    kind: str
    family: str
    always: bool  # run the rule even when no input is scaled (scaling ops)
    value_bounds: bool = False  # the rule takes `value_bounds=` (scalify.core.value_bounds)


_RULES: dict[Any, RuleInfo] = {}


def _same_rule(a: Callable, b: Callable) -> bool:
    """The same function, possibly from a re-import of its module."""
    return a is b or (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def _register(primitives, kind: str, always: bool, override: bool = False, value_bounds: bool = False):
    def decorator(fn):
        family = fn.__module__.rsplit(".", 1)[-1]
        for p in primitives:
            old = _RULES.get(p)
            if old is not None and not override and not _same_rule(old.fn, fn):
                raise ValueError(
                    f"primitive '{p.name}' already has a scale rule ({old.fn.__module__}."
                    f"{old.fn.__qualname__}). To replace it, register with "
                    f"`override=True`; to scale one function differently, use "
                    "`@scalify.custom_scale` instead."
                )
            _RULES[p] = RuleInfo(p, fn, kind, family, always, value_bounds)
        return fn

    return decorator


def register_scale_rule(*primitives, always: bool = False, override: bool = False,
                        value_bounds: bool = False):
    """Register `fn(*inputs, **params)` as the scale rule of `primitives`.

    Float inputs arrive as ScaledArray (promoted when unscaled), integer/bool inputs as plain
    arrays; `params` are the equation's params. Return a ScaledArray / array (a list of them
    for primitives with multiple results). With `always=True` the rule also runs when no
    input is scaled (used by scaling ops such as `set_scaling`). A primitive that already has
    a rule raises a ValueError unless `override=True` (the new rule then replaces it).
    With `value_bounds=True` the rule also gets `value_bounds=(B or None per input)`: the
    static bound |x| <= B of each input's values (`scalify.core.value_bounds`).
    """
    return _register(primitives, "scale", always, override, value_bounds)


def register_call_rule(*primitives, override: bool = False):
    """Register `fn(invals, scalars, **params)` for a call-like primitive.

    `invals` are raw values (ScaledArray or arrays, no promotion), `scalars` the matching
    broadcast-scalar metadata (a 0-d value or None). Return the list of outputs.
    """
    return _register(primitives, "call", False, override)


def registered_rules() -> dict[Any, RuleInfo]:
    """A copy of the registry: primitive -> RuleInfo."""
    return dict(_RULES)


def lookup(primitive) -> Optional[RuleInfo]:
    """The rule of `primitive`, or None when it has none."""
    return _RULES.get(primitive)
