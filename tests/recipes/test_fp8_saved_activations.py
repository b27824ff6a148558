"""`Recipe.fp8_saved_activations`: the inputs of the normalisations and of gelu/silu kept for
the backward pass in E4M3 with a scale per 16 elements, on models written the way their
authors write them (hand-written RMSNorms, `nn.LayerNorm`, SwiGLU with `nn.silu`, GELU
with and without `approximate`)."""
from __future__ import annotations

import contextlib
import io
import re

import flax.linen as nn
import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest

from scalify import recipes
from scalify.ops.saved_activations import GROUP16, dequantize_saved, quantize_saved
from tests.recipes.test_recipes import initial_params, linen_loss, recipe_losses, shared_recipe_run, BATCH
from tests.zoo.models_linen import GPT2, Gemma, Llama, LlamaRMSNorm


class NormSwiGLU(nn.Module):
    """A hand-written RMSNorm, then SwiGLU with `nn.silu` and GELU with `approximate`."""

    @nn.compact
    def __call__(self, x):
        h = LlamaRMSNorm(dtype=jnp.float32)(x)
        gate, up = nn.Dense(32, name="gate")(h), nn.Dense(32, name="up")(h)
        return nn.gelu(nn.silu(gate) * up, approximate=False)


def _fake_saved(x):
    """x as the backward pass sees it: E4M3 with a scale per 16 elements, dequantised."""
    return dequantize_saved(quantize_saved(x, GROUP16), GROUP16, x.dtype)


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("scale", [2.0**-30, 3.0, 2.0**30])
def test_forward_unchanged_backward_at_the_dequantised_inputs(scale, jit):
    """Outside scalify (`FP32` with the option), inputs 2^-30..2^30: the output equals the
    model's exactly, and the gradients are those of the model whose norm, silu and gelu see
    their inputs through E4M3: every one of the three saved inputs goes through one
    quantisation, no more."""
    model = NormSwiGLU()
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 64), jnp.float32) * scale
    maybe_jit = jax.jit if jit else (lambda f: f)
    variables = model.init(jax.random.PRNGKey(1), x)

    def loss(v, x):
        return jnp.sum(model.apply(v, x) ** 2)

    with recipes.precision(recipes.FP32.replace(fp8_saved_activations=True)):
        y = model.apply(variables, x)
        g = maybe_jit(jax.grad(loss, argnums=(0, 1)))(variables, x)
    np.testing.assert_array_equal(y, model.apply(variables, x))

    # The reference: the same model with each saved input replaced, in the backward
    # pass only, by its dequantised E4M3 copy (`jax.custom_vjp` written out by hand).
    def through_e4m3(f):
        @jax.custom_vjp
        def g_(a, *rest):
            return f(a, *rest)

        g_.defvjp(lambda a, *rest: (f(a, *rest), (_fake_saved(a), rest)),
                  lambda res, ct: jax.vjp(f, res[0], *res[1])[1](ct))
        return g_

    def reference(v, x):
        p = v["params"]

        def norm(a, w):
            return LlamaRMSNorm(dtype=jnp.float32).apply({"params": {"weight": w}}, a)

        h = through_e4m3(norm)(x, p["LlamaRMSNorm_0"]["weight"])
        gate = h @ p["gate"]["kernel"] + p["gate"]["bias"]
        up = h @ p["up"]["kernel"] + p["up"]["bias"]
        z = through_e4m3(jax.nn.silu)(gate) * up
        return jnp.sum(through_e4m3(lambda a: jax.nn.gelu(a, approximate=False))(z) ** 2)

    want = maybe_jit(jax.grad(reference, argnums=(0, 1)))(variables, x)
    np.testing.assert_allclose(g[1], want[1], rtol=2e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), g[0], want[0])
    plain = jax.grad(loss, argnums=1)(variables, x)
    assert not np.array_equal(g[1], plain)  # the E4M3 copies are what the backward read


def _residual_bytes(recipe, cls) -> tuple[int, int]:
    """(bytes of the residuals the loss's VJP keeps, bytes of those in an FP8 dtype), from
    `jax.ad_checkpoint.print_saved_residuals` of the loss under `recipe`'s precision."""
    model, params = cls(dtype=jnp.bfloat16), initial_params(cls)
    out = io.StringIO()
    with recipes.precision(recipe), contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(lambda p: linen_loss(model)(p, BATCH), params)
    total = fp8 = 0
    for dtype, dims in re.findall(r"^(\w+)\[([\d,]*)\]", out.getvalue(), re.M):  # "bf16[2,16]", "f8_e4m3fn[...]"
        bits = 8 if dtype.startswith("f8") or dtype == "bool" else int(re.search(r"\d+", dtype).group())
        n = int(np.prod([int(d) for d in dims.split(",") if d])) * bits // 8
        total += n
        fp8 += n if dtype.startswith("f8") else 0
    return total, fp8


@pytest.mark.parametrize("cls", [Llama, GPT2, Gemma], ids=["llama", "gpt2", "gemma"])
def test_saved_inputs_are_fp8_and_fewer_bytes(cls):
    """On the bfloat16 model under `FP8_BF16`: the saved residuals hold more FP8 bytes
    and fewer bytes in all with the option than without."""
    off = _residual_bytes(recipes.FP8_BF16, cls)
    on = _residual_bytes(recipes.FP8_BF16.replace(fp8_saved_activations=True), cls)
    assert on[1] > off[1], (on, off)
    assert on[0] < off[0], (on, off)


@pytest.mark.parametrize("name,cls", [("fp8-fp16-state", Llama), ("fp8-bf16", GPT2), ("fp16", Gemma)])
def test_recipe_with_fp8_saved_activations_trains_like_without(name, cls):
    """Every loss finite, the mean loss within 1% of the same recipe's without the option,
    one compile: float16 (scaled) and bfloat16 activations, norms hand-written and Flax's."""
    base, _, _ = shared_recipe_run(name, cls)
    losses, train, _ = recipe_losses(recipes.get(name).replace(fp8_saved_activations=True), cls)
    assert np.all(np.isfinite(losses)), losses
    assert abs(losses.mean() / base.mean() - 1) < 0.01, (losses, base)
    assert train.step._cache_size() == 1
