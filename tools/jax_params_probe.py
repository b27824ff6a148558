"""Print the parameters of the primitives scalify's rules read, for the installed JAX.

    python tools/jax_params_probe.py

A maintenance aid for supporting a new JAX version: run it under both versions and diff.
"""
import inspect

import jax
import jax.numpy as jnp
from jax import lax


def show(name, fn, *args):
    print(f"== {name}")
    jaxpr = jax.make_jaxpr(fn)(*args)
    for eqn in jaxpr.jaxpr.eqns:
        params = {k: (type(v).__name__ if k in ("jaxpr", "cond_jaxpr", "body_jaxpr", "branches", "call_jaxpr", "fun_jaxpr") else v)
                  for k, v in eqn.params.items()}
        print(f"  {eqn.primitive.name} (in {len(eqn.invars)}, out {len(eqn.outvars)}): {params}")


x = jnp.ones((4, 3), jnp.float32)
print("jax", jax.__version__)
show("scan", lambda x: lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(3), x), x)
show("fori_loop", lambda x: lax.fori_loop(0, 3, lambda i, c: c * 2.0, x), x)
show("while", lambda x: lax.while_loop(lambda c: c[0, 0] < 10.0, lambda c: c * 2.0, x), x)
show("top_k", lambda x: lax.top_k(x, 2), x)
show("jit", lambda x: jax.jit(jnp.sin)(x), x)
show("tanh grad", jax.grad(lambda x: jnp.tanh(x).sum()), x)
show("cond", lambda x: lax.cond(x[0, 0] > 0, jnp.sin, jnp.cos, x), x)
show("remat", jax.checkpoint(lambda x: jnp.sin(x) * 2), x)
show("custom_jvp", jax.nn.gelu, x)
show("custom_vjp grad", jax.grad(lambda x: jax.nn.relu(x).sum()), x)
show("gather", lambda x: x[jnp.array([0, 2])], x)
show("scatter-add", lambda x: x.at[jnp.array([0, 2])].add(1.0), x)
show("sort", lambda x: jnp.sort(x, axis=0), x)
show("cumsum", lambda x: jnp.cumsum(x, axis=0), x)
show("argmax", lambda x: jnp.argmax(x, axis=0), x)
show("reduce_precision", lambda x: lax.reduce_precision(x, 5, 10), x)
show("clamp/round", lambda x: jnp.round(jnp.clip(x, 0.0, 1.0)), x)
show("dot", lambda x: x @ x.T, x)
print("== primitive names in jax.extend.core.primitives")
import jax.extend.core.primitives as P  # noqa: E402
print(sorted(n for n in dir(P) if n.endswith("_p")))
from jax._src.lax.control_flow import loops  # noqa: E402
print("== scan_p impl signature:", inspect.signature(loops._scan_impl))
