"""The fp8 NanoGPT step with gradients averaged in bfloat16 (`dp:bfloat16`, on a 2-device
mesh of the 8 CPU devices): its FP8 linear layers write their kernel gradients in bfloat16
(`parallel.weight_grads_in`), which gives the same step, bit for bit, and leaves nothing
but bfloat16 scalar multiplies (which XLA:GPU folds into the GEMM) between each kernel
gradient's GEMM and its all-reduce."""
import re

import jax
import numpy as np
from jax.sharding import Mesh

from experiments.nanogpt import configs as C
from experiments.nanogpt import parallel as PL
from experiments.nanogpt import step as S

GPT = dict(n_layers=1, d_model=32, n_heads=2, seq_len=8)
_LINE = re.compile(r"^\s*(?:ROOT )?([\w.\-]+) = (\w+)\[([0-9,]*)\](?:\{[0-9,]*\})? ([\w\-]+)\(([^)]*)\)")


def _producers(hlo: str) -> dict:
    """name -> (dtype, shape, opcode, operand names) of the array instructions of an HLO text."""
    out = {}
    for line in hlo.splitlines():
        m = _LINE.match(line)
        if m:
            name, dtype, shape, op, args = m.groups()
            out[name] = (dtype, shape, op, [a.strip().split(" ")[-1] for a in args.split(",") if a.strip()])
    return out


def _paths_to_gemms(hlo: str) -> list[list[tuple]]:
    """For each all-reduce whose operand comes from a dot through converts and multiplies by
    a broadcast scalar: the (opcode, dtype) chain from the all-reduce back to the dot."""
    ops = _producers(hlo)
    chains = []
    for name, (_, _, op, args) in ops.items():
        if op != "all-reduce":
            continue
        chain, cur = [], args[0]
        while cur in ops:
            dtype, _, op, args = ops[cur]
            chain.append((op, dtype))
            if op == "dot":
                chains.append(chain)
                break
            if op == "convert":
                cur = args[0]
            elif op == "multiply":
                data = [a for a in args if ops.get(a, ("", "", ""))[2] != "broadcast"]
                if len(data) != 1:
                    break
                cur = data[0]
            else:
                break
    return chains


def _run(mesh, with_bf16_weight_grads: bool):
    recipe = C.get_recipe("fp8")
    gpt = S.gpt_config(recipe, "tiny", **GPT)
    tx = S.make_optimizer(recipe, S.OptimConfig())
    state = S.init_state(recipe, gpt, tx, seed=0)
    original = PL.weight_grads_in
    if not with_bf16_weight_grads:
        PL.weight_grads_in = lambda gpt, wire: gpt
    try:
        step = PL.make_parallel_train_step(recipe, gpt, tx, mesh, "dp:bfloat16", state)
    finally:
        PL.weight_grads_in = original
    st = PL.shard_state(state, mesh, "dp")
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 256, (4, 9)).astype(np.int32) for _ in range(2)]
    lowered = step.lower(st, batches[0][:, :-1], batches[0][:, 1:])
    compiled = lowered.compile()
    losses = []
    for b in batches:
        st, loss = compiled(st, b[:, :-1], b[:, 1:])
        losses.append(float(loss))
    return losses, S.plain_state(st).params, lowered.as_text(dialect="hlo")


def test_bfloat16_weight_gradients_change_no_value_and_reach_the_wire_from_the_gemm(mesh8):
    mesh = Mesh(np.asarray(mesh8.devices).reshape(-1)[:2], ("data",))
    base_losses, base_params, base_hlo = _run(mesh, False)
    losses, params, hlo = _run(mesh, True)
    # The same step: every kernel gradient is rounded to bfloat16 for the wire either way.
    assert losses == base_losses
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(base_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Before: each FP8 kernel gradient leaves its GEMM in float32, and a float32 multiply
    # by its scale comes before the cast to the wire.
    before = _paths_to_gemms(base_hlo)
    assert len(before) == 4 * GPT["n_layers"], before  # qkv, attention out, MLP in and out
    assert all(("multiply", "f32") in c for c in before), before
    # Now: the GEMM writes bfloat16; between it and the all-reduce only multiplies in
    # bfloat16 (the GEMM's constant and one run-time scale) and a widening convert that the
    # wire's cast undoes.
    after = _paths_to_gemms(hlo)
    assert len(after) == 4 * GPT["n_layers"], after
    for chain in after:
        assert chain[-1] == ("dot", "bf16"), chain
        muls = [c for c in chain if c[0] == "multiply"]
        assert muls and all(dtype == "bf16" for _, dtype in muls), chain


def test_only_fp8_backward_layers_on_a_bfloat16_wire_write_bfloat16_weight_gradients():
    """`weight_grads_in` changes the FP8 recipes' layers on a bfloat16 wire only: a 16-bit
    weight-gradient GEMM (fp16 recipe) or another wire keeps the model as it is."""
    import jax.numpy as jnp

    fp8 = S.gpt_config(C.get_recipe("fp8"), "tiny", **GPT)
    got = PL.weight_grads_in(fp8, jnp.bfloat16)
    assert got.dense_cls.keywords["weight_grad_dtype"] == jnp.bfloat16
    assert PL.weight_grads_in(fp8, jnp.float32) is fp8
    assert PL.weight_grads_in(fp8, jnp.float8_e5m2) is fp8
    for config in ("fp16", "bf16", "fp32"):
        gpt = S.gpt_config(C.get_recipe(config), "tiny", **GPT)
        assert PL.weight_grads_in(gpt, jnp.bfloat16) is gpt, config


def test_dp_bfloat16_with_layers_stacked_by_scan_matches_one_device(mesh8):
    """`scan_layers=True` stacks each parameter over the layers with a scale per layer; the
    bfloat16 gradient all-reduce takes each gradient's values (its scale merged to the
    largest layer's, `get_data_scale(merge=True)`), so the step runs and its losses equal
    one device's up to the bfloat16 rounding of the averaged gradients."""
    mesh = Mesh(np.asarray(mesh8.devices).reshape(-1)[:2], ("data",))
    recipe = C.get_recipe("fp8")
    gpt = S.gpt_config(recipe, "tiny", **{**GPT, "n_layers": 2}, scan_layers=True)
    tx = S.make_optimizer(recipe, S.OptimConfig())
    state = S.init_state(recipe, gpt, tx, seed=0)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 256, (4, 9)).astype(np.int32) for _ in range(3)]
    losses = {}
    for mode in ("none", "dp:bfloat16"):
        step = PL.make_parallel_train_step(recipe, gpt, tx, mesh, mode, state)
        st = state if mode == "none" else PL.shard_state(state, mesh, "dp")
        losses[mode] = []
        for b in batches:
            st, loss = step(st, b[:, :-1], b[:, 1:])
            losses[mode].append(float(loss))
    np.testing.assert_allclose(losses["dp:bfloat16"], losses["none"], rtol=1e-4)
    assert losses["dp:bfloat16"] != losses["none"]  # the bfloat16 wire rounds


def test_dp_bfloat16_averages_matrices_in_bfloat16_and_vectors_with_the_loss_in_float32(mesh8):
    """On a bfloat16 wire the gradients of the matrices (kernels, embeddings) travel in
    bfloat16 and those of the vectors (biases, LayerNorm parameters) with the loss in float32,
    as plain bf16 data parallelism sends its float32 parameters' gradients: XLA:GPU then
    combines 4 kernel gradients per layer into a bucket, whose concatenation it vectorizes
    (it does up to 10 operands; a layer's 12 made it 3.6x slower), and the loss joins the
    vectors' float32 bucket instead of an all-reduce of its own."""
    mesh = Mesh(np.asarray(mesh8.devices).reshape(-1)[:2], ("data",))
    recipe = C.get_recipe("fp8")
    gpt = S.gpt_config(recipe, "tiny", **GPT)
    tx = S.make_optimizer(recipe, S.OptimConfig())
    state = S.init_state(recipe, gpt, tx, seed=0)
    step = PL.make_parallel_train_step(recipe, gpt, tx, mesh, "dp:bfloat16", state)
    tokens = np.zeros((4, 8), np.int32)
    hlo = step.lower(PL.shard_state(state, mesh, "dp"), tokens, tokens).as_text(dialect="hlo")
    ops = _producers(hlo)
    wire = [ops[args[0]][:2] for _, (_, _, op, args) in ops.items() if op == "all-reduce"]
    matrices = [dtype for dtype, shape in wire if shape.count(",") >= 1]
    vectors = [dtype for dtype, shape in wire if shape.count(",") == 0]
    assert matrices == ["bf16"] * (4 * GPT["n_layers"] + 2), wire  # 4 kernels a layer, 2 embeddings
    assert vectors and set(vectors) == {"f32"}, wire  # biases, LayerNorm, the loss
    assert len(vectors) == len(jax.tree_util.tree_leaves(S.plain_state(state).params)) - len(matrices) + 1
