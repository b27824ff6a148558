"""Walking a jaxpr in tests: every equation, those of its sub-jaxprs (jit, scan, cond,
remat, custom_vjp and shard_map bodies) included."""
from jax.extend.core import jaxprs_in_params


def equations(jaxpr):
    """Every equation of `jaxpr` (a Jaxpr or a ClosedJaxpr) and of its sub-jaxprs, depth
    first, each equation before those of its sub-jaxprs."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from equations(sub)
