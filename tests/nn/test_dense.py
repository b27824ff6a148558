import functools

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalify
from scalify.nn import FP8_STATS, Dense, LayerNorm, gelu
from scalify.ops.fp8 import E4M3, E5M2, JitScaling

RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.standard_normal((4, 8, 32)), jnp.float32)
G = jnp.asarray(RNG.standard_normal((4, 8, 16)), jnp.float32)
FP8 = functools.partial(
    Dense, input_dtype=E4M3, kernel_dtype=E4M3, grad_dtype=E5M2, output_dtype=jnp.bfloat16
)
KINIT = fnn.initializers.normal(1.0)  # unit-scale weights: FP8 error is then ~2^-4


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _grads(module, variables, x):
    """(output, d params, d fp8_stats, d x) of sum(module(x) * G)."""
    params, stats = variables["params"], variables.get(FP8_STATS)

    def loss(p, s, x):
        v = {"params": p, **({FP8_STATS: s} if s is not None else {})}
        y = module.apply(v, x)
        return jnp.sum(y.astype(jnp.float32) * G), y

    (_, y), (dp, ds, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        params, stats, x
    )
    return y, dp, ds, dx


def test_default_is_flax_dense():
    v = Dense(16).init(jax.random.PRNGKey(0), X)
    assert jax.tree.map(jnp.shape, v) == {"params": {"bias": (16,), "kernel": (32, 16)}}
    np.testing.assert_array_equal(Dense(16).apply(v, X), fnn.Dense(16).apply(v, X))
    y = Dense(16, dtype=jnp.bfloat16).apply(v, X)
    np.testing.assert_array_equal(y, fnn.Dense(16, dtype=jnp.bfloat16).apply(v, X))
    # Same keyword signature as flax.linen.Dense (what experiments/nanogpt passes).
    Dense(16, use_bias=False, dtype=jnp.float32, param_dtype=jnp.float32,
          kernel_init=KINIT, name="x")


def test_fp16_is_configuration():
    layer = Dense(16, dtype=jnp.float16, input_dtype=jnp.float16, kernel_dtype=jnp.float16,
                  grad_dtype=jnp.float16, kernel_init=KINIT)
    v = layer.init(jax.random.PRNGKey(0), X)
    y, dp, _, dx = _grads(layer, v, X)
    assert y.dtype == jnp.float16 and dx.dtype == jnp.float32 and dp["kernel"].dtype == jnp.float32
    ref = Dense(16).apply(v, X)
    assert _rel(y.astype(jnp.float32), ref) < 2e-3


@pytest.mark.parametrize("scaling", ["static", "jit", "delayed", JitScaling(margin=1)])
def test_fp8_dense_matches_float32(scaling):
    layer = FP8(16, scaling=scaling, kernel_init=KINIT)
    v = layer.init(jax.random.PRNGKey(0), X)
    y, dp, ds, dx = _grads(layer, v, X)
    ref_y, ref_dp, _, ref_dx = _grads(Dense(16, kernel_init=KINIT), {"params": v["params"]}, X)
    assert y.dtype == jnp.bfloat16
    assert dx.dtype == jnp.float32 and dp["kernel"].dtype == jnp.float32
    assert _rel(y.astype(jnp.float32), ref_y) < 0.06
    assert _rel(dx, ref_dx) < 0.1
    assert _rel(dp["kernel"], ref_dp["kernel"]) < 0.1
    # The bias gradient is a sum of the bfloat16 output cotangent.
    assert _rel(dp["bias"], ref_dp["bias"]) < 2e-2
    assert (ds is not None) == (scaling == "delayed")


def test_delayed_scaling_stats():
    layer = FP8(16, scaling="delayed", kernel_init=KINIT)
    v = layer.init(jax.random.PRNGKey(0), X)
    assert jax.tree.map(jnp.shape, v[FP8_STATS]) == {
        "input_amax_history": (16,),
        "kernel_amax_history": (16,),
        "grad_amax_history": (16,),
    }
    _, _, new_stats, _ = _grads(layer, v, X)
    assert float(new_stats["input_amax_history"][0]) == float(jnp.max(jnp.abs(X)))
    assert float(new_stats["kernel_amax_history"][0]) == float(jnp.max(jnp.abs(v["params"]["kernel"])))
    # The output gradient arrives in the output dtype (bfloat16).
    assert float(new_stats["grad_amax_history"][0]) == float(jnp.max(jnp.abs(G.astype(jnp.bfloat16))))
    # Next step: the overwritten stats are used (and shifted).
    _, _, newer, _ = _grads(layer, {**v, FP8_STATS: new_stats}, X)
    np.testing.assert_array_equal(newer["input_amax_history"][1], new_stats["input_amax_history"][0])


@pytest.mark.parametrize("scale", [2.0**-12, 2.0**12])
def test_scalified_static_fp8_dense_keeps_extreme_scales(scale):
    layer = FP8(16, scaling="static", output_dtype=jnp.float32, kernel_init=KINIT)
    v = layer.init(jax.random.PRNGKey(0), X)
    ref = Dense(16, kernel_init=KINIT).apply(v, X * scale)
    plain = jax.jit(layer.apply)(v, X * scale)
    assert _rel(plain, ref) > 0.3  # E4M3 under/overflows without scales
    sx = scalify.as_scaled_array(X * scale, scale=jnp.float32(scale))
    out = jax.jit(scalify.scalify(layer.apply))(scalify.as_scaled_array(v), sx)
    assert isinstance(out, scalify.ScaledArray)
    assert _rel(scalify.asarray(out), ref) < 0.06


@pytest.mark.parametrize("roles", [{}, {"input_dtype": E4M3, "kernel_dtype": E4M3, "grad_dtype": E5M2,
                                        "output_dtype": jnp.bfloat16}])
def test_kernel_layout_out_in_is_the_same_layer(roles):
    """"out_in" stores the kernel as (features, in): same init for a seed (fan-in aware
    initialisers included), same outputs, gradients the transpose of "in_out"'s; inside
    scalify too."""
    a = Dense(16, **roles)
    b = Dense(16, kernel_layout="out_in", **roles)
    va, vb = a.init(jax.random.PRNGKey(0), X), b.init(jax.random.PRNGKey(0), X)
    assert vb["params"]["kernel"].shape == (16, 32)
    np.testing.assert_array_equal(vb["params"]["kernel"], va["params"]["kernel"].T)
    ya, dpa, _, dxa = _grads(a, va, X)
    yb, dpb, _, dxb = _grads(b, vb, X)
    np.testing.assert_array_equal(yb, ya)
    np.testing.assert_allclose(dxb, dxa, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dpb["kernel"], dpa["kernel"].T, rtol=1e-6, atol=1e-6)

    def grad_in_scalify(layer, v):
        def f(p, x):
            return jnp.sum(layer.apply({"params": p}, x).astype(jnp.float32) * G)
        p = jax.tree.map(lambda t: scalify.as_scaled_array(t), v["params"])
        return scalify.scalify(jax.grad(f))(p, scalify.as_scaled_array(X))

    ga, gb = grad_in_scalify(a, va), grad_in_scalify(b, vb)
    np.testing.assert_allclose(np.asarray(gb["kernel"]), np.asarray(ga["kernel"]).T, rtol=1e-6, atol=1e-6)


def test_kernel_layout_rejects_unknown():
    with pytest.raises(ValueError, match="kernel_layout must be one of"):
        Dense(16, kernel_layout="io").init(jax.random.PRNGKey(0), X)


@pytest.mark.parametrize("layout", ["in_out", "out_in"])
def test_weight_grad_dtype_rounds_only_the_kernel_gradient(layout):
    """`weight_grad_dtype=bfloat16` on an FP8 layer: the kernel gradient (float32, as the
    kernel) is the default layer's rounded to bfloat16, bit for bit; the output, the input
    and bias gradients are unchanged."""
    layer = FP8(16, kernel_init=KINIT, kernel_layout=layout, scaling="jit")
    v = layer.init(jax.random.PRNGKey(0), X)
    y, dp, _, dx = _grads(layer, v, X)
    y2, dp2, _, dx2 = _grads(layer.clone(weight_grad_dtype=jnp.bfloat16), v, X)
    np.testing.assert_array_equal(y2, y)
    np.testing.assert_array_equal(dx2, dx)
    np.testing.assert_array_equal(dp2["bias"], dp["bias"])
    assert dp2["kernel"].dtype == jnp.float32
    np.testing.assert_array_equal(dp2["kernel"], dp["kernel"].astype(jnp.bfloat16).astype(jnp.float32))


def test_weight_grad_dtype_needs_a_low_precision_layer():
    v = Dense(16).init(jax.random.PRNGKey(0), X)
    with pytest.raises(ValueError, match="low-precision layers"):
        Dense(16, weight_grad_dtype=jnp.bfloat16).apply(v, X)
