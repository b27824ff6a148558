"""``eager_jit``: compile a whole function when called eagerly, trace it inline otherwise.

Op-by-op eager dispatch compiles every small op separately; wrapping the quantisers in
``jax.jit`` compiles each once per shape. Under an outer transformation (inputs are
tracers) the plain function is called, so no nested ``pjit`` appears in user jaxprs.
"""

from __future__ import annotations

import functools

import jax


def eager_jit(fn=None, *, static_argnames=()):
    if fn is None:
        return functools.partial(eager_jit, static_argnames=static_argnames)
    jitted = jax.jit(fn, static_argnames=static_argnames)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        dynamic = [a for a in args] + [v for k, v in kwargs.items() if k not in static_argnames]
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(dynamic)):
            return fn(*args, **kwargs)
        return jitted(*args, **kwargs)

    return wrapper
