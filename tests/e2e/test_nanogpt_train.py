"""NanoGPT example end to end on CPU: every precision config trains a tiny model for a few
steps on the WikiText sample in tests/data/wikitext (train on the test split, evaluate on
the validation split), writes its files, resumes to the identical loss sequence; the
benchmark runs.

Every config's step is jitted: with the suite's XLA:CPU flags (tests/conftest.py) the
scalified `tiny` step compiles in a few seconds, less than op-by-op dispatch of its eight
steps took.
"""
import dataclasses
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalify
from experiments.nanogpt import checkpoint as ckpt
from experiments.nanogpt import cli
from experiments.nanogpt import configs as C
from experiments.nanogpt import metrics as M
from experiments.nanogpt import train as T

# A small WikiText-103 cut shipped with the tests (see its README.md).
WIKITEXT_DIR = Path(__file__).resolve().parents[1] / "data" / "wikitext"

TINY = dict(n_layers=1, d_model=32, n_heads=2)
STEPS = 8


def _args(config: str, out: Path, cache: Path, **kw) -> T.TrainArgs:
    base = T.TrainArgs(
        config=config, model="tiny", data=str(WIKITEXT_DIR), steps=STEPS, batch_size=8, seq_len=32,
        lr=3e-3, warmup=1, eval_every=STEPS, eval_batches=2, log_every=1, out=str(out), seed=0,
        jit=True, model_overrides=dict(TINY), progress=False, cache_dir=str(cache),
    )
    return dataclasses.replace(base, **kw)


def _train_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in M.read_metrics(run_dir) if r["split"] == "train"]


def _check_run(config: str, out: Path, summary: dict) -> None:
    run = out / config
    losses = [l for _, l in _train_losses(run)]
    assert len(losses) == STEPS and all(math.isfinite(l) for l in losses), losses
    # ln(256) = 5.55 at init; a tiny byte-level model learns the byte frequencies at once.
    assert losses[0] > 5.3, losses
    assert max(losses[-2:]) < losses[0] - 0.4, losses
    assert summary["final_valid_loss"] < 5.2, summary["final_valid_loss"]
    assert not summary["diverged"] and summary["steps"] == STEPS
    assert "wiki.test.tokens" in summary["data"] and summary["recipe"]["name"] == config

    for name in ("metrics.jsonl", "metrics.csv", "summary.json"):
        assert (run / name).is_file(), name
    assert json.loads((run / "summary.json").read_text())["config"] == config
    csv_lines = (run / "metrics.csv").read_text().splitlines()
    assert csv_lines[0].split(",") == list(M.CSV_FIELDS) and len(csv_lines) == 1 + STEPS + 1
    assert (out / "loss.png").stat().st_size > 1000
    assert (run / "checkpoint" / "state.npz").is_file()
    if C.RECIPES[config].scalify:
        scales = json.loads((run / "scales.json").read_text())
        assert set(scales) == {"0", str(STEPS)}
        for kind in ("weights", "activations", "gradients"):
            assert scales[str(STEPS)][kind], kind
        # an optimizer run on unscaled float32 values keeps a plain state (no scales) unless
        # the state is stored in low precision (#4: scaled FP16 moments)
        recipe = C.RECIPES[config]
        scaled_state = recipe.state is not None or not recipe.unscaled_optimizer
        assert bool(scales[str(STEPS)]["optimizer_state"]) == scaled_state
        assert (run / "scales.png").stat().st_size > 1000


@pytest.mark.parametrize("group", [("fp32", "fp16", "fp16-master"), ("fp8", "fp8-fp16-state")],
                         ids=["fp32-fp16-fp16master", "fp8-fp8state"])
def test_paper_configs_learn_write_files_and_resume(group, tmp_path):
    """The paper's configs, a few per test (programs a config shares with another, such as
    the evaluation step, compile once)."""
    out, cache = tmp_path / "runs", tmp_path / "cache"
    failures = {}
    for config in group:
        try:
            _check_run(config, out, T.train(_args(config, out, cache)))
        except AssertionError as e:
            failures[config] = str(e)
    assert not failures, failures
    assert len(list(out.glob("*/summary.json"))) == len(group)
    table = M.summary_table(out)
    assert all(f"| {c} | {C.RECIPES[c].paper} |" in table for c in group) and (out / "summary.md").is_file()
    if "fp32" in group:
        assert "+0.00%" in table

    if "fp8-fp16-state" in group:
        # Resume (scaled FP16 master weights and optimizer state): stop half-way, restart
        # from the checkpoint: the same loss sequence as the uninterrupted run.
        config, out2 = "fp8-fp16-state", tmp_path / "resumed"
        kw = dict(scales=False, plots=False, eval_every=STEPS // 2)
        T.train(_args(config, out2, cache, stop_at=STEPS // 2, **kw))
        assert len(_train_losses(out2 / config)) == STEPS // 2
        T.train(_args(config, out2, cache, resume=True, **kw))
        resumed, uninterrupted = _train_losses(out2 / config), _train_losses(out / config)
        if jax.default_backend() == "cpu":
            assert resumed == uninterrupted  # XLA:CPU steps are bit-reproducible
        else:
            # backend: XLA:GPU's step is not bit-reproducible from run to run (reductions
            # with atomics pick their own order): the first half of the two runs, before
            # any checkpoint, already differs at ~3e-6 relative on an H100.
            np.testing.assert_allclose(resumed, uninterrupted, rtol=1e-4)


@pytest.mark.parametrize("config", C.BASELINES)
def test_baselines_learn_and_write_files(config, tmp_path):
    out = tmp_path / "runs"
    _check_run(config, out, T.train(_args(config, out, tmp_path / "cache")))


def test_checkpoint_roundtrip_is_bit_exact(tmp_path):
    rng = np.random.default_rng(0)
    state = {
        "w8": scalify.ScaledArray(jnp.asarray(rng.normal(size=(4, 3)), jnp.float8_e4m3fn), jnp.float32(2.0**-7)),
        "w16": scalify.ScaledArray(jnp.asarray(rng.normal(size=(5,)), jnp.float16), jnp.float32(2.0**9)),
        "bf": jnp.asarray(rng.normal(size=(2, 2)), jnp.bfloat16),
        "step": jnp.int32(7),
    }
    ckpt.save(tmp_path / "ck", state, {"step": 7})
    zeros = {k: (scalify.ScaledArray(jnp.zeros_like(v.data), jnp.float32(1)) if isinstance(v, scalify.ScaledArray)
                 else jnp.zeros_like(v)) for k, v in state.items()}
    restored, meta = ckpt.restore(tmp_path / "ck", zeros)
    assert meta == {"step": 7}
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a).reshape(-1).view(np.uint8), np.asarray(b).reshape(-1).view(np.uint8))
    with pytest.raises(ValueError, match="different config"):
        ckpt.restore(tmp_path / "ck", {"other": jnp.zeros(3)})


def test_checkpoint_restore_keeps_the_template_placement(tmp_path):
    """Restored leaves take the template's sharding: a jitted step lowers the restored state
    to the same program as the fresh one (a resumed run compiles no step of its own)."""
    device = jax.devices()[0]
    template = {"w": jax.device_put(jnp.arange(6.0).reshape(2, 3), device), "step": jax.device_put(jnp.int32(3), device)}
    ckpt.save(tmp_path / "ck", template, {"step": 3})
    restored, _ = ckpt.restore(tmp_path / "ck", template)
    for a, b in zip(jax.tree_util.tree_leaves(template), jax.tree_util.tree_leaves(restored)):
        assert b.committed and b.sharding == a.sharding and np.array_equal(a, b)
    step = jax.jit(lambda s: {"w": s["w"] * 2, "step": s["step"] + 1})
    assert step.lower(restored).as_text() == step.lower(template).as_text()


def test_cli_parsing_and_config_groups():
    names, args = T.parse_args(["--config", "paper,bf16", "--gpt", "n_layers=1,d_model=32",
                                "--set", "head_matmul=true", "--no-jit", "--steps", "5"])
    assert names == list(C.PAPER_CONFIGS) + ["bf16"]
    assert args.model_overrides == {"n_layers": 1, "d_model": 32}
    assert args.recipe_overrides == {"head_matmul": True} and not args.jit and args.steps == 5
    assert cli.expand_configs("all") == list(C.ALL_CONFIGS)
    with pytest.raises(SystemExit):
        cli.expand_configs("fp7")
    with pytest.raises(ValueError):
        C.parse_overrides(["not_a_field=1"])


def test_attention_option():
    """--attention reaches GPTConfig.attention; "xla" equals the softmax attention; cuDNN
    asks for a GPU and a 16-bit model (checked when the config is made / the model runs)."""
    from experiments.nanogpt import model as G
    from experiments.nanogpt import step as S

    _, args = T.parse_args(["--config", "bf16", "--attention", "xla", "--gpt", "n_layers=1"])
    assert args.model_overrides == {"n_layers": 1, "attention": "xla"}
    assert S.gpt_config(C.get_recipe("bf16-flash"), "tiny").attention == "cudnn"
    assert S.gpt_config(C.get_recipe("bf16-flash"), "tiny", attention="xla").attention == "xla"
    assert G.resolve_attention("auto", jnp.bfloat16, 64, backend="gpu") == "cudnn"
    assert G.resolve_attention("auto", jnp.float32, 64, backend="gpu") == "softmax"
    assert G.resolve_attention("auto", jnp.bfloat16, 64, backend="cpu") == "softmax"
    assert G.resolve_attention("auto", jnp.float16, 64, backend="gpu") == "cudnn"
    assert G.resolve_attention("auto", jnp.float16, 64, backend="cpu") == "softmax"
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        G.get_config("tiny", attention="cudnn")
    with pytest.raises(ValueError, match="needs a GPU"):
        G.resolve_attention("cudnn", jnp.bfloat16, 64, backend="cpu")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)))
    outs = []
    for attention in ("softmax", "xla"):
        model = G.GPT(G.get_config("tiny", n_layers=1, attention=attention))
        outs.append(model.apply(model.init(jax.random.PRNGKey(0), tokens), tokens))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_bench_smoke(tmp_path):
    """The options of the recorded runs (results/): scales packed, every config in this
    process; the plain step is traced on the unpacked state."""
    from experiments.nanogpt import bench

    doc = bench.main(["--model", "tiny", "--gpt", "n_layers=1,d_model=32,n_heads=2", "--seq-len", "16",
                      "--batch-size", "2", "--steps", "2", "--warmup", "1", "--configs", "bf16,fp16",
                      "--isolate", "none", "--pack-scales", "--out", str(tmp_path)])
    results = {r["config"]: r for r in doc["results"]}
    assert set(results) == {"bf16", "fp16"}
    for r in results.values():
        assert "error" not in r, r.get("error")
        assert r["step_ms"] > 0 and r["loss_finite"] and r["fp8_gemms"] == 0 and r["pack_scales"]
        assert len(r["step_ms_all"]) == 2 and r["compile_s"] > 0 and r["step_ms_pipelined"] > 0
    assert results["fp16"]["plain_trace_lower_s"] > 0 and results["bf16"]["speedup_vs_bf16"] == 1.0
    table = (tmp_path / "bench.md").read_text()
    # auto: cuDNN flash attention for bfloat16 on a GPU, the softmax attention elsewhere
    assert results["bf16"]["attention"] == ("cudnn" if jax.default_backend() == "gpu" else "softmax")
    assert "| fp16 | #1 | softmax |" in table and json.loads((tmp_path / "bench.json").read_text())["meta"]["model"] == "tiny"


def test_bench_with_cudnn_attention_writes_its_outputs(tmp_path):
    """`--attention cudnn` sets the attention of every config; the run's metadata must not
    build a float32 model with it (cuDNN attention needs a 16-bit model): bench.json and
    bench.md are written. On CPU every config reports that cuDNN attention needs a GPU."""
    from experiments.nanogpt import bench

    doc = bench.main(["--model", "tiny", "--gpt", "n_layers=1,d_model=32,n_heads=2", "--seq-len", "16",
                      "--batch-size", "2", "--steps", "1", "--warmup", "1", "--configs", "bf16,fp16",
                      "--attention", "cudnn", "--isolate", "none", "--out", str(tmp_path)])
    meta = json.loads((tmp_path / "bench.json").read_text())["meta"]
    assert meta["seq_len"] == 16 and meta["model_overrides"]["attention"] == "cudnn"
    assert (tmp_path / "bench.md").is_file()
    for r in doc["results"]:
        if jax.default_backend() == "gpu":
            assert "error" not in r and r["attention"] == "cudnn", r
        else:
            assert "needs a GPU" in r["error"], r


def test_recipe_variants_and_kernel_layout():
    r = C.get_recipe("fp8:kernel_layout=out_in:grad_rescale=max")
    assert r.name == "fp8:kernel_layout=out_in:grad_rescale=max" and r.paper == "#3"
    assert (r.kernel_layout, r.grad_rescale) == ("out_in", "max")
    assert C.get_recipe("fp8:kernel_layout=out_in", kernel_layout="in_out").kernel_layout == "in_out"
    with pytest.raises(ValueError, match="kernel_layout must be"):
        C.get_recipe("fp8:kernel_layout=io")
    with pytest.raises(ValueError, match="only kernel_layout='in_out'"):
        C.get_recipe("flax-fp8:kernel_layout=out_in")
    with pytest.raises(ValueError, match="Unknown config"):
        C.get_recipe("fp7:kernel_layout=out_in")
    assert C.get_recipe("fp8").head_dtype == "bfloat16"
    with pytest.raises(ValueError, match="head_dtype and head_matmul"):
        C.get_recipe("fp8:head_matmul=true")
    assert C.get_recipe("fp8:head_matmul=true:head_dtype=none").head_matmul
    with pytest.raises(ValueError, match="need head_matmul=true"):
        C.get_recipe("fp8:head_grad=bfloat16")
    with pytest.raises(ValueError, match="Unknown dtype name"):
        C.get_recipe("fp8:head_dtype=none:head_matmul=true:head_output=bf16")


def test_fp8_head_with_bfloat16_logits_and_backward():
    """`head_grad=bfloat16:head_output=bfloat16`: the tied head's forward dot takes E4M3
    operands and writes bfloat16 logits; its two backward dots run in bfloat16 (the
    compiled step's dots, CPU)."""
    import re
    from experiments.nanogpt import step as S

    name = "fp8:head_dtype=none:head_matmul=true:head_grad=bfloat16:head_output=bfloat16"
    vocab = 96  # no other dimension of the tiny model has this size
    pair = S.abstract_step_pair(C.get_recipe(name), "tiny", seq_len=64, batch_size=8, vocab_size=vocab)
    text = pair.scaled().lower(*pair.args).as_text()
    dots = re.findall(r"stablehlo.dot_general .*?: \(tensor<([^>]*)>, tensor<([^>]*)>\) -> tensor<([^>]*)>", text)
    head = [d for d in dots if any(re.search(rf"(^|x){vocab}x", t) for t in d)]
    kinds = sorted((a.rsplit("x", 1)[1], b.rsplit("x", 1)[1], o.rsplit("x", 1)[1]) for a, b, o in head)
    assert kinds == [("bf16", "bf16", "f32"), ("bf16", "bf16", "f32"), ("f8E4M3FN", "f8E4M3FN", "bf16")], kinds


def test_fp16_state_keeps_small_leaves_in_float32():
    """#4 stores the optimizer state of leaves with >= `state_min_size` elements (4096) as
    FP16 ScaledArrays and keeps the smaller ones (biases, LayerNorm parameters) in float32:
    on `paper` 84 of the 200 moment leaves, 99.95% of the state's elements."""
    from experiments.nanogpt import step as S

    for name, small in (("fp8-fp16-state", 4096), ("fp8-fp16-state:state_min_size=2", 2)):
        recipe = C.get_recipe(name)
        assert recipe.state_min_size == small
        gpt = S.gpt_config(recipe, "tiny", **TINY)
        tx = S.make_optimizer(recipe, S.OptimConfig())
        state = jax.eval_shape(lambda: S.init_state(recipe, gpt, tx))  # noqa: B023
        leaves = jax.tree_util.tree_leaves(state.opt_state, is_leaf=lambda x: isinstance(x, scalify.ScaledArray))
        sizes = [(math.prod(x.shape), isinstance(x, scalify.ScaledArray)) for x in leaves]
        fp16 = [n for n, scaled in sizes if scaled]
        kept = [n for n, scaled in sizes if not scaled and n > 1]
        assert fp16 and min(fp16) >= small and all(n < small for n in kept)
        assert bool(kept) == (small > 2)  # tiny's biases (32, 96, 128) stay float32 at 4096
    with pytest.raises(ValueError, match="state_min_size must be"):
        C.get_recipe("fp8-fp16-state:state_min_size=0")


def test_float32_master_recipes_place_the_update_from_the_previous_weights():
    """#0 and #1 (float32 masters, `param_rescale="previous"`): the update takes the scale of
    the largest weight before it (`apply_updates(float32_scale_from="previous")`: one
    variadic reduction per shape, then one call that places every leaf at its scale)
    instead of a dynamic rescale of the new weights; "max" still rescales dynamically;
    unknown values and 16-bit masters fail when the recipe is made."""
    from experiments.nanogpt import step as S

    def optimizer_jaxpr(name):
        recipe = C.get_recipe(name)
        gpt = S.gpt_config(recipe, "tiny", **TINY)
        tx = S.make_optimizer(recipe, S.OptimConfig())
        state = jax.eval_shape(lambda: S.init_state(recipe, gpt, tx))  # noqa: B023
        state = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state,
                                       is_leaf=lambda x: isinstance(x, scalify.ScaledArray))
        # the jaxpr scalify interprets: its scale primitives, before their rules run
        return str(jax.make_jaxpr(S.make_apply_fn(recipe, tx))(state, state.params, state.extra))

    n_params = 12  # tiny with one layer: embeddings, two LayerNorms and ln_f, four Dense
    for name in ("fp32", "fp16"):
        assert C.get_recipe(name).param_rescale == "previous"
        previous, dynamic = optimizer_jaxpr(name), optimizer_jaxpr(f"{name}:param_rescale=max")
        assert dynamic.count("dynamic_rescale[") - previous.count("dynamic_rescale[") >= n_params, name
        assert previous.count("callee=_at_scales") == 1 and "callee=_at_scales" not in dynamic, name
    with pytest.raises(ValueError, match="param_rescale must be one of"):
        C.get_recipe("fp16:param_rescale=newest")
    with pytest.raises(ValueError, match="param_rescale applies to float32 master"):
        C.get_recipe("fp16-master:param_rescale=previous")


def test_recipe_scalify_config_traces_the_step_under_it():
    """`fp8:scalify_config=narrow_dot_accumulator=float32`: the step's FP8 dots with float16
    outputs write float32 (by default bfloat16); typos fail when the recipe is made. (The
    output head is float16 in both, so that its bfloat16 matmul does not count.)"""
    from experiments.nanogpt import step as S

    texts = {}
    for name in ("fp8:head_dtype=none:scalify_config=narrow_dot_accumulator=float32+cast_drift_window=none",
                 "fp8:head_dtype=none"):
        recipe = C.get_recipe(name)
        gpt = S.gpt_config(recipe, "tiny", **TINY, seq_len=8)
        tx = S.make_optimizer(recipe, S.OptimConfig(lr=3e-3, warmup_steps=1, total_steps=10))
        state = S.init_state(recipe, gpt, tx, seed=0)
        tokens = jnp.zeros((2, 8), jnp.int32)
        texts[name] = str(jax.make_jaxpr(S.make_train_step(recipe, gpt, tx, jit=False))(state, tokens, tokens))
    plain, variant = texts.values()
    assert "preferred_element_type=bfloat16" not in plain
    assert "preferred_element_type=bfloat16" in variant
    layouts = {v: C.get_recipe(f"fp8:scalify_config=fp8_operand_layout={v}").make_scalify_config()
               for v in ("none", "transpose")}
    assert {k: c.fp8_operand_layout for k, c in layouts.items()} == {"none": "none", "transpose": "transpose"}
    assert C.get_recipe("fp8:scalify_config=cast_drift_window=none").make_scalify_config().cast_drift_window is None
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        C.get_recipe("fp8:scalify_config=narrow_dot_acc=bfloat16")
    with pytest.raises(ValueError, match="narrow_dot_accumulator must be"):
        C.get_recipe("fp8:scalify_config=narrow_dot_accumulator=float16")
    with pytest.raises(ValueError, match="scalify recipes"):
        C.get_recipe("bf16:scalify_config=narrow_dot_accumulator=bfloat16")


@pytest.mark.parametrize("config", ["fp8", "bf16"])
def test_kernel_layout_out_in_trains_identically(config):
    """The (out, in) kernel layout is the same model: same seed, same losses, kernels transposed."""
    from experiments.nanogpt import step as S

    runs = {}
    for layout in ("in_out", "out_in"):
        recipe = C.get_recipe(config, kernel_layout=layout)
        gpt = S.gpt_config(recipe, "tiny", **TINY, seq_len=16)
        tx = S.make_optimizer(recipe, S.OptimConfig(lr=3e-3, warmup_steps=1, total_steps=10))
        state = S.init_state(recipe, gpt, tx, seed=0)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, gpt.vocab_size, (2, 17)), jnp.int32)
        step = S.make_train_step(recipe, gpt, tx)
        losses = []
        for _ in range(2):
            state, loss = step(state, tokens[:, :-1], tokens[:, 1:])
            losses.append(float(loss))
        kernel = state.params["block_0"]["mlp"]["fc"]["kernel"]
        runs[layout] = losses, np.asarray(kernel.data if hasattr(kernel, "data") else kernel)
    assert runs["out_in"][0] == runs["in_out"][0]
    np.testing.assert_array_equal(runs["out_in"][1], runs["in_out"][1].T)


def test_scale_packing_roundtrip_and_step():
    from experiments.nanogpt import step as S

    recipe = C.get_recipe("fp8")
    gpt = S.gpt_config(recipe, "tiny", **TINY, seq_len=16)
    tx = S.make_optimizer(recipe, S.OptimConfig(lr=3e-3, warmup_steps=1, total_steps=10))
    state = S.init_state(recipe, gpt, tx, seed=0)
    packing = S.ScalePacking(state)
    rest, vec = packing.pack(state)
    n_scalars = sum(packing.mask)
    assert vec.shape == (n_scalars,) and n_scalars > 10 and len(rest) == len(packing.mask) - n_scalars
    back = packing.unpack((rest, vec))
    jax.tree.map(np.testing.assert_array_equal, back, state)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(state)

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, gpt.vocab_size, (2, 17)), jnp.int32)
    step = S.make_train_step(recipe, gpt, tx)
    ref_state, ref_loss = step(state, tokens[:, :-1], tokens[:, 1:])
    packed, loss = packing.step(step)(packing.pack(state), tokens[:, :-1], tokens[:, 1:])
    assert float(loss) == float(ref_loss)
    jax.tree.map(np.testing.assert_array_equal, packing.unpack(packed), ref_state)


def test_fp32_recipe_with_layers_stacked_by_scan_equals_plain_float32():
    """`scan_layers=True` with the fully scaled fp32 recipe: the optimizer's scaled update
    gives each stacked parameter one scale per layer, which the step merges back into the
    state's single scale (`step.conform`: the same values; it raised a ValueError). Its
    losses equal the plain float32 step's."""
    from experiments.nanogpt import step as S

    recipe = C.get_recipe("fp32")
    gpt = S.gpt_config(recipe, "tiny", n_layers=2, d_model=32, n_heads=2, seq_len=8, scan_layers=True)
    tx = S.make_optimizer(recipe, S.OptimConfig(lr=3e-3, warmup_steps=1, total_steps=10))
    state0 = S.init_state(recipe, gpt, tx, seed=0)
    batches = np.random.default_rng(0).integers(0, 256, (3, 4, 9)).astype(np.int32)
    losses, final = {}, {}
    for scaled in (True, False):
        step = S.make_train_step(recipe, gpt, tx, use_scalify=scaled)
        state = state0 if scaled else S.plain_state(state0)
        losses[scaled] = []
        for b in batches:
            state, loss = step(state, b[:, :-1], b[:, 1:])
            losses[scaled].append(float(loss))
        final[scaled] = state
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-6)
    # the state keeps its scale shapes step after step (the jitted step's signature)
    shapes = lambda st: [np.shape(x.scale) for x in jax.tree_util.tree_leaves(st.params, is_leaf=scalify.is_scaled_leaf)
                         if isinstance(x, scalify.ScaledArray)]
    assert shapes(final[True]) == shapes(state0) and len(shapes(state0)) > 0


def test_paper_recipes_one_to_four_run_the_library_step():
    """#1-#4 map to the `scalify.recipes.Recipe` of their masters and state (no
    compute_dtype, no fp8: the model carries its formats); #0 (scaled optimizer), the plain
    baselines and variants of the master update keep the step built in step.py."""
    from experiments.nanogpt import step as S

    f32, f16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.float16)
    expected = {"fp16": (f32, f32), "fp16-master": (f16, f32), "fp8": (f16, f32), "fp8-fp16-state": (f16, f16)}
    for name, (master, state) in expected.items():
        lib = S.library_recipe(C.get_recipe(name))
        assert (lib.compute_dtype, lib.fp8, lib.master_dtype, lib.state_dtype, lib.state_min_size) == (
            None, False, master, state, 4096), name
    for name in ("fp32", "bf16", "flax-fp8", "fp32-plain", "fp8:master_rounding=stochastic",
                 "fp8:master_scale=new", "fp16:param_rescale=max", "fp16:unscaled_optimizer=false",
                 "fp8:grad_rescale=max", "fp8-fp16-state:state=e4m3"):
        assert S.library_recipe(C.get_recipe(name)) is None, name
