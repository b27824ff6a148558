"""Equation folds applied to a jaxpr before it is interpreted.

One fold, `add_any(x, scatter_add(zeros, idx, u)) -> scatter_add(x, idx, u)`: the transpose
of a gather (`jnp.take_along_axis`, integer-label cross-entropy) scatters its cotangent
into a fresh zeros array, which autodiff then adds to the other cotangents of the gathered
operand. XLA folds this pattern in a plain program; once the two addends carry scales the
addition rescales both and XLA no longer sees it, so the zeros array is written and read in
full (a [tokens, vocab] array at the loss). Folded before interpretation, the scatter-add
rule adds the updates into `x` on a common scale and nothing of that size is written twice.

Same value: `x + scatter_add(0, i, u)` and `scatter_add(x, i, u)` add the same updates to
the same elements (the order of additions differs only where indices repeat).
"""
from __future__ import annotations

import collections

import numpy as np
from jax import lax
from jax.extend import core as jex
from jax.extend.core import primitives as jprims

__all__ = ["fold_zero_scatter_adds"]


def _is_zero_literal(v) -> bool:
    return isinstance(v, jex.Literal) and np.ndim(v.val) == 0 and v.val == 0


def _is_zeros(eqn) -> bool:
    """`broadcast_in_dim` of a literal 0."""
    return eqn.primitive is lax.broadcast_in_dim_p and _is_zero_literal(eqn.invars[0])


def _is_adding(scatter) -> bool:
    return scatter.primitive is lax.scatter_add_p and not scatter.params.get("update_consts")


def _inner_zero_scatter(eqn):
    """For a `jit` whose body is exactly `zeros -> scatter_add(zeros, idx, u)` with `idx`
    and `u` its own inputs: (scatter params, outer idx var, outer u var); else None."""
    if eqn.primitive is not jprims.jit_p or len(eqn.outvars) != 1:
        return None
    inner = eqn.params["jaxpr"].jaxpr
    if len(inner.eqns) != 2 or inner.constvars:
        return None
    zeros, scatter = inner.eqns
    if not (_is_zeros(zeros) and _is_adding(scatter)):
        return None
    operand, idx, upd = scatter.invars
    if operand is not zeros.outvars[0] or inner.outvars != [scatter.outvars[0]]:
        return None
    outer_of = dict(zip(inner.invars, eqn.invars))
    if idx not in outer_of or upd not in outer_of:
        return None
    return scatter.params, outer_of[idx], outer_of[upd]


def _uses(jaxpr) -> collections.Counter:
    count = collections.Counter()
    for eqn in jaxpr.eqns:
        count.update(v for v in eqn.invars if isinstance(v, jex.Var))
    count.update(v for v in jaxpr.outvars if isinstance(v, jex.Var))
    return count


def fold_zero_scatter_adds(jaxpr) -> list:
    """The equations of `jaxpr` with each `add_any(x, s)` whose `s` is a scatter-add into
    zeros (directly, or as the only content of a `jit`) and used nowhere else replaced by
    one `scatter_add(x, idx, u)`; the producers of `s` are dropped."""
    eqns = list(jaxpr.eqns)
    zeros_at = {e.outvars[0]: k for k, e in enumerate(eqns) if _is_zeros(e)}
    producer = {}  # scatter output -> (indices of the equations making it, params, idx, u)
    for k, eqn in enumerate(eqns):
        operand = eqn.invars[0] if eqn.invars else None
        if _is_adding(eqn) and isinstance(operand, jex.Var) and operand in zeros_at:
            producer[eqn.outvars[0]] = ((k, zeros_at[operand]), eqn.params, *eqn.invars[1:])
        else:
            found = _inner_zero_scatter(eqn)
            if found is not None:
                producer[eqn.outvars[0]] = ((k,), *found)
    if not producer:
        return eqns
    uses = _uses(jaxpr)

    dropped, replaced = set(), {}
    for k, eqn in enumerate(eqns):
        if eqn.primitive is not jprims.add_jaxvals_p:
            continue
        for side in (0, 1):
            s, x = eqn.invars[side], eqn.invars[1 - side]
            if s not in producer or uses[s] != 1 or not isinstance(x, jex.Var):
                continue
            made_by, params, idx, upd = producer[s]
            if any(uses[eqns[j].outvars[0]] != 1 for j in made_by[1:]):  # the zeros used elsewhere
                continue
            dropped.update(made_by)
            replaced[k] = eqn.replace(primitive=lax.scatter_add_p, invars=[x, idx, upd], params=dict(params))
            break
    if not replaced:
        return eqns
    return [replaced.get(k, e) for k, e in enumerate(eqns) if k not in dropped]
