"""CPU smoke tests of experiments/nanogpt/fp8_inference.py and activation_memory.py (tiny model)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.nanogpt import activation_memory as AM
from experiments.nanogpt import checkpoint as ckpt
from experiments.nanogpt import configs as C
from experiments.nanogpt import fp8_inference as FI
from experiments.nanogpt import step as S
from experiments.nanogpt.model import init_params

SMALL = ["--model", "tiny", "--gpt", "n_layers=1,d_model=32,n_heads=2", "--seq-len", "32"]


def test_fp8_inference_cli_trains_evaluates_and_sweeps(tmp_path):
    doc = FI.main([*SMALL, "--train-steps", "40", "--batch-size", "8", "--eval-batches", "2",
                   "--modes", "fp32,fp8", "--biases=-14,0,8", "--out", str(tmp_path)])
    modes = {r["mode"]: r for r in doc["modes"]}
    assert set(modes) == {"fp32", "fp8"} and modes["fp32"]["rel_to_fp32"] == 0
    assert abs(modes["fp8"]["rel_to_fp32"]) < FI.TOLERANCE  # the recipe: within 0.5%
    assert np.isclose(modes["fp8"]["perplexity"], np.exp(modes["fp8"]["loss"]))
    sweep = {r["bias"]: r["rel_to_fp32"] for r in doc["constant_bias_sweep"]}
    assert abs(sweep[-14]) > FI.TOLERANCE  # every weight flushes to zero: broken
    assert min(abs(v) for v in sweep.values()) < FI.TOLERANCE  # a working window exists
    assert all(isinstance(b, int) for b in doc["weight_biases"].values())
    saved = json.loads((tmp_path / "fp8_inference.json").read_text())
    assert saved["fp32_loss"] == doc["fp32_loss"]
    md = (tmp_path / "fp8_inference.md").read_text()
    assert "| fp8 |" in md and "## Constant scaling bias" in md


def test_fp8_weights_are_stored_in_fp8():
    params = {"mlp": {"fc": {"kernel": jnp.full((4, 8), 0.5), "bias": jnp.zeros(8)}},
              "token_embed": {"embedding": jnp.ones((16, 4))}}
    keep, fp8 = FI.quantize_weights(params)
    assert "kernel" not in keep["mlp"]["fc"] and "bias" in keep["mlp"]["fc"]
    assert fp8["mlp"]["fc"]["kernel"].dtype == jnp.float8_e4m3fn
    # amax 0.5: bias floor(log2(448 / 0.5)) = 9, scale 2^-9; 0.5 * 2^9 = 256 is exact in E4M3.
    assert float(fp8["mlp"]["fc"]["kernel_scale"]) == 2.0**-9
    assert float(fp8["mlp"]["fc"]["kernel"][0, 0]) == 256
    assert "token_embed" not in fp8 and keep["token_embed"]["embedding"].shape == (16, 4)
    _, const = FI.quantize_weights(params, bias=4)
    assert float(const["mlp"]["fc"]["input_scale"]) == 2.0**-4
    assert float(const["mlp"]["fc"]["kernel"][0, 0]) == 8


def test_load_params_of_a_scalify_checkpoint(tmp_path):
    from scalify.optim import scaled_params

    recipe = C.get_recipe("fp8")  # FP16 scaled master weights: ScaledArray leaves
    gpt = S.gpt_config(recipe, "tiny", n_layers=1, d_model=32, n_heads=2, seq_len=16)
    params = scaled_params(init_params(gpt, jax.random.PRNGKey(0)), jnp.float16)
    state = S.TrainState(params, (), {}, jnp.zeros((), jnp.int32))  # no optimizer state needed
    ckpt.save(tmp_path, state, {"config": "fp8", "model": "tiny"})
    params, meta = FI.load_params(tmp_path, FI.param_template(recipe, gpt))
    assert meta["config"] == "fp8"
    got, want = FI.float32_params(params), FI.float32_params(state.params)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="has no leaf|shape"):
        other = S.gpt_config(recipe, "tiny", n_layers=2, d_model=32, n_heads=2, seq_len=16)
        FI.load_params(tmp_path, FI.param_template(recipe, other))


def test_activation_memory_smoke_and_accounting(tmp_path):
    # One measured run (a CPU compile of the step costs seconds); the accounting of both.
    doc = AM.main([*SMALL[:4], "--seq-len", "16", "--batch-size", "2", "--config", "bf16",
                   "--policies", "coat", "--steps", "1", "--warmup", "0", "--in-process",
                   "--out", str(tmp_path)])
    (run,) = doc["runs"]
    assert run["policy"] == "coat" and run["loss_finite"] and run["step_ms"] > 0
    assert run["xla_memory"]["temp_size_in_bytes"] > 0 and run["residual_bytes"] > 0
    doc = AM.main([*SMALL[:4], "--seq-len", "16", "--batch-size", "2", "--config", "bf16",
                   "--policies", "none,coat", "--residuals-only", "--out", str(tmp_path)])
    acc = doc["accounting"]
    assert acc["coat"]["model_bytes"] == run["residual_bytes"] < acc["none"]["model_bytes"]
    for p in ("none", "coat"):  # the layers traced alone add up to the block traced in the model
        layers = acc[p]["layers"]
        assert np.isclose(sum(layers.values()) + layers["ln"], acc[p]["per_block_U"], rtol=1e-6)
    assert acc["coat"]["per_block_U"] < 0.5 * acc["none"]["per_block_U"]
    assert acc["coat"]["layers"]["activation"] < acc["none"]["layers"]["activation"]
    assert (tmp_path / "runs" / "bf16+coat.json").exists()
    md = (tmp_path / "activation_memory.md").read_text()
    assert "| bf16 | coat |" in md and "sum per block" in md
    # --report-only rebuilds the tables from the run files (several runs, one table).
    again = AM.main([*SMALL[:4], "--report-only", "--config", "bf16", "--policies", "none,coat",
                     "--out", str(tmp_path)])
    assert len(again["runs"]) == 1 and again["accounting"] == acc
