"""Collective budget of the NanoGPT step on 8 CPU devices: the scalified fp8 step's
collectives (count, and ring bytes per device, from the compiled HLO) against the plain
bf16 step (`experiments/nanogpt/collective_budget.py`; one layer, d_model 32, 8 tokens per
device: compile-only).

Goals: the count and the bytes within 1.1x of the plain step's (below it with FP8 on the
wire), FSDP kernels all-gathered in FP8 at <= 0.55x the bytes of bf16's gather. Where a
goal is not met the test asserts today's value as a regression bound and says so.
XLA:CPU combines collectives differently from XLA:GPU, has no reduce-scatter (FSDP
gradients are all-reduced and sliced) and widens FP8/bfloat16 collectives: these are the
counts of the CPU program (see `results/cpu/collectives`).

Not here (each scalified compile takes ~15 s on one core): `fsdp` (XLA's gathers) and the
`dp:WIRE` modes with method psum on an 8- or 16-bit float wire (3 collectives: the packed
pmax of scales and amaxes, the gradients, the float32 loss), measured in the results
above; the bytes of the psum method are checked in `test_dist_api.py`.
"""
import pytest

from experiments.nanogpt.collective_budget import measure

GPT = dict(n_layers=1, d_model=32, n_heads=2, seq_len=8)
_PLAIN: dict = {}


def _measure(config, mode, mesh):
    return measure(config, mode, mesh, "tiny", **GPT)


def _plain(mode, mesh):
    """The plain bf16 step of `mode` (compiled once per module)."""
    if mode not in _PLAIN:
        _PLAIN[mode] = _measure("bf16", mode, mesh)
    return _PLAIN[mode]


def test_dp(mesh8):
    """XLA's all-reduces (GSPMD). Bytes: goal met (0.86x: float32 gradients where bf16's
    all-reduce is float32 on CPU too, and the embedding's two gradients are one). Count:
    goal (1.1x) NOT met, bound 30 (plain: 1): the dynamic rescales of the LayerNorm input
    gradients, the drift guards (input guard, powers, float16 casts), the float16 matmul
    outputs' max-abs (`ScalifyConfig.narrow_dot_rescale`) and the placement of float16
    products of two tensors reduce statistics over the sharded batch (27 scalar
    all-reduces) in the middle of the step, so XLA cannot
    combine the gradient all-reduces on either side of them into one. The bound is today's
    measured value. `dp:e5m2:auto:all_to_all` below has 2."""
    plain, fp8 = _plain("dp", mesh8), _measure("fp8", "dp", mesh8)
    assert plain["count"] == 1
    assert fp8["wire_bytes"] <= 1.1 * plain["wire_bytes"]
    assert fp8["count"] <= 30 and fp8["small"] <= 27  # regression bound (today's), goal 1


def test_dp_bfloat16_wire_has_the_collectives_of_the_plain_step(mesh8):
    """`dp:bfloat16`: the step per device in a shard_map (every dynamic scale taken on the
    device's own batch: no collective), the gradients averaged as their values in bfloat16
    with no common-scale pmax. Count and bytes: goals met, the plain step's count (XLA:CPU
    combines the gradients and the float32 loss into 1 all-reduce, as it does the plain
    step's gradients) and no more bytes (0.72x: XLA:CPU widens bfloat16 all-reduces to
    float32, and the embedding's two gradients are one)."""
    plain, fp8 = _plain("dp", mesh8), _measure("fp8", "dp:bfloat16", mesh8)
    assert fp8["count"] <= plain["count"] and fp8["small"] == 0
    assert fp8["wire_bytes"] <= 1.1 * plain["wire_bytes"]


def test_dp_fp8_wire_all_to_all(mesh8):
    """`dp:e5m2:auto:all_to_all`: every gradient and the loss in one packed byte buffer, the
    scales inside it: one all-to-all and one all-gather per step (a ring all-reduce is
    exactly these two), no scalar collective. Bytes: goal met, 0.19x the plain bf16
    step's (1 byte per gradient element plus 4 per leaf and device). Count: 2 for the
    plain step's 1 (goal not met; bound 2)."""
    plain, fp8 = _plain("dp", mesh8), _measure("fp8", "dp:e5m2:auto:all_to_all", mesh8)
    kinds = {k: v["count"] for k, v in fp8["kinds"].items() if v["count"]}
    assert kinds == {"all-to-all": 1, "all-gather": 1} and fp8["small"] == 0
    assert set(fp8["by_dtype"]) == {"u8"}
    assert fp8["wire_bytes"] <= 0.25 * plain["wire_bytes"]


def test_fsdp_kernels_gathered_in_fp8(mesh8):
    """`fsdp:e4m3`: the kernels are all-gathered as E4M3 bytes (the cast the FP8 matmuls
    make anyway), against bf16's `fsdp:bfloat16` (kernels gathered in bfloat16, as XLA:GPU
    gathers them in `fsdp`; XLA:CPU's own `fsdp` gathers float32). Weight all-gather bytes:
    goal (<= 0.55x) met, 0.5x for the kernels. The other gathers are XLA's plan for the tied
    output head (it gathers the batch-sharded activations rather than the embedding: for
    fp8 the head input in float16 and in bfloat16, for bf16 in bfloat16; XLA:CPU widens
    the bfloat16 gathers to float32): no more bytes than bf16's
    (0.75x); 0.60x in all on CPU. All bytes: goal met (0.87x). Count: goal
    NOT met, bound 45 (plain 17): up to 31 scalar all-reduces (the amaxes of the FP16 master
    weights' rescale on sharded tensors, of the LayerNorm gradient rescales, of the float16
    matmul outputs and products and of the drift guards on sharded values, float16 casts
    included), which
    XLA:CPU combines only partly. The bound is today's measured value."""
    plain, fp8 = _plain("fsdp:kernel", mesh8), _measure("fp8", "fsdp:kernel", mesh8)
    assert (plain["mesh"], fp8["mesh"]) == ("fsdp:bfloat16", "fsdp:e4m3")
    fp8_gather, bf16_gather = fp8["kinds"]["all-gather"], plain["kinds"]["all-gather"]
    fp8_kernels, bf16_kernels = fp8_gather["wire_by_dtype"]["u8"], bf16_gather["wire_by_dtype"]["u16"]
    assert fp8_kernels <= 0.55 * bf16_kernels
    assert fp8_gather["wire_bytes"] - fp8_kernels <= bf16_gather["wire_bytes"] - bf16_kernels
    assert fp8["wire_bytes"] <= 1.1 * plain["wire_bytes"]
    assert fp8["count"] <= 45 and fp8["small"] <= 31  # regression bound (today's), goal 19


def test_fsdp_explicit_reduce_scatters_the_gradients(mesh8):
    """`fsdp:e4m3:bfloat16`: the state sharded and the kernels gathered in E4M3 as in
    `fsdp:e4m3`, the forward and backward passes per device in a shard_map (every dynamic
    scale on the device's own batch) and each sharded parameter's gradient reduce-scattered
    to its shard as bfloat16 values (`scaled_psum_scatter`). All bytes: goal met, 0.65x
    bf16's `fsdp:bfloat16` (XLA:CPU all-reduces plain FSDP gradients and slices them; it
    widens bfloat16 collectives to float32 in both). Kernel gathers 0.5x bf16's (goal met).
    Count: goal (1.1x) met, 18 for 17: one reduce-scatter per sharded gradient (XLA:CPU
    does not combine reduce-scatters). Of them 5 scalar all-reduces against bf16's 2: the
    optimizer's global norm sums the squares of the sharded gradients, which XLA:CPU
    combines into fewer all-reduces for the plain step (bound 5, today's value)."""
    plain, fp8 = _plain("fsdp:kernel", mesh8), _measure("fp8", "fsdp:e4m3:bfloat16", mesh8)
    assert fp8["count"] <= 1.1 * plain["count"]
    assert fp8["small"] <= 5  # regression bound (today's), goal: plain's
    assert fp8["kinds"]["reduce-scatter"]["count"] >= 1
    fp8_kernels = fp8["kinds"]["all-gather"]["wire_by_dtype"]["u8"]
    assert fp8_kernels <= 0.55 * plain["kinds"]["all-gather"]["wire_by_dtype"]["u16"]
    # goal: below plain with a 16-bit wire; 0.65x today (an all-reduce of whole gradients: 1.10x)
    assert fp8["wire_bytes"] <= 0.75 * plain["wire_bytes"]


def test_fsdp_wire_must_be_the_kernel_format(mesh8):
    """fsdp:WIRE gathers kernels in WIRE only where the matmuls cast them to WIRE anyway."""
    with pytest.raises(ValueError, match="casts kernels to bfloat16.*fsdp:bfloat16"):
        _measure("bf16", "fsdp:e4m3", mesh8)
