"""scalify.distributed: scaled collectives (wire formats, pre/post/auto, methods), bytes on
the wire from compiled HLO, meshes and sharding rules."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import scalify
from scalify import ScaledArray
from scalify import distributed as D
from scalify.inspect import collective_bytes

E5M2, E4M3 = jnp.float8_e5m2, jnp.float8_e4m3fn
# Relative error bound (to the largest |value|) of a mean over 8 devices on each wire:
# one rounding of each term, then of the partial sums, in the wire format.
TOL = {None: 1e-6, jnp.float16: 2e-3, E5M2: 0.25, E4M3: 0.125}


def _rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def _per_device(seed, shape=(8, 24, 16), spread=3.0):
    """Per-device values with magnitudes spread over a few binades (NumPy: no compiles)."""
    rng = np.random.default_rng(seed)
    mag = 2.0 ** rng.uniform(-spread, spread, shape)
    return (rng.standard_normal(shape) * mag).astype(np.float32)


def _run(mesh, fn, x, out_spec):
    """fn under shard_map on ScaledArray or plain x (sharded on rows), jitted."""
    specs = D.scaled_specs(P("data"), x)
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(specs,), out_specs=out_spec, check_vma=False)
    return jax.jit(sm)(x)


@pytest.mark.parametrize("wire", [None, jnp.float16, E5M2, E4M3], ids=["data", "f16", "e5m2", "e4m3"])
def test_scaled_pmean_and_psum_scatter_match_the_float32_mean(wire, mesh8):
    v = _per_device(0)
    x = v.reshape(-1, v.shape[-1])
    xs = scalify.scaled_array(x / 4, 4.0)  # data within every wire's range / 8
    mean_ref = v.mean(0)
    sum_ref = v.sum(0)

    def fn(x):
        outs = []
        for method in D.METHODS:
            outs += [D.scaled_pmean(x, "data", wire_dtype=wire, scaling=s, method=method) for s in D.SCALINGS]
            outs.append(D.scaled_psum_scatter(x, "data", wire_dtype=wire, method=method))
        return outs

    out_spec = ([D.scaled_specs(P(), xs)] * 3 + [D.scaled_specs(P("data"), xs)]) * 2
    outs = _run(mesh8, fn, xs, out_spec)
    for method, (*means, scattered) in zip(D.METHODS, (outs[:4], outs[4:])):
        for s, m in zip(D.SCALINGS, means):
            assert isinstance(m, ScaledArray) and m.data.dtype == jnp.float32 and m.shape == mean_ref.shape
            assert _rel(m.to_array(), mean_ref) <= TOL[wire], (method, s)
        assert scattered.shape == (24, 16)
        assert _rel(scattered.to_array(), sum_ref) <= TOL[wire], method


@pytest.mark.parametrize("wire", [None, jnp.bfloat16, E5M2], ids=["data", "bf16", "e5m2"])
def test_scaled_pmean_of_per_row_scales_merges_them(wire, mesh8):
    """A ScaledArray with one scale per row (2^-20 to 2^20 apart on a device) averaged
    outside scalify: each device's scale is merged to its largest (the data rescaled), and
    the result is the float32 mean within the wire's precision."""
    v = _per_device(1)
    rows = (2.0 ** np.tile(np.round(np.linspace(-20, 20, v.shape[1])), v.shape[0]))[:, None].astype(np.float32)
    x = v.reshape(-1, v.shape[-1])
    xs = ScaledArray(jnp.asarray(x / rows), jnp.asarray(rows))
    out_spec = D.scaled_specs(P(), scalify.scaled_array(x, 1.0))  # one scale after the merge
    out = _run(mesh8, lambda x: D.scaled_pmean(x, "data", wire_dtype=wire), xs, out_spec)
    assert isinstance(out, ScaledArray) and np.shape(out.scale) == ()
    tol = {None: 1e-6, jnp.bfloat16: 1e-2, E5M2: TOL[E5M2]}[wire]
    # rows of small scale meet the wire's range at the largest one's scale: compare the
    # rows of the largest scale, where nothing underflows
    top = np.asarray(rows[: v.shape[1], 0]) == rows.max()
    assert _rel(np.asarray(out.to_array())[top], v.mean(0)[top]) <= tol


def test_scales_of_the_modes(mesh8):
    """pre: S*N; post: S; auto: the power of two putting amax*N at a quarter of the wire's
    max or below; the mean divides by N in the scale."""
    x = np.ones((8 * 4, 4), np.float32) * np.arange(1.0, 9.0, dtype=np.float32).repeat(4)[:, None]  # device i holds i+1
    xs = scalify.scaled_array(x, 2.0**-3)

    def fn(x):
        return [D.scaled_psum(x, "data", wire_dtype=E5M2, scaling=s) for s in D.SCALINGS] + [
            D.scaled_pmean(x, "data", wire_dtype=E5M2, scaling="pre")]

    pre, post, auto, mean = _run(mesh8, fn, xs, [D.scaled_specs(P(), xs)] * 4)
    assert float(pre.scale) == 2.0**-3 * 8 and float(post.scale) == 2.0**-3
    assert float(mean.scale) == 2.0**-3
    # amax = 8 * 2^-3 = 1; target = 57344 / 16 = 3584; W = 2^ceil(log2(1 / 3584)) = 2^-11.
    assert float(auto.scale) == 2.0**-11
    for o, r in ((pre, 36 / 8), (post, 36 / 8), (auto, 36 / 8), (mean, 36 / 64)):
        np.testing.assert_allclose(np.asarray(o.to_array()), r, rtol=0.125)  # E5M2: 2 mantissa bits


@pytest.mark.parametrize("wire", [jnp.float16, E5M2, E4M3], ids=["f16", "e5m2", "e4m3"])
def test_no_overflow_where_a_plain_low_precision_sum_overflows(wire, mesh8):
    """Values near the wire's max on every device: a plain all-reduce in the wire format
    overflows (inf, or NaN for E4M3); "auto" and "pre" are finite and accurate, "post"
    saturates (finite)."""
    fmax = float(jnp.finfo(wire).max)
    v = (0.6 * fmax * (1 + 0.1 * np.random.default_rng(1).uniform(size=(8, 4, 8)))).astype(np.float32)
    x = v.reshape(32, 8)

    def plain(x):
        return lax.psum(x.astype(wire), "data").astype(jnp.float32)

    sm = jax.jit(jax.shard_map(plain, mesh=mesh8, in_specs=P("data"), out_specs=P(), check_vma=False))
    assert not np.all(np.isfinite(np.asarray(sm(x))))
    scale = 2.0 ** np.floor(np.log2(fmax))
    xs = scalify.scaled_array(x / scale, scale)  # data < 2 on each device: it fits the wire

    def fn(x):
        return [D.scaled_psum(x, "data", wire_dtype=wire, scaling=s) for s in D.SCALINGS]

    for s, o in zip(D.SCALINGS, _run(mesh8, fn, xs, [D.scaled_specs(P(), xs)] * 3)):
        o = np.asarray(o.to_array())
        assert np.all(np.isfinite(o)), s
        if s != "post":
            assert _rel(o, v.sum(0)) <= TOL[wire], s


def test_auto_scaling_keeps_tiny_gradients_that_a_plain_cast_loses(mesh8):
    """Values ~1e-9 underflow a plain E5M2 cast (smallest subnormal 2^-16); auto scales them
    into range, also for plain arrays outside scalify."""
    v = 1e-9 * _per_device(2, (8, 8, 8), spread=1.0)
    x = v.reshape(64, 8)

    def fn(x):
        return D.scaled_pmean(x, "data", wire_dtype=E5M2)

    out = _run(mesh8, fn, x, P())
    assert not isinstance(out, ScaledArray) and out.dtype == jnp.float32
    assert _rel(out, v.mean(0)) <= TOL[E5M2]
    assert np.all(x.astype(E5M2).astype(np.float32) == 0)


def test_special_values_propagate(mesh8):
    x = np.random.default_rng(3).standard_normal((32, 8)).astype(np.float32)
    x[0, 0], x[5, 1], x[9, 2], x[13, 3] = np.inf, -np.inf, np.nan, np.inf
    x[17, 3] = -np.inf  # inf - inf = nan
    xs = scalify.scaled_array(jnp.asarray(x), 2.0**-2)

    def fn(x):
        return [D.scaled_psum(x, "data", wire_dtype=w) for w in (None, jnp.float16, E5M2)]

    ref = np.asarray(x.reshape(8, 4, 8).sum(0)) * 2.0**-2
    for o in _run(mesh8, fn, xs, [D.scaled_specs(P(), xs)] * 3):
        o = np.asarray(o.to_array())
        np.testing.assert_array_equal(np.isnan(o), np.isnan(ref))
        np.testing.assert_array_equal(np.isposinf(o), np.isposinf(ref))
        np.testing.assert_array_equal(np.isneginf(o), np.isneginf(ref))


@pytest.mark.usefixtures("arguments_as_given")
def test_inside_scalify_the_result_is_scaled(mesh8):
    """Inside scalify, plain values are read with get_data_scale and the mean is a
    ScaledArray with the chosen wire scale; float32 wire: equal to the plain mean (the
    values travel as they are: scale 1/N)."""
    v = _per_device(4, (8, 4, 8))
    x = v.reshape(32, 8)
    xs = scalify.scaled_array(x * 2.0**7, 2.0**-7)

    def fn(x):
        return (D.scaled_pmean(x, "data"), D.scaled_pmean(x, "data", wire_dtype=E5M2),
                D.scaled_pmean(x, "data", wire_dtype=E5M2, scaling="pre", method="all_to_all"))

    sm = jax.shard_map(fn, mesh=mesh8, in_specs=P("data"), out_specs=P(), check_vma=False)
    exact, fp8, fp8_pre = jax.jit(scalify.scalify(sm))(xs)
    assert isinstance(exact, ScaledArray) and _rel(exact.to_array(), v.mean(0)) <= 1e-6
    assert float(exact.scale) == 1.0 / 8
    assert _rel(fp8.to_array(), v.mean(0)) <= TOL[E5M2]
    # all_to_all: the senders use W = S * N2 ("pre"); the gathered shard sums carry their own
    # power-of-two scales (amax at the top of E5M2), the largest becomes the output's.
    amax = np.max(np.abs(v.sum(0))) / (2.0**-7 * 8)  # the shard sums in units of W
    w = 2.0 ** np.ceil(np.log2(amax / float(jnp.finfo(E5M2).max)))
    assert float(fp8_pre.scale) == 2.0**-7 * w and _rel(fp8_pre.to_array(), v.mean(0)) <= TOL[E5M2]


def test_collective_bytes_of_the_wire_formats(mesh8):
    x = np.zeros((8 * 64, 32), np.float32)
    stats = {}
    for name, wire, method in (("f32", None, "psum"), ("f16", jnp.float16, "psum"),
                               ("e5m2-a2a", E5M2, "all_to_all")):
        sm = jax.shard_map(lambda v: D.scaled_pmean(v, "data", wire_dtype=wire, method=method),
                           mesh=mesh8, in_specs=P("data"), out_specs=P(), check_vma=False)
        stats[name] = collective_bytes(jax.jit(sm).lower(x).compile(), min_elements=64)  # no scalars
    elems = 64 * 32
    assert stats["f32"]["operand_bytes"] == 4 * elems and stats["f32"]["by_op"] == {"all-reduce": 4 * elems}
    assert stats["f16"]["operand_bytes"] == 2 * elems
    # all-to-all of the 1-byte words, then all-gather of this device's 1/8 of the sums; each
    # piece carries its sender's float32 scale (4 bytes) in the same buffer
    assert stats["e5m2-a2a"]["count"] == 2
    assert stats["e5m2-a2a"]["by_op"] == {"all-to-all": elems + 8 * 4, "all-gather": elems // 8 + 4}
    assert stats["e5m2-a2a"]["wire_bytes"] == pytest.approx(stats["f32"]["wire_bytes"] / 4, rel=0.02)
    assert stats["f32"]["wire_bytes"] == pytest.approx(2 * 7 / 8 * 4 * elems)


def test_collective_bytes_parses_gpu_style_hlo():
    text = """
  %all-reduce-start = f32[1024,64]{1,0} all-reduce-start(f32[1024,64]{1,0} %fusion.1), channel_id=1, replica_groups=[1,4]<=[4], use_global_device_ids=true, to_apply=%add
  %all-reduce-done = f32[1024,64]{1,0} all-reduce-done(f32[1024,64]{1,0} %all-reduce-start)
  %rs = f8e5m2[256,64]{1,0} reduce-scatter(f8e5m2[1024,64]{1,0} %p), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add.2
  %ag = (bf16[64]{0}, bf16[32]{0}) all-gather(bf16[16]{0} %a, bf16[8]{0} %b), replica_groups={{0,1},{2,3}}, dimensions={0}
  %s = f32[] all-reduce(f32[] %loss), replica_groups={{0,1,2,3}}, to_apply=%add
  %m = f16[8,8]{1,0} all-reduce(%x), channel_id=3, replica_groups=mesh['a'=2,'b'=2] {'b'}, to_apply=%add
  %ags = (f32[4]{0}, f32[16]{0}) all-gather-start(%y), replica_groups={{0,1,2,3}}, dimensions={0}
  %cps = (f32[10]{0}, f32[10]{0}, u32[], u32[]) collective-permute-start(%z), source_target_pairs={{0,1},{1,0}}
  %rs2 = bf16[2,8]{1,0} reduce-scatter(%w), replica_groups={}, dimensions={0}, to_apply=%add
"""
    st = collective_bytes(text)
    assert st["count"] == 8
    ar, rs, ag, s, m, ags, cps, rs2 = st["ops"]
    assert (m.operand_bytes, m.group_size, m.wire_bytes) == (128, 2, 128)  # operand from the result
    assert (ags.op, ags.operand_bytes, ags.wire_bytes) == ("all-gather", 16, 48)
    assert (cps.op, cps.operand_bytes, cps.wire_bytes) == ("collective-permute", 40, 40)
    # replica_groups={}: every device of the program (num_partitions, absent here: None)
    assert (rs2.op, rs2.group_size) == ("reduce-scatter", None)
    assert (ar.op, ar.operand_bytes, ar.group_size) == ("all-reduce", 1024 * 64 * 4, 4)
    assert ar.wire_bytes == pytest.approx(1.5 * 1024 * 64 * 4)
    assert (rs.op, rs.dtypes, rs.operand_bytes, rs.wire_bytes) == ("reduce-scatter", ("f8e5m2",), 1024 * 64,
                                                                    0.75 * 1024 * 64)
    assert (ag.op, ag.operand_bytes, ag.group_size, ag.wire_bytes) == ("all-gather", 48, 2, 48)
    assert collective_bytes(text, min_elements=2)["count"] == 7
    assert collective_bytes("HloModule m, num_partitions=4\n" + text)["ops"][-1].group_size == 4
    assert st["by_dtype"]["f8e5m2"] == 1024 * 64


def test_collective_bytes_counts_the_operands_of_an_async_gpu_all_reduce_once():
    """XLA:GPU prints an async all-reduce as ((operands), output aliased to the operands),
    with operands named but not shaped: the operands are counted, not twice."""
    text = ("  %all-reduce-start.8 = ((bf16[12596224]{0}), bf16[12596224]{0}) all-reduce-start("
            "%wrapped_concatenate.7), channel_id=1, replica_groups=mesh['data'=2] {'data'}, "
            "use_global_device_ids=true, to_apply=%region_98.99, output_to_operand_aliasing={{1}: (0, {})}\n"
            "  %all-reduce-done.8 = bf16[12596224]{0} all-reduce-done(%all-reduce-start.8)\n"
            "  %ars = ((bf16[8]{0}, f32[4]{0}), bf16[8]{0}, f32[4]{0}) all-reduce-start(%a, %b), "
            "replica_groups={{0,1}}, to_apply=%add\n")
    big, pair = collective_bytes(text)["ops"]
    assert (big.op, big.elements, big.operand_bytes, big.wire_bytes) == (
        "all-reduce", 12596224, 2 * 12596224, 2 * 12596224)
    assert pair.bytes_by_dtype == (("bf16", 16), ("f32", 16)) and pair.elements == 12


def test_collective_bytes_counts_an_async_gpu_reduce_scatter():
    """XLA:GPU prints an async (and combined) reduce-scatter as ((operands), (outputs)) with
    unshaped operands: the operands are the full gradients, the outputs their shards."""
    text = ("  %reduce-scatter-start = ((bf16[50304,1024]{1,0}), bf16[25152,1024]{1,0}) reduce-scatter-start("
            "%loop_convert_fusion), channel_id=1, replica_groups=mesh['data'=2] {'data'}, "
            "use_global_device_ids=true, dimensions={0}, to_apply=%region_85.86\n"
            "  %reduce-scatter-done = bf16[25152,1024]{1,0} reduce-scatter-done(%reduce-scatter-start)\n"
            "  %reduce-scatter-start.1 = ((bf16[1024,512]{1,0}, f32[4096]{0}), (bf16[512,512]{1,0}, f32[2048]{0})) "
            "reduce-scatter-start(%a, %b), channel_id=2, replica_groups={{0,1}}, dimensions={0}, to_apply=%add\n")
    st = collective_bytes(text)
    one, combined = st["ops"]
    assert (one.op, one.elements, one.operand_bytes, one.group_size) == ("reduce-scatter", 50304 * 1024,
                                                                         2 * 50304 * 1024, 2)
    assert one.wire_bytes == pytest.approx(0.5 * 2 * 50304 * 1024)
    assert combined.bytes_by_dtype == (("bf16", 2 * 1024 * 512), ("f32", 4 * 4096))
    assert st["count_by_op"] == {"reduce-scatter": 2}


def test_collective_bytes_splits_a_combined_collective_by_dtype():
    """A combined all-reduce of bf16 and f32 operands: each dtype gets its own bytes (not an
    even split of the total)."""
    text = ("  %ar = (bf16[1000]{0}, f32[10]{0}) all-reduce-start(bf16[1000]{0} %a, f32[10]{0} %b), "
            "replica_groups={{0,1}}, to_apply=%add\n")
    st = collective_bytes(text)
    assert st["by_dtype"] == {"bf16": 2000, "f32": 40}
    (op,) = st["ops"]
    assert op.bytes_by_dtype == (("bf16", 2000), ("f32", 40)) and op.operand_bytes == 2040


def test_make_mesh():
    n = jax.device_count()
    assert D.make_mesh().shape == {"data": n}
    assert D.make_mesh(1).devices.size == 1
    if n >= 8:
        m = D.make_mesh((-1, 2), ("data", "model"))
        assert dict(m.shape) == {"data": n // 2, "model": 2}
    with pytest.raises(ValueError, match="available"):
        D.make_mesh(n + 1)
    with pytest.raises(ValueError, match="length"):
        D.make_mesh((n,), ("a", "b"))


def test_fsdp_specs_and_scaled_specs(mesh8):
    tree = {
        "kernel": ScaledArray(jnp.zeros((64, 256)), jnp.ones(())),  # largest divisible dim: 1
        "rows": ScaledArray(jnp.zeros((512, 8)), jnp.ones((512, 1))),  # per-row scale
        "bias": jnp.zeros((256,)),  # small: replicated
        "odd": jnp.zeros((33, 35)),  # nothing divisible by 8
        "count": jnp.zeros((), jnp.int32),
    }
    specs = D.fsdp_specs(tree, mesh8, min_size=1024)
    assert specs["kernel"].data == P(None, "data") and specs["kernel"].scale == P()
    assert specs["rows"].data == P("data") and specs["rows"].scale == P("data", None)
    assert specs["bias"] == P() and specs["odd"] == P() and specs["count"] == P()
    sh = D.fsdp_shardings(tree, mesh8)
    placed = jax.device_put(tree, sh)
    assert placed["kernel"].data.sharding.spec == P(None, "data")
    assert placed["kernel"].data.addressable_shards[0].data.shape == (64, 32)
    rep = D.replicated_shardings(tree, mesh8)
    assert rep["kernel"].scale.spec == P() and rep["bias"].spec == P()
    ss = D.scaled_specs({"kernel": P("data"), "bias": P(), "rows": P("data"), "odd": P(), "count": P()}, tree)
    assert ss["kernel"].data == P("data") and ss["kernel"].scale == P()
    assert ss["rows"].scale == P("data", None)


def test_bad_options(mesh8):
    with pytest.raises(ValueError, match="scaling"):
        _run(mesh8, lambda x: D.scaled_psum(x, "data", scaling="bogus"), jnp.zeros((8, 2)), P())
    with pytest.raises(ValueError, match="wire_dtype"):
        _run(mesh8, lambda x: D.scaled_psum(x, "data", wire_dtype=jnp.int8), jnp.zeros((8, 2)), P())
    with pytest.raises(ValueError, match="method"):
        _run(mesh8, lambda x: D.scaled_psum(x, "data", method="ring"), jnp.zeros((8, 2)), P())


def test_auto_scaling_fits_the_output_dtype(mesh8):
    """float16 data over a bfloat16 wire: the wire's range is float32's, the sum must still
    fit the float16 output data."""
    v = _per_device(5, (8, 4, 8), spread=1.0)
    xs = scalify.scaled_array(v.reshape(32, 8).astype(np.float16), 1.0)

    def fn(x):
        return D.scaled_psum(x, "data", wire_dtype=jnp.bfloat16)

    out = _run(mesh8, fn, xs, D.scaled_specs(P(), xs))
    assert out.data.dtype == jnp.float16 and np.all(np.isfinite(np.asarray(out.data, np.float32)))
    assert _rel(out.to_array(jnp.float32), v.sum(0)) <= 2e-2  # bfloat16 terms and sums


@pytest.mark.parametrize("scale_exp", [-40, 0, 40])
def test_auto_on_a_float32_range_wire_needs_no_common_scale(scale_exp, mesh8):
    """"auto" over a bfloat16 wire: the values travel as they are (as the plain bfloat16
    psum of the values), with no pmax before the all-reduces: one all-reduce per
    leaf and nothing else. float16 data with scales 2^-40..2^40 (values far outside
    float16's range): the float16 output gets a fitted power-of-two scale with max |data|
    in (out_max / 4, out_max / 2]."""
    v = _per_device(6, (8, 4, 8), spread=2.0)
    scale = 2.0**scale_exp
    leaves = [scalify.scaled_array(v.reshape(32, 8).astype(np.float16), scale),
              scalify.scaled_array(v.reshape(32, 8)[:, :4], scale)]

    def fn(x):
        return D.scaled_pmean(x, "data", wire_dtype=jnp.bfloat16)

    specs = D.scaled_specs(P("data"), leaves)
    eager = jax.shard_map(fn, mesh=mesh8, in_specs=(specs,), out_specs=D.scaled_specs(P(), leaves),
                          check_vma=False)
    sm = jax.jit(eager)
    ops = collective_bytes(sm.lower(leaves).compile())["ops"]
    assert ops and all(o.op == "all-reduce" and o.elements >= 4 * 8 for o in ops), ops
    f16_out, f32_out = sm(leaves)
    for a, b in zip(jax.tree.leaves((f16_out, f32_out)), jax.tree.leaves(eager(leaves))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # eager: the same values
    for leaf, out in ((leaves[0], f16_out), (leaves[1], f32_out)):
        vals = np.asarray(leaf.data, np.float32).reshape(8, 4, -1).astype(np.float64) * scale
        ref = vals.astype(jnp.bfloat16).astype(np.float64).sum(0) / 8  # the plain bf16 psum
        assert out.data.dtype == leaf.data.dtype
        got = np.asarray(out.data, np.float64) * float(out.scale)
        assert _rel(got, ref) <= 2e-2  # bfloat16 partial sums, then the float16 output
    assert float(f32_out.scale) == 1 / 8
    top = float(np.max(np.abs(np.asarray(f16_out.data, np.float32))))
    fmax = float(jnp.finfo(jnp.float16).max)
    assert fmax / 4 < top <= fmax / 2, top


def test_gather_as_moves_fp8_bytes_and_passes_the_gradient(mesh8, arguments_as_given):
    """gather_as: the sharded value is all-gathered as E4M3 bytes, equal to the E4M3 cast
    (saturating), inside scalify with its scale kept; the gradient is straight-through."""
    from jax.sharding import NamedSharding

    shard, full = NamedSharding(mesh8, P("data")), NamedSharding(mesh8, P())
    x = np.random.default_rng(6).standard_normal((64, 8)).astype(np.float32) * 100
    x[0, 0] = 1000.0  # above E4M3's max 448: saturates

    def loss(w):
        return jnp.sum(D.gather_as(w, E4M3, full, source=shard) * jnp.arange(8.0))

    f = jax.jit(jax.value_and_grad(loss), in_shardings=shard)
    ops = collective_bytes(f.lower(x).compile())["ops"]
    assert [(o.op, o.dtypes) for o in ops if o.op == "all-gather"] == [("all-gather", ("u8",))]
    val, grad = f(x)
    q = np.asarray(jnp.clip(x, -448, 448).astype(E4M3).astype(np.float32))
    np.testing.assert_allclose(val, np.sum(q * np.arange(8.0)), rtol=1e-6)
    np.testing.assert_array_equal(grad, np.broadcast_to(np.arange(8.0, dtype=np.float32), x.shape))
    # Inside scalify: the data cross the wire, the scale stays.
    xs = scalify.scaled_array(x / 256, 256.0)
    out = jax.jit(scalify.scalify(lambda w: D.gather_as(w, E4M3, full, source=shard)))(xs)
    assert isinstance(out, ScaledArray) and float(out.scale) == 256.0
    np.testing.assert_array_equal(out.data, np.asarray((x / 256).astype(E4M3).astype(np.float32)))
    with pytest.raises(TypeError, match="floating-point"):
        D.gather_as(jnp.zeros((8,), jnp.int32), E4M3, full)
