"""Static bounds on the values of a jaxpr: |x| <= B for every element of a variable x,
known before anything runs, from the functions whose range is bounded.

    tanh, logistic, erf, sin, cos          B = 1
    erfc                                   B = 2
    a + b, a - b                           B = Ba + Bb
    a * b                                  B = Ba * Bb
    x ** n (n >= 0)                        B = Bx ** n
    neg, abs, casts, reshapes, broadcasts, slices, transposes, concatenations, selects,
    max and min reductions                 the largest bound of the operands
    a `custom_scale` function              the bounds it declares (`defbounds`), e.g. the
                                           normalised output of a LayerNorm, sqrt(D)

A Python or literal scalar c is bounded by |c|. Every bound is rounded up to a power of
two, so it is representable in every float format: rounding is monotone, so a value whose
exact result is at most B stays at most B after rounding to any format.

The product rule uses it: `x * gate` with a bounded gate (GELU's `0.5 * (1 + tanh(...))`,
SiLU's `logistic(x)`) is placed at `x`'s scale times the gate's bound, with no
measurement (`scalify.rules.elementwise`). The analysis sees one jaxpr: a sub-jaxpr
(jit, scan) is analysed on its own when it is interpreted.
"""
from __future__ import annotations

import math

import numpy as np
from jax import lax

try:
    from jax.extend import core as jex
except ImportError:  # pragma: no cover
    import jax.core as jex

__all__ = ["value_bounds", "bound_of", "pow2_ceil"]

_UNIT = {lax.tanh_p, lax.logistic_p, lax.erf_p, lax.sin_p, lax.cos_p}
_TWO = {lax.erfc_p}
_SUM = {lax.add_p, lax.sub_p}
_SAME = {lax.neg_p, lax.abs_p, lax.convert_element_type_p, lax.reshape_p, lax.broadcast_in_dim_p,
         lax.transpose_p, lax.squeeze_p, lax.expand_dims_p if hasattr(lax, "expand_dims_p") else None,
         lax.slice_p, lax.dynamic_slice_p, lax.rev_p, lax.copy_p, lax.reduce_precision_p,
         lax.reduce_max_p, lax.reduce_min_p, lax.concatenate_p, lax.max_p, lax.min_p} - {None}


def pow2_ceil(b: float) -> float:
    """The smallest power of two >= b (b > 0)."""
    return 2.0 ** math.ceil(math.log2(b)) if b > 0 else 0.0


def _literal_bound(v):
    """|c| of a scalar numeric literal; None for anything else."""
    val = np.asarray(v.val)
    if val.ndim != 0 or not np.issubdtype(val.dtype, np.number):
        return None
    return float(abs(val))


def bound_of(bounds: dict, v):
    """The bound of jaxpr atom `v`: |c| for a scalar literal, else `bounds`' entry or None."""
    return _literal_bound(v) if isinstance(v, jex.Literal) else bounds.get(v)


def value_bounds(jaxpr) -> dict:
    """{var: B} for the float variables of `jaxpr` whose values are bounded (module doc)."""
    bounds: dict = {}
    for eqn in jaxpr.eqns:
        p, ins = eqn.primitive, [bound_of(bounds, v) for v in eqn.invars]
        out = None
        if p in _UNIT:
            out = 1.0
        elif p in _TWO:
            out = 2.0
        elif p in _SUM and None not in ins:
            out = ins[0] + ins[1]
        elif p is lax.mul_p and None not in ins:
            out = ins[0] * ins[1]
        elif p is lax.integer_pow_p and ins[0] is not None and eqn.params["y"] >= 0:
            out = ins[0] ** eqn.params["y"]
        elif p is lax.select_n_p and None not in ins[1:]:
            out = max(ins[1:])
        elif p in _SAME and ins and None not in ins:
            out = max(ins)
        outs = _declared_bounds(eqn) or ([out] if len(eqn.outvars) == 1 else [])
        for v, b in zip(eqn.outvars, outs):
            if b is not None and math.isfinite(b) and b >= 0:
                bounds[v] = pow2_ceil(b) if b > 0 else 0.0
    return bounds


def _declared_bounds(eqn):
    """The output bounds a call declares (a `custom_scale` function's `defbounds`, through
    its `callee` parameter's `out_bounds`), else None."""
    callee = eqn.params.get("callee")
    out_bounds = getattr(callee, "out_bounds", None)
    if out_bounds is None:
        return None
    num_consts = eqn.params.get("num_consts", 0)
    return out_bounds([v.aval for v in eqn.invars[num_consts:]])
