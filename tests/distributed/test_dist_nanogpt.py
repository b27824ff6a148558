"""NanoGPT on 8 CPU devices: the scalified data-parallel and FSDP steps of
`experiments/nanogpt/parallel.py` (jit with shardings) equal the single-device step
(float32 recipe), keep their shardings, and move the expected collectives."""
import jax
import numpy as np
import pytest

from scalify import ScaledArray
from dist_testing import nanogpt_runs, plain_params, rel_err
from experiments.nanogpt import parallel as PL
from experiments.nanogpt import train as T

STEPS = 2
EXPLICIT = "fsdp:float32:float32"  # the float32 recipe's kernel format; gradients in float32
PACKED = "fsdp+packed"  # fsdp with the state's float32 scalars in one vector (step.ScalePacking)


def test_dp_and_fsdp_steps(mesh8):
    """One test (the compiles dominate; pytest-xdist would repeat a shared fixture per
    worker): values, shardings and collectives of the dp and fsdp steps, and of the
    explicit FSDP step (`fsdp:WIRE:GRAD_WIRE`: sharded state, per-device shard_map pass)."""
    # Reference: the single-device step without scalify, equal to the scalified one in
    # float32 (tests/e2e) and three times faster to compile on CPU.
    runs = nanogpt_runs(mesh8, ("plain", "dp", "fsdp", EXPLICIT, PACKED), STEPS)
    _check_equal_to_single_device(runs)
    _check_shardings(runs)
    _check_collectives(runs)
    _check_packed(runs)


def _check_equal_to_single_device(runs):
    ref = runs["plain"]
    for mode in ("dp", "fsdp", EXPLICIT, PACKED):
        got = runs[mode]
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-6, err_msg=mode)
        for a, b in zip(plain_params(got["state"]), plain_params(ref["state"])):
            assert rel_err(a, b) <= 1e-5, mode  # float32 sums in another order
        assert int(got["state"].step) == STEPS


def _check_shardings(runs):
    dp, fsdp = runs["dp"]["state"], runs["fsdp"]["state"]
    emb = dp.params["token_embed"]["embedding"]  # (256, 32)
    assert isinstance(emb, ScaledArray) and emb.data.sharding.is_fully_replicated
    emb = fsdp.params["token_embed"]["embedding"]
    assert "data" in tuple(emb.data.sharding.spec)
    assert emb.data.addressable_shards[0].data.shape == (32, 32)
    assert emb.scale.sharding.is_fully_replicated
    # Adam moments are sharded like their parameters.
    moments = [x for x in jax.tree_util.tree_leaves(fsdp.opt_state, is_leaf=lambda x: isinstance(x, ScaledArray))
               if isinstance(x, ScaledArray) and x.shape == (256, 32)]
    assert len(moments) == 2 and all("data" in tuple(m.data.sharding.spec) for m in moments)
    explicit = runs[EXPLICIT]["state"]  # the same shardings as fsdp, step after step
    for a, b in zip(jax.tree_util.tree_leaves(explicit), jax.tree_util.tree_leaves(fsdp)):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


def _check_collectives(runs):
    n_params = sum(int(np.prod(p.shape)) for p in plain_params(runs["plain"]["state"]))
    assert runs["plain"]["stats"]["count"] == 0
    dp = runs["dp"]["stats"]
    assert dp["by_op"].get("all-reduce", 0) >= 4 * n_params  # float32 gradients
    assert dp["wire_bytes"] >= 2 * 7 / 8 * 4 * n_params  # ring all-reduce over 8 devices
    assert runs["fsdp"]["stats"]["by_op"].get("all-gather", 0) > 0  # parameters gathered where used
    # explicit: kernels gathered; each sharded parameter's float32 gradient reduce-scattered
    # to its shard (the small replicated ones, the loss and the optimizer's norms all-reduced)
    explicit = runs[EXPLICIT]["stats"]
    assert explicit["by_op"].get("all-gather", 0) > 0
    assert explicit["by_op"].get("reduce-scatter", 0) >= 0.9 * 4 * n_params
    assert explicit["by_op"].get("all-reduce", 0) <= 0.1 * 4 * n_params


def _check_packed(runs):
    """The packed fsdp step: the same values as fsdp (above), the parameters still sharded,
    the scales in one replicated vector, a quarter fewer step arguments."""
    rest, scales = runs[PACKED]["packed"]
    assert scales.ndim == 1 and scales.sharding.is_fully_replicated
    assert runs[PACKED]["arguments"] == runs["fsdp"]["arguments"] - scales.shape[0] + 1
    assert scales.shape[0] > runs["fsdp"]["arguments"] / 4  # one float32 scale per tensor
    emb = runs[PACKED]["state"].params["token_embed"]["embedding"]
    assert "data" in tuple(emb.data.sharding.spec)


def test_parse_mesh_and_cli_option():
    assert PL.parse_mesh("none") == PL.ParallelConfig()
    assert PL.parse_mesh("fsdp").mode == "fsdp"
    c = PL.parse_mesh("dp:e5m2:pre:all_to_all")
    assert (c.mode, c.wire, c.scaling, c.method, c.name) == ("dp", "e5m2", "pre", "all_to_all",
                                                             "dp:e5m2:pre:all_to_all")
    assert PL.parse_mesh("dp:float16").name == "dp:float16"
    c = PL.parse_mesh("fsdp:e4m3:bfloat16")
    assert (c.mode, c.wire, c.grad_wire, c.name) == ("fsdp", "e4m3", "bfloat16", "fsdp:e4m3:bfloat16")
    for bad in ("tp", "none:e5m2", "fsdp:e4m3:pre", "fsdp:e4m3:bfloat16:auto", "fsdp:int8", "dp:int8", "dp:e5m2:later", "dp:e5m2:auto:ring"):
        with pytest.raises(ValueError, match="--mesh"):
            PL.parse_mesh(bad)
    _, args = T.parse_args(["--mesh", "dp:e5m2"])
    assert args.mesh == "dp:e5m2"
    assert T.parse_args([])[1].mesh == "none"
