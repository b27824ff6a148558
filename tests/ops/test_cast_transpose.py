"""`scalify.ops.cast_transpose`: an FP8 cast and its transposed copy in one pass."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalify
from scalify.ops import cast_transpose as ct
from scalify.ops.cast_transpose import cast_transpose
from scalify.ops.fp8 import dot_scaled_tn, fp8_dot_general
from scalify.quant.formats import saturating_cast

E4, E5 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
SOURCES = (jnp.float16, jnp.bfloat16, jnp.float32)


def _special(shape, dtype, scale=300.0):
    """Normal values spread past the formats' max, with +-inf, NaN, a subnormal of the
    source and a value below FP8's smallest subnormal."""
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32) * scale
    flat = x.reshape(-1).at[:5].set(jnp.array([jnp.inf, -jnp.inf, jnp.nan, 1e-7, -3e-5]))
    return flat.reshape(shape).astype(dtype)


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("dtype", [E4, E5])
def test_values_are_the_saturating_cast_and_its_transpose(src, dtype):
    x = _special((64, 256), src)
    ref = saturating_cast(x, dtype)
    for q, qt in (cast_transpose(x, dtype), jax.jit(lambda x: cast_transpose(x, dtype))(x)):
        assert q.dtype == qt.dtype == dtype and qt.shape == (256, 64)
        _same(q, ref)
        _same(qt, np.asarray(ref, np.float32).T)


@pytest.mark.parametrize("src", SOURCES)
def test_the_gpu_kernel_computes_the_saturating_cast(src):
    """The Pallas kernel's own arithmetic (run by Pallas's interpreter): clamped at 448,
    NaN kept, in both layouts."""
    x = _special((128, 512), src)
    q, qt = ct._pallas_2d(x, E4, (64, 256), interpret=True)
    ref = saturating_cast(x, E4)
    _same(q, ref)
    _same(qt, np.asarray(ref, np.float32).T)


def test_split_moves_the_leading_dims_last_and_vmap_maps_over_a_batch():
    x = _special((2, 3, 4, 5), jnp.float32)
    q, qt = cast_transpose(x, E4, split=2)
    assert qt.shape == (4, 5, 2, 3)
    _same(qt, np.transpose(np.asarray(q, np.float32), (2, 3, 0, 1)))
    qv, qtv = jax.vmap(lambda a: cast_transpose(a, E4))(x[0])
    assert qtv.shape == (3, 5, 4)
    _same(qv, saturating_cast(x[0], E4))
    _same(qtv, np.swapaxes(np.asarray(saturating_cast(x[0], E4), np.float32), 1, 2))


def test_bad_inputs_say_what_to_pass():
    with pytest.raises(ValueError, match="split must be between 1 and"):
        cast_transpose(jnp.ones((4, 4)), E4, split=2)
    with pytest.raises(TypeError, match="floating-point"):
        cast_transpose(jnp.ones((4, 4), jnp.int32), E4)


@pytest.mark.parametrize("jit", [False, True])
def test_inside_scalify_the_data_is_cast_and_the_scale_kept(jit):
    x = scalify.ScaledArray(_special((64, 128), jnp.float16, scale=100.0), jnp.float32(2.0**-10))

    def f(x):
        return cast_transpose(x, E4)

    g = scalify.scalify(f)
    q, qt = (jax.jit(g) if jit else g)(x)
    assert float(q.scale) == float(qt.scale) == 2.0**-10
    ref = saturating_cast(x.data, E4)
    _same(q.data, ref)
    _same(qt.data, np.asarray(ref, np.float32).T)


@pytest.mark.parametrize("inside", [False, True])
def test_a_per_column_scale_is_transposed_with_the_data(inside):
    data = jnp.ones((4, 6), jnp.float16)
    x = scalify.ScaledArray(data, (2.0 ** jnp.arange(6, dtype=jnp.float32)).reshape(1, 6))
    f = lambda x: cast_transpose(x, E4)  # noqa: E731
    q, qt = (scalify.scalify(f) if inside else f)(x)
    np.testing.assert_array_equal(np.asarray(qt.to_array(), np.float32), np.asarray(q.to_array(), np.float32).T)


def test_a_transposed_kernel_is_read_in_its_stored_layout():
    """A weight the model sees as `stored.T` (an FP8 recipe's (out, in) kernel) reaches the
    cast as `stored` itself, read in float16 (the float32 view of float16 data folded):
    no transposed copy of the stored array is made before the cast."""
    stored = scalify.ScaledArray(jnp.ones((16, 8), jnp.float16), jnp.float32(1.0))

    def f(stored):
        w = stored.astype(jnp.float32).T  # the model's (in, out) view
        return cast_transpose(w, E4)

    jaxpr = jax.make_jaxpr(scalify.scalify(f))(stored).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is ct.cast_transpose_p]
    assert eqn.invars[0].aval.shape == (16, 8)
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    src = eqn.invars[0]
    while src in producers:  # only conversions between the stored array and the cast
        assert producers[src].primitive is jax.lax.convert_element_type_p, producers[src]
        src = producers[src].invars[0]
    q, qt = scalify.scalify(f)(stored)
    assert q.shape == (8, 16) and qt.shape == (16, 8)


@pytest.mark.parametrize("inside", [False, True])
def test_fp8_matmul_values_and_gradients_are_those_of_casting_each_layout_apart(inside):
    """`fp8_dot_general(x, w)` (static scaling) reads a (K, N) w through `cast_transpose`;
    given a `pattern` (here scalify's own data path, `dot_scaled_tn`) it casts w alone and
    transposes the cast. Values and gradients are identical, eagerly and under jit,
    outside and inside scalify; outside they are the FP8 products written with plain
    casts."""
    x = jax.random.normal(jax.random.key(1), (4, 8, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (32, 16), jnp.float32) * 0.1

    def loss_of(pattern):
        def loss(x, w):
            out = fp8_dot_general(x, w, (((2,), (0,)), ((), ())), scaling="static",
                                  preferred_element_type=jnp.float32, pattern=pattern)
            return jnp.sum(out**2)
        return jax.value_and_grad(loss, argnums=(0, 1))

    fn, fn_apart = loss_of(None), loss_of(dot_scaled_tn)
    assert "fp8_cast_transpose" in str(jax.make_jaxpr(fn)(x, w))
    assert "fp8_cast_transpose" not in str(jax.make_jaxpr(fn_apart)(x, w))
    if inside:
        unscale = lambda t: jax.tree.map(  # noqa: E731
            lambda a: a.to_array() if isinstance(a, scalify.ScaledArray) else a, t,
            is_leaf=lambda a: isinstance(a, scalify.ScaledArray))
        wrap = lambda f: lambda *a: unscale(scalify.scalify(f)(*map(scalify.as_scaled_array, a)))  # noqa: E731
        fn, fn_apart = wrap(fn), wrap(fn_apart)
    for run in (lambda f: f, jax.jit):
        got, want = run(fn)(x, w), run(fn_apart)(x, w)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            _same(a, b)
    if not inside:
        q = lambda a, d: saturating_cast(a, d).astype(jnp.float32)  # noqa: E731
        out = jnp.einsum("btk,kn->btn", q(x, E4), q(w, E4))
        g = q(2 * out, E5)
        want = (jnp.sum(out**2), jnp.einsum("btn,kn->btk", g, q(w, E4)), jnp.einsum("btk,btn->kn", q(x, E4), g))
        for a, b in zip(jax.tree.leaves(got), want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_the_benchmark_times_the_three_variants(tmp_path):
    from benchmarks import fp8_cast_transpose as bench

    rows = bench.main(["--shapes", "64x256", "--calls", "2", "--out", str(tmp_path)])
    assert set(rows[0]) == {"shape", "cast", "xla", "cast_transpose"}
    assert all(rows[0][k]["us"] > 0 for k in ("cast", "xla", "cast_transpose"))
    assert "xla / cast_transpose" in (tmp_path / "fp8_cast_transpose.md").read_text()
