"""Differentiating a scalified function from outside: `jax.grad(g)` where `g` calls
`scalify(f)` on ScaledArray arguments.

A ScaledArray is a pytree (data, scale), so without help JAX would return the pytree
gradient (d/d data, d/d scale), which reads as a meaningless value. Instead a scalified call
with ScaledArray inputs is a `jax.custom_vjp` whose derivative is the derivative of the
VALUES `x = data * scale`:

- A scale is a power of two, a piecewise-constant quantity: valid ScaledArrays near
  (data, scale) all have the same scale, so only the data carries a derivative. The
  cotangent of an output ScaledArray is therefore read from its data slot alone:
  `dL/dy = ct_data / scale_y`.
- The backward pass is `jax.vjp` of `f` traced and interpreted with scalify (scaled, like
  `scalify(jax.grad(f))`), giving `g = dL/dx` for each input.
- The cotangent of a ScaledArray input `x = (d, s)` is `ScaledArray(g * s, 1 / s)`: its data
  slot is exactly the pytree derivative dL/dd (so chain rules through the data, e.g.
  `ScaledArray(w, s)` with a differentiated `w`, are right) and, the scale slot carrying no
  derivative, it holds `1 / s` so that the cotangent's VALUE is `g * s / s = dL/dx`.
  `jax.grad(lambda x: scalify(f)(x).to_array().sum())(x).to_array()` is the gradient.

Forward mode (`jax.jvp`, `jax.jacfwd`) of such a call is not available (JAX does not
combine forward mode with custom_vjp); take it inside: `scalify(lambda x: jax.jvp(f, ...))`.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from scalify.core.scale_flow import unchecked_scaled as _scaled
from scalify.core.scaled_array import ScaledArray, compute_dtype, is_float

__all__ = ["call_with_value_vjp", "under_reverse_ad"]


def under_reverse_ad() -> bool:
    """Whether the current call is being differentiated in reverse mode (jax.grad, jax.vjp,
    jax.linearize): a LinearizeTrace among the active traces. Calls inside an outer
    `jax.jit` are seen (the jit's tracing happens under the AD trace only when jit is inside
    grad: use `jax.jit(jax.grad(...))`, not `jax.grad(jax.jit(...))`)."""
    try:
        from jax._src import core as _core
        from jax._src.interpreters import ad as _ad

        t = _core.trace_ctx.trace
    except (ImportError, AttributeError):  # pragma: no cover - JAX internals moved
        return False
    while t is not None:
        if isinstance(t, _ad.LinearizeTrace):
            return True
        t = getattr(t, "parent_trace", None)
    return False


def _value(x):
    """Materialise a ScaledArray in float32 (or float64) for scale arithmetic."""
    if isinstance(x, ScaledArray):
        cdt = compute_dtype(x.dtype, jnp.result_type(x.scale))
        return x.data.astype(cdt) * jnp.asarray(x.scale).astype(cdt)
    return x


def _input_cotangent(x, g):
    """Cotangent of input `x` given its value gradient `g` (ScaledArray, array or None)."""
    if not is_float(x):
        return None
    if isinstance(x, ScaledArray):
        s = jnp.asarray(x.scale)
        if isinstance(g, ScaledArray):
            cdt = compute_dtype(g.dtype, s.dtype)
            gs = jnp.asarray(g.scale).astype(cdt) * s.astype(cdt)  # exact: powers of two
            data = g.data.astype(cdt) * gs
        else:
            cdt = compute_dtype(jnp.result_type(g), s.dtype)
            data = jnp.asarray(g).astype(cdt) * s.astype(cdt)
        return _scaled(jnp.broadcast_to(data, x.shape).astype(x.dtype), (1 / s).astype(s.dtype))
    g = _value(g)
    return jnp.broadcast_to(g, np.shape(x)).astype(jnp.result_type(x))


def call_with_value_vjp(run: Callable, scalify_fn: Callable, jaxpr, consts: Sequence[Any], in_vals: list) -> list:
    """`run(jaxpr, consts, in_vals)` (the interpreter) as a custom_vjp with value semantics.

    `scalify_fn(fn)` returns the scalified `fn` without this wrapping (used for the backward
    pass). Consts that are tracers (closed-over values of an outer trace) are inputs of the
    custom_vjp, so gradients w.r.t. them are kept.
    """
    consts = list(consts)
    traced = [i for i, c in enumerate(consts) if isinstance(c, jax.core.Tracer)]

    def all_consts(tc):
        out = list(consts)
        for i, c in zip(traced, tc):
            out[i] = c
        return out

    @jax.custom_vjp
    def call(tc, ins):
        return run(jaxpr, all_consts(tc), ins)

    def fwd(tc, ins):
        outs = run(jaxpr, all_consts(tc), ins)
        out_scales = [o.scale if isinstance(o, ScaledArray) else None for o in outs]
        return outs, (tc, ins, out_scales)

    def bwd(res, cts):
        tc, ins, out_scales = res
        cts = list(cts)
        # The value cotangent of a scaled output: ct_data / scale (the scale slot carries
        # no derivative), kept scaled as ScaledArray(ct_data, 1 / scale).
        ct_vals = [
            _scaled(c.data, (1 / jnp.asarray(s)).astype(jnp.result_type(s))) if s is not None else c
            for c, s in zip(cts, out_scales)
        ]
        float_out = [
            jnp.issubdtype(v.aval.dtype, jnp.floating) if hasattr(v.aval, "dtype") else False
            for v in jaxpr.outvars
        ]
        args = list(tc) + list(ins)
        diff = [i for i, a in enumerate(args) if is_float(a)]

        def pullback(args, float_cts):
            def f(*dargs):
                full = list(args)
                for i, a in zip(diff, dargs):
                    full[i] = a
                c = all_consts(full[: len(tc)])
                return jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, c))(*full[len(tc):])

            outs, pull = jax.vjp(f, *[args[i] for i in diff])
            it = iter(float_cts)
            full_cts = [
                next(it) if fl else np.zeros(np.shape(o), jax.dtypes.float0)
                for o, fl in zip(outs, float_out)
            ]
            return list(pull(full_cts))

        grads = scalify_fn(pullback)(args, [c for c, fl in zip(ct_vals, float_out) if fl])
        all_g: list = [None] * len(args)
        for i, g in zip(diff, grads):
            all_g[i] = g
        out = [_input_cotangent(a, g) for a, g in zip(args, all_g)]
        return out[: len(tc)], out[len(tc):]

    call.defvjp(fwd, bwd)
    return call([consts[i] for i in traced], list(in_vals))
