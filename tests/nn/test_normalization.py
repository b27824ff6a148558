import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalify
import scalify.ops
from scalify.nn import LayerNorm, gelu, layer_norm, normalize, relu, silu

RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.standard_normal((4, 8, 32)) * 3 + 1, jnp.float32)
G = jnp.asarray(RNG.standard_normal((4, 8, 32)), jnp.float32)
VARS = LayerNorm().init(jax.random.PRNGKey(0), X)
VARS = jax.tree.map(lambda p: p + jnp.asarray(RNG.standard_normal(p.shape) * 0.1, p.dtype), VARS)


def _loss(module):
    return lambda v, x: jnp.sum(module.apply(v, x).astype(jnp.float32) * G)


def test_matches_flax_layernorm():
    np.testing.assert_allclose(LayerNorm().apply(VARS, X), fnn.LayerNorm().apply(VARS, X), atol=2e-6)
    ref = jax.grad(_loss(fnn.LayerNorm()), argnums=(0, 1))(VARS, X)
    got = jax.grad(_loss(LayerNorm()), argnums=(0, 1))(VARS, X)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)
    # Outside scalify the gradient rescale is the identity.
    g2 = jax.grad(_loss(LayerNorm(grad_rescale="max")), argnums=1)(VARS, X)
    np.testing.assert_array_equal(g2, got[1])


def test_bf16_dtype_and_axes():
    y = LayerNorm(dtype=jnp.bfloat16).apply(VARS, X)
    assert y.dtype == jnp.bfloat16
    ref = fnn.LayerNorm(dtype=jnp.bfloat16).apply(VARS, X)
    np.testing.assert_allclose(y.astype(jnp.float32), ref.astype(jnp.float32), atol=2e-2)
    z = normalize(X, axes=(1, 2))
    np.testing.assert_allclose(jnp.mean(z, axis=(1, 2)), 0.0, atol=1e-5)
    np.testing.assert_allclose(jnp.var(z, axis=(1, 2)), 1.0, atol=1e-4)
    with pytest.raises(ValueError, match="grad_rescale"):
        normalize(X, grad_rescale="rms")


@pytest.mark.parametrize("scale", [2.0**-20, 2.0**-7, 2.0**20])
@pytest.mark.parametrize("rescale", [None, "l2"])
def test_scalified_layernorm_equals_plain(scale, rescale):
    """Model invariance: same value (eps acts on the value), output scale 1, same gradient."""
    xs = X * scale
    sx = scalify.as_scaled_array(xs, scale=jnp.float32(scale))
    f = jax.value_and_grad(_loss(LayerNorm(grad_rescale=rescale)), argnums=1)
    ref_v, ref_g = f(VARS, xs)
    v, g = jax.jit(scalify.scalify(f))(VARS, sx)
    np.testing.assert_allclose(scalify.asarray(v), ref_v, rtol=1e-5)
    np.testing.assert_allclose(scalify.asarray(g), ref_g, rtol=1e-5, atol=1e-6 * float(jnp.abs(ref_g).max()))
    y = jax.jit(scalify.scalify(lambda x: LayerNorm().apply(VARS, x)))(sx)
    assert isinstance(y, scalify.ScaledArray)
    np.testing.assert_allclose(scalify.asarray(y), LayerNorm().apply(VARS, xs), atol=3e-6)
    if rescale:  # the gradient data has unit RMS in [1, 2) (round-down mode)
        rms = float(jnp.sqrt(jnp.mean(g.data.astype(jnp.float32) ** 2)))
        assert 1.0 <= rms < 2.0
    else:  # gradient scale = g's scale / u: tiny for scale 2^20 (1/sigma ~ 2^-20)
        assert float(g.scale) != 1.0


def test_float16_data_at_extreme_scale():
    """float16 data of value ~2^20 (beyond float16's 65504): plain float16 overflows,
    scalified float16 keeps the normalisation and its gradient accurate."""
    scale = 2.0**20
    x16 = X.astype(jnp.float16)
    sx = scalify.scaled_array(x16, jnp.float32(scale))
    plain = LayerNorm(dtype=jnp.float16).apply(VARS, (X * scale).astype(jnp.float16))
    assert not np.isfinite(np.asarray(plain, np.float32)).all()
    f = jax.grad(lambda x: jnp.sum(layer_norm(x, grad_rescale="l2").astype(jnp.float32) * G))
    g = jax.jit(scalify.scalify(f))(sx)
    assert g.data.dtype == jnp.float16
    ref = jax.grad(lambda x: jnp.sum(layer_norm(x) * G))(X * scale)
    np.testing.assert_allclose(scalify.asarray(g, jnp.float32), ref, rtol=2e-2, atol=2e-3 * float(jnp.abs(ref).max()))
    y = jax.jit(scalify.scalify(lambda x: layer_norm(x)))(sx)
    np.testing.assert_allclose(scalify.asarray(y, jnp.float32), layer_norm(X * scale), atol=5e-3)


def test_activations_are_the_ops_ones():
    assert gelu is scalify.ops.gelu and relu is scalify.ops.relu and silu is scalify.ops.silu


def _np_norm(v, norm):
    v = np.abs(np.asarray(v, np.float64))
    return {"l2": np.sqrt(np.mean(v * v)), "max": v.max(), "l1": v.mean()}[norm]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("x_scale, g_scale", [(2.0**-40, 2.0**40), (1.0, 2.0**-3), (2.0**40, 2.0**-40)])
@pytest.mark.parametrize("norm", ["l2", "max", "l1"])
def test_grad_rescale_gives_unit_norm(norm, x_scale, g_scale, dtype, jit):
    """The rescaled input gradient (l2 of float16 gradients: norm from row moments, dx never
    stored in float32; otherwise the generic rescale): its value is the plain float32
    gradient, and its scale is the power of two that gives the data unit l2 / max / l1
    norm, whatever the scales of x and of the incoming gradient (2^-40..2^40)."""
    # rows of different norms, mostly along y (the part the LayerNorm gradient removes)
    w = np.asarray(G) * np.linspace(0.1, 10.0, G.shape[-1]) + 8.0 * np.asarray(layer_norm(X))
    sx = scalify.scaled_array(X.astype(dtype), jnp.float32(x_scale))
    sw = scalify.scaled_array(jnp.asarray(w, dtype), jnp.float32(g_scale))

    def f(x, wv):
        y, vjp = jax.vjp(lambda t: layer_norm(t, grad_rescale=norm), x)
        return vjp(wv)[0]

    fn = scalify.scalify(f)
    g = (jax.jit(fn) if jit else fn)(sx, sw)
    assert isinstance(g, scalify.ScaledArray) and g.data.dtype == dtype
    ref = jax.vjp(lambda t: layer_norm(t), X.astype(jnp.float32) * x_scale)[1](
        jnp.asarray(w, dtype).astype(jnp.float32) * g_scale)[0]
    ref = np.asarray(ref, np.float64)
    value = np.asarray(g.data, np.float64) * float(g.scale)
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(value, ref, rtol=4 * eps, atol=4 * eps * np.abs(ref).max())
    n = _np_norm(g.data, norm)  # unit norm in [1, 2) (round-down mode), up to the data's rounding
    assert 1.0 - 2 * eps <= n < 2.0 + 2 * eps, (n, float(g.scale))


@pytest.mark.parametrize("norm", ["l2", "max", "l1"])
def test_grad_rescale_of_zero_and_nonfinite_gradients(norm):
    """A zero incoming gradient keeps its scale (no 0 or inf scale); inf propagates to the
    value as in plain JAX (no silent finite number)."""
    sx = scalify.scaled_array(X.astype(jnp.float16), jnp.float32(4.0))
    f = scalify.scalify(lambda x, wv: jax.vjp(lambda t: layer_norm(t, grad_rescale=norm), x)[1](wv)[0])
    zero = scalify.scaled_array(jnp.zeros(X.shape, jnp.float16), jnp.float32(8.0))
    g = jax.jit(f)(sx, zero)
    assert np.all(np.asarray(g.data) == 0) and np.isfinite(float(g.scale)) and float(g.scale) > 0
    bad = scalify.scaled_array(jnp.asarray(G, jnp.float16).at[1, 2, 3].set(jnp.inf), jnp.float32(1.0))
    g = jax.jit(f)(sx, bad)
    plain = jax.vjp(lambda t: layer_norm(t), X * 4.0)[1](jnp.asarray(G).at[1, 2, 3].set(jnp.inf))[0]
    value = np.asarray(scalify.asarray(g, jnp.float32))
    assert np.array_equal(np.isfinite(value), np.isfinite(np.asarray(plain)))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("x_scale", [2.0**100, 2.0**127])
def test_input_at_the_top_of_the_scale_range(x_scale, jit):
    """x at scale up to 2^127: 1/sigma's scale, 2^-127, is clamped to the range (it flushed
    to a zero scale) with the rest in its data, and the gradient is the plain one at scale
    1 divided by the scale (the normalisation is scale-invariant; eps is negligible)."""
    sx = scalify.scaled_array(X.astype(jnp.float16), jnp.float32(x_scale))
    f = scalify.scalify(jax.grad(lambda x: jnp.sum(layer_norm(x).astype(jnp.float32) * G)))
    g = (jax.jit(f) if jit else f)(sx)
    assert float(g.scale) > 0
    plain = jax.grad(lambda x: jnp.sum(layer_norm(x) * G))(X.astype(jnp.float16).astype(jnp.float32))
    ref = np.asarray(plain, np.float64) / x_scale
    value = np.asarray(g.data, np.float64) * float(g.scale)
    eps = float(jnp.finfo(jnp.float16).eps)
    np.testing.assert_allclose(value, ref, rtol=4 * eps, atol=4 * eps * np.abs(ref).max())


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("rescale", [None, "l2"])
@pytest.mark.parametrize("g_scale", [2.0**-126, 2.0**-100, 2.0**100, 2.0**127])
def test_gradient_at_the_ends_of_the_scale_range(g_scale, rescale, jit):
    """The incoming gradient at a scale at either end of float32's normal range (a zero
    gradient behind a zero-initialised gate shrinks there: a DiT's adaLN-Zero), times the
    1/sigma scale: the product leaves the range, so it is clamped and the rest goes into
    the data. A zero gradient stays zero at a positive finite scale (not a zero scale, the
    NaN of 0 x inf under jit); a non-zero one has the plain float32 gradient's value."""
    sx = scalify.scaled_array(X.astype(jnp.float16), jnp.float32(4.0))  # 1/sigma at scale 2^-1
    f = scalify.scalify(lambda x, wv: jax.vjp(lambda t: layer_norm(t, grad_rescale=rescale), x)[1](wv)[0])
    f = jax.jit(f) if jit else f
    zero = scalify.scaled_array(jnp.zeros(X.shape, jnp.float16), jnp.float32(g_scale))
    g = f(sx, zero)
    assert np.all(np.asarray(g.data) == 0)
    assert np.isfinite(float(g.scale)) and float(g.scale) > 0
    gs = scalify.scaled_array(jnp.asarray(G, jnp.float16), jnp.float32(g_scale))
    value = np.asarray(scalify.asarray(f(sx, gs), jnp.float32), np.float64)
    # The gradient is linear in the cotangent: the plain float32 one at scale 1, times
    # g_scale in float64 (in float32 the product would over- or underflow).
    plain = jax.vjp(lambda t: layer_norm(t), X.astype(jnp.float16).astype(jnp.float32) * 4.0)[1](
        jnp.asarray(G, jnp.float16).astype(jnp.float32))[0]
    ref = np.asarray(plain, np.float64) * g_scale
    # float16 data (relative to the largest element); values below float32's smallest
    # normal, 2^-126, may flush to zero, as plain float32 arithmetic flushes them.
    eps = float(jnp.finfo(jnp.float16).eps)
    np.testing.assert_allclose(value, ref, rtol=4 * eps, atol=4 * eps * np.abs(ref).max() + 2.0**-126)


@pytest.mark.parametrize("jit", [False, True])
def test_l2_grad_rescale_of_a_gradient_in_the_span_of_y(jit):
    """Incoming gradient g = a + b y per row: the LayerNorm gradient is (up to float16
    rounding of g) zero, and its row moments cancel in float32. The norm then takes the
    cancellation bound (an upper estimate): finite scale, data RMS at most 2 (no overflow
    from an underestimated norm), value equal to plain float32 JAX on the same float16 g."""
    y = np.asarray(layer_norm(X), np.float64)
    a = RNG.standard_normal(X.shape[:-1] + (1,))
    b = 1.0 + RNG.random(X.shape[:-1] + (1,))
    w16 = jnp.asarray(a + b * y, jnp.float16)
    sx = scalify.scaled_array(X.astype(jnp.float16), jnp.float32(2.0**-10))
    sw = scalify.scaled_array(w16, jnp.float32(2.0**12))
    fn = scalify.scalify(lambda x, wv: jax.vjp(lambda t: layer_norm(t, grad_rescale="l2"), x)[1](wv)[0])
    g = (jax.jit(fn) if jit else fn)(sx, sw)
    assert np.isfinite(float(g.scale)) and float(g.scale) > 0
    data = np.asarray(g.data, np.float64)
    assert np.all(np.isfinite(data)) and np.sqrt(np.mean(data**2)) < 2.0
    ref = np.asarray(jax.vjp(lambda t: layer_norm(t), X.astype(jnp.float16).astype(jnp.float32) * 2.0**-10)[1](
        w16.astype(jnp.float32) * 2.0**12)[0], np.float64)
    value = data * float(g.scale)
    np.testing.assert_allclose(value, ref, atol=1e-2 * np.abs(ref).max())


@pytest.mark.parametrize("jit", [False, True])
def test_normalized_axis_ignores_the_scale_of_an_all_zero_column(jit):
    """Per-feature scales along the normalised axis: the features sit at 2^-40 and one
    all-zero feature kept a stale scale of 2^100 (a zero's scale says nothing about its value).
    The scale made constant over the axis is the largest among non-zero elements: the output
    equals float64's LayerNorm (the largest of all, 2^100, flushed every feature below
    float32's range: an all-zero output)."""
    rng = np.random.default_rng(3)
    data = rng.standard_normal((4, 8)).astype(np.float32)
    data[:, -1] = 0
    cols = np.float32([2.0**-40] * 7 + [2.0**100])
    x = scalify.scaled_array(data, cols)
    f = lambda x: layer_norm(x, epsilon=1e-30)  # noqa: E731
    out = (jax.jit(scalify.scalify(f)) if jit else scalify.scalify(f))(x)
    v = data.astype(np.float64) * np.where(data != 0, cols, 0)
    c = v - v.mean(-1, keepdims=True)
    ref = c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-30)
    np.testing.assert_allclose(np.asarray(scalify.asarray(out), np.float64), ref, rtol=1e-5, atol=1e-5)


def _layer_norm64(v, eps):
    c = v - v.mean(-1, keepdims=True)
    return c / np.sqrt((c * c).mean(-1, keepdims=True) + eps)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 2e-5), (jnp.float16, 4e-3)])
@pytest.mark.parametrize("scale", [2.0**-20, 1.0, 2.0**20])
def test_fast_variance_values_and_gradients(scale, dtype, atol, jit):
    """`fast_variance=True` (flax's `use_fast_variance`): plainly, flax's fast LayerNorm in
    float32; scalified (data in `dtype` at `scale`), the float64 LayerNorm of the value and
    the plain float32 gradient, within `dtype`'s rounding of the output (float16: 2^-11
    relative on |y| <= 3)."""
    x32 = X * scale
    flax_fast = fnn.LayerNorm(use_scale=False, use_bias=False, use_fast_variance=True, epsilon=1e-6)
    np.testing.assert_allclose(layer_norm(x32, fast_variance=True), flax_fast.apply({}, x32), atol=1e-5)
    sx = scalify.scaled_array(X.astype(dtype), jnp.float32(scale))

    def loss(x):
        return jnp.sum(layer_norm(x, fast_variance=True).astype(jnp.float32) * G)

    f = scalify.scalify(jax.value_and_grad(loss))
    v, g = (jax.jit(f) if jit else f)(sx)
    value = np.asarray(X.astype(dtype), np.float64) * scale
    y = scalify.scalify(lambda x: layer_norm(x, fast_variance=True))(sx)
    np.testing.assert_allclose(np.asarray(scalify.asarray(y, jnp.float32)), _layer_norm64(value, 1e-6), atol=atol)
    ref_v, ref_g = jax.value_and_grad(loss)(jnp.asarray(value, jnp.float32))
    np.testing.assert_allclose(float(scalify.asarray(v)), float(ref_v), rtol=atol, atol=atol * 10)
    np.testing.assert_allclose(np.asarray(scalify.asarray(g, jnp.float32)), ref_g,
                               rtol=10 * atol, atol=10 * atol * float(jnp.abs(ref_g).max()))


@pytest.mark.parametrize("jit", [False, True])
def test_fast_variance_lost_to_cancellation_stays_within_the_declared_bound(jit):
    """Rows of mean 2^12 and spread 2^-2: mean(x^2) - mean(x)^2 cancels in float32 (the
    variance, 2^-4, lies below the ulp of mean(x^2) ~ 2^24, 2), and the output is clipped to the +-sqrt(D) that the normalised
    output declares for its products (`defbounds`), plainly and scalified; the two-pass
    variance keeps the rows' true normalisation."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(2.0**12 + 2.0**-2 * rng.standard_normal((8, 32)), jnp.float32)
    fast_var = jnp.mean(x * x, -1) - jnp.mean(x, -1) ** 2
    assert float(fast_var.min()) <= 0  # some rows lose their variance entirely
    bound = np.sqrt(32) * (1 + 1e-6)
    plain = layer_norm(x, fast_variance=True, epsilon=1e-30)
    f = scalify.scalify(lambda t: layer_norm(t, fast_variance=True, epsilon=1e-30))
    scaled = scalify.asarray((jax.jit(f) if jit else f)(scalify.as_scaled_array(x)), jnp.float32)
    for y in (plain, scaled):
        assert np.all(np.isfinite(y)) and float(jnp.abs(y).max()) <= bound
        assert float(jnp.abs(y).max()) > np.sqrt(32) * 0.999  # the clip was reached
    exact = layer_norm(x, epsilon=1e-30)
    np.testing.assert_allclose(exact, _layer_norm64(np.asarray(x, np.float64), 1e-30), atol=1e-2)
