"""scalify(shard_map(f)) == shard_map(f) for the collectives of a shard_map body (float32,
power-of-two scales != 1), with device-varying scales, special values and float16 data
where plain float16 overflows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import scalify
from scalify import ScaledArray
from scalify.inspect import collective_bytes

SCALES = (2.0**-5, 2.0**7)
PERM = [(i, (i + 1) % 4) for i in range(3)]  # device 0 receives nothing


def _rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    ok = ~np.isnan(ref)
    denom = np.maximum(np.max(np.abs(ref[ok]), initial=0), 1e-30)
    return float(np.max(np.abs(out[ok] - ref[ok]), initial=0) / denom)


def _scaled(x, scale):
    return scalify.scaled_array(x / scale, scale)


# Each body takes x sharded on "data" (rows) of a (4, 2) mesh; out spec per result.
BODIES = {
    "psum": (lambda x: lax.psum(x, "data"), P()),
    "psum_2axes": (lambda x: lax.psum(x, ("data", "model")), P()),
    "pmean": (lambda x: lax.pmean(x, "data"), P()),
    "pmax": (lambda x: lax.pmax(x, "data"), P()),
    "pmin": (lambda x: lax.pmin(x, ("data", "model")), P()),
    "all_gather": (lambda x: lax.all_gather(x, "data", tiled=True)[None], P("data")),
    "all_gather_stacked": (lambda x: lax.all_gather(x, "data", axis=1), P("data")),
    "psum_scatter": (lambda x: lax.psum_scatter(x, "data", scatter_dimension=1, tiled=True), P("data")),
    "ppermute": (lambda x: lax.ppermute(x, "data", PERM), P("data")),
    "all_to_all": (lambda x: lax.all_to_all(x, "data", 1, 1, tiled=True), P("data")),
}


# With check_vma=True JAX writes psum as psum_invariant (+ pvary): those cases differ.
VMA_CASES = ("psum", "pmean", "pmax", "ppermute")


# The other bodies bind the same collective under check_vma=True (and plain JAX rejects
# some of them there: varying-axes types), so they run with check_vma=False only.
@pytest.mark.parametrize("name,check_vma", [
    pytest.param(n, v, id=f"{'vma' if v else 'novma'}-{n}")
    for n in sorted(BODIES) for v in (True, False) if n in VMA_CASES or not v])
def test_collective_matches_plain_jax(name, check_vma, mesh42):
    body, out_spec = BODIES[name]

    def f(x, y):
        return body(x), body(y)

    sm = jax.shard_map(f, mesh=mesh42, in_specs=(P("data"), P("data")), out_specs=(out_spec, out_spec),
                       check_vma=check_vma)
    x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    y = np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32) * 100
    ref = sm(x, y)
    out = jax.jit(scalify.scalify(sm))(_scaled(x, SCALES[0]), _scaled(y, SCALES[1]))
    for o, r in zip(out, ref):
        assert isinstance(o, ScaledArray) and np.ndim(o.scale) == 0
        assert o.data.dtype == jnp.float32 and o.shape == r.shape
        assert _rel(o.to_array(), r) <= 1e-6


def _per_device_scale(x):
    i = lax.axis_index("data").astype(jnp.float32)
    return scalify.set_scaling(x, 2.0 ** (3 * i - 4))  # a different scale per device


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_psum_of_float32_range_data_sums_the_values(dtype, mesh42, arguments_as_given):
    """psum of float32 or bfloat16 data with a different scale per device: the values
    d*s are summed as plain JAX sums them (output scale 1, equal to plain JAX, eagerly and
    under jit), so the
    compiled body has the plain program's one all-reduce and no pmax of scales. (The input
    guard is off: its max-abs of the sharded argument would add an all-reduce of its own
    outside the shard_map.)"""

    def f(x):
        return lax.psum(_per_device_scale(x), "data")

    sm = jax.shard_map(f, mesh=mesh42, in_specs=P("data"), out_specs=P(), check_vma=False)
    x = np.random.default_rng(2).standard_normal((16, 8)).astype(dtype)
    ref = sm(x)
    scaled = jax.jit(scalify.scalify(sm))
    def at(s):
        return scalify.scaled_array((x.astype(np.float32) / s).astype(dtype), s)

    sharded = NamedSharding(mesh42, P("data"))
    for s in (2.0**-40, 2.0**-5, 2.0**40):  # the same values at any input scale
        x_s = at(s)
        eager = scalify.scalify(sm)(scalify.scaled_array(jax.device_put(x_s.data, sharded), s))
        for out in (scaled(x_s), eager):
            assert out.data.dtype == dtype and float(out.scale) == 1.0
            np.testing.assert_array_equal(np.asarray(out.to_array(), np.float32), np.asarray(ref, np.float32))
    ops = collective_bytes(scaled.lower(at(2.0**-5)).compile())["count_by_op"]
    plain_ops = collective_bytes(jax.jit(sm).lower(x).compile())["count_by_op"]
    assert ops == plain_ops == {"all-reduce": 1}, (ops, plain_ops)


def test_psum_of_float16_data_is_unit_scaled_at_the_common_scale(mesh42):
    """psum of float16 data over N=4: scale S*sqrt(4) = 2S with S the largest device scale
    (pmax), so that the sum stays in float16's range; pmax and all_gather take S, and a
    sharded output's scale is made common."""

    def f(x):
        x = _per_device_scale(x)
        return lax.psum(x, "data"), lax.pmax(x, "data"), lax.all_gather(x, "data", tiled=True), x

    sm = jax.shard_map(f, mesh=mesh42, in_specs=P("data"), out_specs=(P(), P(), P(), P("data")),
                       check_vma=False)
    x = np.random.default_rng(2).standard_normal((16, 8)).astype(np.float16)
    ref = sm(x)
    out = jax.jit(scalify.scalify(sm))(_scaled(x, 2.0**-5))
    for o, r in zip(out, ref):
        assert o.data.dtype == jnp.float16
        assert _rel(o.to_array(jnp.float32), np.asarray(r, np.float32)) <= 2e-3  # float16 sums of 4 terms
    s_max = 2.0 ** (3 * 3 - 4)
    assert float(out[0].scale) == 2 * s_max  # S*sqrt(4)
    assert float(out[1].scale) == s_max and float(out[2].scale) == s_max
    assert float(out[3].scale) == s_max  # a sharded output's scale is made common (pmax)


def test_special_values_as_plain(mesh42):
    def f(x):
        return lax.psum(x, "data"), lax.pmax(x, "data"), lax.all_gather(x, "data", tiled=True)

    sm = jax.shard_map(f, mesh=mesh42, in_specs=P("data"), out_specs=(P(), P(), P()), check_vma=False)
    x = (np.random.default_rng(3).standard_normal((16, 8)).astype(np.float32))
    x[0, 0], x[5, 1], x[9, 2], x[13, 2], x[2, 3] = np.inf, -np.inf, np.nan, 0.0, -0.0
    x[4, 4], x[8, 4] = np.inf, -np.inf  # inf - inf = nan in the sum
    ref = sm(jnp.asarray(x))
    out = jax.jit(scalify.scalify(sm))(_scaled(jnp.asarray(x), 2.0**7))
    for o, r in zip(out, ref):
        o = np.asarray(o.to_array())
        r = np.asarray(r)
        np.testing.assert_array_equal(np.isnan(o), np.isnan(r))
        np.testing.assert_array_equal(np.isinf(o), np.isinf(r))
        fin = np.isfinite(r)
        np.testing.assert_allclose(o[fin], r[fin], rtol=1e-6, atol=0)


def test_float16_data_where_plain_float16_overflows(mesh8):
    """A sum over 8 devices of values ~2^14: 2^17 overflows float16; the scaled psum keeps
    the data in range (scale 2^20 * sqrt(8) -> 2^21) and equals the float32 sum."""
    def f(x):
        return lax.psum(x, "data")

    sm = jax.shard_map(f, mesh=mesh8, in_specs=P("data"), out_specs=P(), check_vma=False)
    x32 = (2.0**14 * (1 + np.random.default_rng(4).uniform(size=(8, 16)))).astype(np.float32)
    plain16 = sm(x32.astype(jnp.float16))
    assert not np.all(np.isfinite(np.asarray(plain16)))
    xs = scalify.scaled_array((x32 / 2.0**20).astype(jnp.float16), 2.0**20)
    out = jax.jit(scalify.scalify(sm))(xs)
    assert out.data.dtype == jnp.float16 and np.all(np.isfinite(np.asarray(out.data)))
    ref = sm(xs.to_array(jnp.float32))
    assert _rel(out.to_array(jnp.float32), ref) <= 2e-3  # float16 rounding of 8 terms


def test_per_row_scales_are_sharded_with_the_data(mesh42):
    def f(x):
        return lax.psum(x * 2, "data"), x + 1

    sm = jax.shard_map(f, mesh=mesh42, in_specs=P("data"), out_specs=(P(), P("data")), check_vma=False)
    x = np.random.default_rng(5).standard_normal((16, 8)).astype(np.float32)
    rows = 2.0 ** jnp.arange(-8.0, 8.0)[:, None]
    xs = ScaledArray(x / rows, rows)
    ref = sm(xs.to_array())
    out = jax.jit(scalify.scalify(sm))(xs)
    assert out[1].scale.shape == (16, 1)  # per row, sharded like the data
    for o, r in zip(out, ref):
        assert _rel(o.to_array(), r) <= 1e-6


def test_partial_manual_axes_and_nested_jit(mesh42):
    """Only "data" manual ("model" stays automatic); a jit inside the body."""
    def f(x, w):
        y = jax.jit(lambda a, b: a @ b)(x, w)
        return lax.psum(y, "data")

    sm = jax.shard_map(f, mesh=mesh42, in_specs=(P("data"), P()), out_specs=P(), axis_names={"data"},
                       check_vma=False)
    x = np.random.default_rng(6).standard_normal((16, 8)).astype(np.float32)
    w = np.random.default_rng(7).standard_normal((8, 4)).astype(np.float32)
    ref = jax.jit(sm)(x, w)
    out = jax.jit(scalify.scalify(sm))(_scaled(x, 2.0**-5), _scaled(w, 2.0**7))
    assert _rel(out.to_array(), ref) <= 1e-6


def test_gradient_inside_scalified_shard_map(mesh8):
    """Data-parallel gradient of a small model: scalify(shard_map(grad + pmean)) equals the
    single-device gradient of the whole batch."""
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    def local(w, x):
        return lax.pmean(jax.grad(loss)(w, x), "data")

    sm = jax.shard_map(local, mesh=mesh8, in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
    w = np.random.default_rng(8).standard_normal((8, 4)).astype(np.float32) / 4
    x = np.random.default_rng(9).standard_normal((64, 8)).astype(np.float32)
    ref = jax.grad(loss)(w, x)
    out = jax.jit(scalify.scalify(sm))(_scaled(w, 2.0**-5), _scaled(x, 2.0**7))
    assert _rel(out.to_array(), ref) <= 1e-5  # float32 sums in another order
