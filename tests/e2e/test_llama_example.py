"""experiments/llama end to end on CPU: the `tiny` preset trained for 20 steps on the
embedded pydoc corpus (byte tokenizer) through ``python -m experiments.llama.train`` in
the plain ``bf16`` step and the ``fp32`` and ``fp8`` recipes of `scalify.recipes` (the
FP16 recipes on a Llama: tests/recipes); the FP32 recipe against a plain float32 step; resume; the presets'
parameter counts.

All runs share one initialisation (seed 0) and one batch sequence (batches are a function
of (seed, step)), so their losses differ only by the arithmetic of their formats.
"""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.llama import model as M
from experiments.llama import train as T
from experiments.nanogpt import checkpoint as ckpt
from experiments.nanogpt import metrics as MX
from experiments.nanogpt import step as S
from experiments.nanogpt.data import load_dataset

STEPS, BATCH, LR, WARMUP = 20, 8, 3e-3, 2
CONFIGS = ("bf16", "fp32", "fp8")


def _argv(out, cache, *extra):
    return ["--model", "tiny", "--steps", str(STEPS), "--batch-size", str(BATCH), "--lr", str(LR), "--warmup",
            str(WARMUP), "--eval-every", str(STEPS), "--eval-batches", "2", "--log-every", "1", "--no-progress",
            "--out", str(out), "--cache-dir", str(cache), *extra]


def _train_losses(run_dir) -> list[float]:
    return [r["loss"] for r in MX.read_metrics(run_dir) if r["split"] == "train"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, default_matmul_precision):
    """(OUT, cache dir, {config: summary}) of one CLI call training every config."""
    out, cache = tmp_path_factory.mktemp("llama"), tmp_path_factory.mktemp("cache")
    summaries = T.main(_argv(out, cache, "--config", ",".join(CONFIGS)))
    return out, cache, {s["config"]: s for s in summaries}


def test_param_count_matches_the_preset_table():
    table = {"tiny": 131_392, "small": 33_563_136, "1b": 1_498_482_688, "8b-shape": 1_923_125_248}
    for name, cfg in M.PRESETS.items():
        variables = jax.eval_shape(M.Llama(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
        assert M.param_count(variables["params"]) == M.expected_param_count(cfg) == table[name], name
    # The published sizes: Llama 3 8B (8.03B) from the 8b-shape width at its 32 layers, and
    # Llama 3.2 1B (1.24B) from 1b with its head tied to the embedding.
    assert M.expected_param_count(M.get_config("8b-shape", n_layers=32)) == 8_030_261_248
    cfg = M.PRESETS["1b"]
    assert M.expected_param_count(cfg) - cfg.vocab_size * cfg.d_model == 1_235_814_400


def test_every_config_learns_and_writes_its_files(runs):
    out, _, summaries = runs
    for config in CONFIGS:
        losses = _train_losses(out / config)
        assert len(losses) == STEPS and all(math.isfinite(l) for l in losses), (config, losses)
        # ln(256) = 5.55 at init; 20 steps learn the byte statistics and more.
        assert losses[0] > 5.3 and max(losses[-3:]) < losses[0] - 1.0, (config, losses)
        s = summaries[config]
        assert not s["diverged"] and s["steps"] == STEPS and s["parameters"] == 131_392
        assert s["final_valid_loss"] < losses[0] - 1.0
        assert json.loads((out / config / "summary.json").read_text())["config"] == config
        assert (out / config / "metrics.csv").read_text().splitlines()[0].split(",") == list(MX.CSV_FIELDS)
        assert ckpt.exists(out / config / "checkpoint")
    assert summaries["fp8"]["recipe"]["fp8"] and summaries["fp8"]["compute_dtype"] == "float16"
    assert summaries["fp32"]["model_dtype"] == "float32" and summaries["bf16"]["recipe"] is None
    assert (out / "loss.png").stat().st_size > 1000
    assert all(f"| {c} |" in (out / "summary.md").read_text() for c in CONFIGS)


def test_fp32_recipe_equals_the_plain_float32_step(runs):
    """The plain step of the float32 model, with the CLI's optimizer and batches, against
    the ``fp32`` run. The recipe's power-of-two scales multiply exactly in float32, so the
    values differ only where scalify's rules order or fuse the float32 arithmetic
    differently (normalisation, softmax, reductions): float32 rounding (2^-24 relative) of
    a few ulps per op, which 20 AdamW steps carry forward; 1e-5, about a hundred ulps of the
    loss and of the weights' range, bounds it while a single mis-scaled op (a factor of
    two, or a 16-bit cast) would exceed it by orders of magnitude."""
    out, cache, _ = runs
    model = M.Llama(M.PRESETS["tiny"], dtype=jnp.float32)
    opt = S.OptimConfig(lr=LR, warmup_steps=WARMUP, total_steps=STEPS)
    plain = T.plain_train_step(T.make_loss_fn(model), S.adamw(opt))
    state = plain.init(T.init_params(model, 0))
    batches = load_dataset("pydoc", tokenizer="byte", cache_dir=cache).train_batches(BATCH, model.cfg.seq_len)
    losses = []
    for _ in range(STEPS):
        state, metrics = plain.step(state, next(batches))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(_train_losses(out / "fp32"), losses, rtol=1e-5)

    recipe = T.make_train_step("fp32", T.make_loss_fn(model), S.adamw(opt))
    example = (np.zeros((BATCH, model.cfg.seq_len), np.int32),) * 2  # sizes the delayed statistics
    # the restore template: the initial state with its delayed statistics sized for the
    # batch (no record yet): the shapes, dtypes and placement, without measuring them
    template = recipe.step.sized(recipe.init(T.init_params(model, 0)), example)
    restored, meta = ckpt.restore(out / "fp32" / "checkpoint", template)
    assert meta["step"] == STEPS
    ours, theirs = recipe.params(restored), state.params
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(b))))


def test_low_precision_recipe_stays_within_one_percent_of_fp32(runs):
    """Same batches, same initial weights: the gap to fp32 is the accumulated rounding of
    float16 activations and E4M3/E5M2 matmul operands. 1% of the final loss
    is a tenth of what fp32 still gains over its last ten steps (checked), so a recipe that
    learns visibly slower, or stalls, fails."""
    out, _, summaries = runs
    ref = _train_losses(out / "fp32")
    tol = 0.01 * ref[-1]
    assert ref[STEPS // 2 - 1] - ref[-1] > 10 * tol, ref
    for config in ("fp8",):
        losses = _train_losses(out / config)
        assert abs(np.mean(losses[-5:]) - np.mean(ref[-5:])) < tol, (config, losses, ref)
        gap = summaries[config]["final_valid_loss"] - summaries["fp32"]["final_valid_loss"]
        assert abs(gap) < tol, (config, gap)


def test_resume_gives_the_uninterrupted_loss_sequence(runs, tmp_path):
    """fp8 (scaled FP16 master weights in the checkpoint) stopped at step 12, then resumed:
    the 20 losses are those of the uninterrupted run, bit for bit."""
    out, cache, _ = runs
    T.main(_argv(tmp_path, cache, "--config", "fp8", "--stop-at", "12", "--no-plots"))
    assert len(_train_losses(tmp_path / "fp8")) == 12
    T.main(_argv(tmp_path, cache, "--config", "fp8", "--resume", "--no-plots"))
    assert _train_losses(tmp_path / "fp8") == _train_losses(out / "fp8")


def test_head_configs_put_the_head_in_the_recipe():
    """``NAME-head``: recipe NAME with ``keep=()``, so that ``lm_head`` computes in the
    recipe's formats; the plain names keep the recipes' default head; others are refused."""
    head, plain = T.recipe_of("fp8-head"), T.recipe_of("fp8")
    assert head.keep == () and not head.keeps("Llama_0/lm_head") and head.name == "fp8-head"
    assert plain.keeps("Llama_0/lm_head") and head.replace(name="fp8", keep=plain.keep) == plain
    assert T.recipe_of("fp8-fp16-state-head").state_dtype == plain.replace(state_dtype="float16").state_dtype
    for bad in ("fp9", "fp9-head", "bf16-head", "fp8-fp8act-x", "bf16-fp8act"):
        with pytest.raises(ValueError, match="Unknown config"):
            T.recipe_of(bad)


def test_fp8act_configs_save_the_activations_in_fp8():
    """``NAME-fp8act``: recipe NAME with ``fp8_saved_activations``; the suffixes combine in
    either order."""
    saved = T.recipe_of("fp8-fp16-state-fp8act")
    assert saved.fp8_saved_activations and saved.name == "fp8-fp16-state-fp8act"
    assert saved.replace(name="fp8-fp16-state", fp8_saved_activations=False) == T.recipe_of("fp8-fp16-state")
    for both in ("fp8-fp8act-head", "fp8-head-fp8act"):
        r = T.recipe_of(both)
        assert r.fp8_saved_activations and r.keep == ()


def test_fp16state_and_fp8w_suffixes():
    """``NAME-fp16state``: FP16 Adam moments (``fp8-bf16-fp16state`` is #4 with bfloat16
    activations); ``NAME-fp8w``: ``recompute_fp8_weights``; they combine with the others."""
    r = T.recipe_of("fp8-bf16-fp16state")
    assert r.replace(name="fp8-bf16", state_dtype="float32") == T.recipe_of("fp8-bf16")
    assert r.state_dtype == T.recipe_of("fp8-fp16-state").state_dtype
    w = T.recipe_of("fp8-bf16-fp16state-fp8w")
    assert w.recompute_fp8_weights and w.replace(name=r.name, recompute_fp8_weights=False) == r
    for bad in ("bf16-fp16state", "fp8-fp16state-x"):
        with pytest.raises(ValueError, match="Unknown config"):
            T.recipe_of(bad)
