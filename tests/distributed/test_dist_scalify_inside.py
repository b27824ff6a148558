"""`scalify` outside and inside a shard_map body (docs/distributed.md, the two patterns)
give the same numbers, and inside a body every scale the specs declare replicated (`P()`)
is the same on every device, also where each device's data have their own magnitude (the
input guard and the power guard would give each device its own scale)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import scalify
from scalify.distributed import scaled_specs

N = 8
# Rows of device k have magnitude 2^(4k - 12): 2^-12 .. 2^16.
MAGNITUDES = 2.0 ** (4 * np.arange(N) - 12)


def _rows(rows_per_device, cols, seed):
    x = np.random.default_rng(seed).standard_normal((N * rows_per_device, cols)).astype(np.float32)
    return x * np.repeat(MAGNITUDES, rows_per_device)[:, None].astype(np.float32)


def _host_value(y):
    """data * scale as a host reads them (device 0's copy of a replicated scale)."""
    return np.asarray(y.data, np.float64) * np.asarray(y.scale, np.float64)


def _assert_replicated_scale(y):
    """Every device holds the same scale."""
    copies = [np.asarray(s.data) for s in y.scale.addressable_shards]
    for c in copies[1:]:
        np.testing.assert_array_equal(c, copies[0])


def _loss(p, b):
    return jnp.mean(jnp.tanh(b @ p["w"]) ** 2)


def local_step(params, batch):
    """The gradient of this device's batch (params made device-varying, so that JAX does
    not sum it over "data" under check_vma=True), averaged over "data"."""
    params = jax.tree.map(lambda p: lax.pcast(p, "data", to="varying"), params)
    g = jax.grad(_loss)(params, batch)
    return jax.tree.map(lambda t: lax.pmean(t, "data"), g)


def test_scalify_outside_and_inside_give_the_global_gradient(mesh8):
    """Both patterns of docs/distributed.md equal jax.grad of the mean loss over the whole
    batch, with a drifted parameter and per-device batch magnitudes (the input guard fires)."""
    w = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32) / 8
    params = {"w": scalify.scaled_array(w * 2.0**-20, 2.0**20)}  # drifted: data 2^-20
    b = _rows(2, 4, 1) / 2.0**10
    batch = scalify.as_scaled_array(b)
    ref = jax.grad(_loss)({"w": w}, b)["w"]

    outside = jax.jit(scalify.scalify(jax.shard_map(
        local_step, mesh=mesh8, in_specs=(P(), P("data")), out_specs=P())))(params, batch)
    inside = jax.jit(jax.shard_map(
        scalify.scalify(local_step), mesh=mesh8,
        in_specs=(scaled_specs(P(), params), scaled_specs(P("data"), batch)),
        out_specs=scaled_specs(P(), params), check_vma=False))(params, batch)
    for out in (outside, inside):
        _assert_replicated_scale(out["w"])
        # float32 sums in another order
        np.testing.assert_allclose(_host_value(out["w"]), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_input_guard_inside_shard_map_gives_one_scale(mesh8):
    """A sharded argument whose pieces have magnitudes 2^-12 .. 2^16 (a guard per device
    would give each its own scale) leaves a scalify-inside body with one scale on every
    device, and data * scale as read on the host is the value; the scale is the one the
    guard gives the whole array outside the shard_map."""
    x = _rows(2, 4, 2)
    sx = scalify.as_scaled_array(x)
    triple = lambda v: v * 3.0  # noqa: E731
    sm = jax.shard_map(scalify.scalify(triple), mesh=mesh8, in_specs=(scaled_specs(P("data"), sx),),
                       out_specs=scaled_specs(P("data"), sx), check_vma=False)
    y = jax.jit(sm)(sx)
    _assert_replicated_scale(y)
    np.testing.assert_allclose(_host_value(y), 3.0 * x.astype(np.float64), rtol=1e-6)
    whole = jax.jit(scalify.scalify(triple))(sx)
    np.testing.assert_array_equal(np.asarray(y.scale), np.asarray(whole.scale))


def test_power_guard_inside_shard_map_gives_one_scale(mesh8):
    """x * x where one device's data exceed the power guard's window (2^53 > 2^52) and the
    others' do not: the guard rescales that device only, and the output scale still agrees."""
    x = np.ones((2 * N, 4), np.float32)
    x[:2] = 2.0**53
    sx = scalify.scaled_array(x, 1.0)
    square = lambda v: v * v  # noqa: E731
    with scalify.ScalifyConfig(input_drift_window=None):  # the power guard alone
        sm = jax.shard_map(scalify.scalify(square), mesh=mesh8, in_specs=(scaled_specs(P("data"), sx),),
                           out_specs=scaled_specs(P("data"), sx), check_vma=False)
        y = jax.jit(sm)(sx)
    _assert_replicated_scale(y)
    np.testing.assert_array_equal(_host_value(y), x.astype(np.float64) ** 2)
