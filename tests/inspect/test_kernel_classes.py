"""`benchmarks/kernel_classes.py` on a compiled program: kernels by the size they write,
scalar kernels by the expensive ops they hold and the scalify rule that emitted them."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import scalify

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from kernel_classes import classify  # noqa: E402


def test_classify_counts_kernels_and_names_the_rule_of_a_scalar_division():
    def f(x, y):
        s = jnp.sqrt(jnp.sum(x * x)) / jnp.max(jnp.abs(y))  # scalar work with a sqrt and a divide
        return x * s + jnp.tanh(y), s

    x = jnp.ones((64, 128))
    sx = scalify.as_scaled_array(x)
    with scalify.ScalifyConfig(rule_scopes=True):
        text = jax.jit(scalify.scalify(f)).lower(sx, x).compile().as_text()
    sizes, scalars = classify(text)
    assert sizes["> 1M"] == 0 and sizes["<= 1M"] >= 1  # the (64, 128) output
    assert sum(sizes.values()) >= 2 and sum(scalars.values()) >= 1
    kinds = {kind for kind, _, _ in scalars}
    assert kinds <= {"reduction", "elementwise"}
    rules = {rule for _, _, rule in scalars}
    assert rules - {"(none)"}, rules  # rule_scopes names the rules in the op names
    # the scalar sqrt and divide are found, and the scalar reductions are told apart
    assert any("sqrt" in ops and "divide" in ops for _, ops, _ in scalars), scalars
    assert any(kind == "reduction" for kind, _, _ in scalars), scalars
