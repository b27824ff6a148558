"""benchmarks/stock_gpt.py on the `tiny` size: every variant kind (plain bf16, Flax's FP8
ops, a scalify recipe) yields a complete record with finite losses, and the table is
written (``--hlo-dir``: each variant's compiled HLO text); the same for the Llama model
(``--arch llama``)."""
import gzip
import json

import jax
import pytest

from benchmarks import stock_gpt
from scalify.inspect.hlo import hlo_instruction_count

FIELDS = ("variant", "parameters", "step_ms", "step_ms_windows", "speedup_vs_bf16", "trace_lower_s",
          "compile_s", "compile_vs_bf16", "trace_lower_compile_vs_bf16", "hlo_instructions", "fp8_gemms",
          "memory_bytes", "xla_memory", "loss_first", "loss_final", "loss_finite", "n_steps")


def test_stock_gpt_tiny(tmp_path, default_matmul_precision):
    variants = ["bf16", "fp8"]  # flax-fp8: test_llama_tiny
    doc = stock_gpt.main(["--size", "tiny", "--recipes", ",".join(variants), "--warmup", "1", "--steps", "1",
                          "--repeats", "1", "--out", str(tmp_path), "--hlo-dir", str(tmp_path / "hlo")])
    records = doc["records"]
    assert [r["variant"] for r in records] == variants
    for r in records:
        assert all(k in r for k in FIELDS), [k for k in FIELDS if k not in r]
        assert r["loss_finite"] and r["n_steps"] == 2
        # --hlo-dir: the compiled program the record counts, one file per variant
        with gzip.open(tmp_path / "hlo" / f"{r['variant']}.hlo.gz", "rt") as f:
            assert hlo_instruction_count(f.read()) == r["hlo_instructions"]
        assert r["step_ms"] > 0 and r["compile_s"] > 0 and r["hlo_instructions"] > 0
        assert r["memory_bytes"] is None or r["memory_bytes"] > 0
    assert records[0]["speedup_vs_bf16"] == 1.0
    assert records[-1]["hlo_instructions"] > records[0]["hlo_instructions"]  # scalify's scale arithmetic
    saved = json.loads((tmp_path / "stock_gpt.json").read_text())
    assert saved["meta"]["jax"] == jax.__version__ and len(saved["records"]) == len(variants)
    table = (tmp_path / "stock_gpt.md").read_text()
    assert "| variant | step ms |" in table
    for v in variants:
        assert f"| {v} |" in table


def test_llama_tiny(tmp_path, default_matmul_precision):
    """``--arch llama``: the Llama example's model in the same benchmark (bf16, Flax's FP8
    ops through the config's dot_general_cls; a recipe's record: test_stock_gpt_tiny, and the
    recipes on this model: tests/e2e/test_llama_example.py); the GPT's sizes are refused."""
    variants = ["bf16", "flax-fp8"]
    doc = stock_gpt.main(["--arch", "llama", "--size", "tiny", "--recipes", ",".join(variants), "--warmup", "1",
                          "--steps", "1", "--repeats", "1", "--out", str(tmp_path)])
    records = doc["records"]
    assert [r["variant"] for r in records] == variants
    for r in records:
        assert all(k in r for k in FIELDS), [k for k in FIELDS if k not in r]
        assert r["loss_finite"] and r["n_steps"] == 2 and r["parameters"] == 131_392
    assert records[-1]["hlo_instructions"] > records[0]["hlo_instructions"]
    saved = json.loads((tmp_path / "stock_llama.json").read_text())
    assert saved["meta"]["arch"] == "llama" and len(saved["records"]) == len(variants)
    assert (tmp_path / "stock_llama.md").read_text().startswith("### Llama `tiny`")
    with pytest.raises(SystemExit):
        stock_gpt.parse_args(["--arch", "llama", "--size", "d1024"])


def test_fp8_bound_column_from_the_profiles():
    """With profiles, an FP8 variant's record gets the zero-overhead bound against bf16:
    bf16 busy 1000 us, 600 of it GEMMs; the FP8 step runs those GEMMs in 300 us (nvjet
    `sm90_qr`/`sm90_qq`: E4M3/E5M2 operands) and keeps a 100 us bfloat16 head GEMM, so
    FP8 saves (600 - 100) - 300 = 200 us: bound 1000 / 800. Every profiled record gets
    bf16's busy time over its own (1000 / 900); a record without a profile gets None."""
    def record(variant, busy, families, fp8_gemms):
        gemm = sum(f["us"] for f in families)
        return {"variant": variant, "step_ms": busy / 1000, "compile_s": 1.0, "trace_lower_s": 1.0,
                "fp8_gemms": fp8_gemms, "profile": {"busy_us": busy, "by_category_us": {"gemm": gemm},
                                                    "families": families}}
    bf16 = record("bf16", 1000.0, [{"family": "nvjet_sm90_tst_256x128", "kind": "gemm", "us": 600.0}], 0)
    fp8 = record("fp8", 900.0, [{"family": "nvjet_sm90_qrtst_128x128", "kind": "gemm", "us": 180.0},
                                {"family": "nvjet_sm90_qqtst_128x128", "kind": "gemm", "us": 120.0},
                                {"family": "nvjet_sm90_tst_256x128", "kind": "gemm", "us": 100.0}], 4)
    stock_gpt._ratios([bf16, fp8])
    assert bf16["fp8_bound"] is None
    assert fp8["fp8_bound"] == pytest.approx(1000 / 800)
    assert bf16["busy_vs_bf16"] == 1.0 and fp8["busy_vs_bf16"] == pytest.approx(1000 / 900)
    fp8_unprofiled = {k: v for k, v in fp8.items() if k != "profile"}
    stock_gpt._ratios([bf16, fp8_unprofiled])
    assert fp8_unprofiled["busy_vs_bf16"] is None


@pytest.mark.parametrize("source, part", [
    ("other -", "optimizer update"),
    ("(no op name)", "no op name"),
    ("backward -", "loss"),
    ("forward block_*/ln1", "norms"),
    ("backward ln_f", "norms"),
    ("backward layers_*/ffn_norm", "norms"),
    ("forward block_*/fc1", "MLP"),
    ("backward layers_*/feed_forward/w1", "MLP"),
    ("forward block_*/qkv/Fp8DirectDotGeneralOp_*", "attention projections"),
    ("backward layers_*/attention/wo", "attention projections"),
    ("forward block_*", "attention and residual adds"),
    ("backward layers_*/attention", "attention and residual adds"),
    ("backward wte.attend", "embeddings"),
    ("forward tok_embeddings", "embeddings"),
    ("backward lm_head", "head"),
])
def test_model_part_of_source_labels(source, part):
    assert stock_gpt.model_part(source) == part


def test_by_part_sums_the_sources_of_each_profiled_variant():
    """Two sources of one part add up, in ms; a variant with no profile gets no column."""
    def record(variant, rows):
        return {"variant": variant, "profile": {"by_source": [{"source": s, "us": us} for s, us in rows]}}
    table = stock_gpt.by_part([
        record("bf16", [("forward block_*/ln1", 500.0), ("backward ln_f", 250.0), ("other -", 1000.0)]),
        {"variant": "unprofiled"},
        record("fp8", [("forward block_*/fc1", 2000.0)]),
    ])
    assert "| part | bf16 | fp8 |" in table
    assert "| norms | 0.75 | 0.00 |" in table and "| MLP | 0.00 | 2.00 |" in table
    assert "| all | 1.75 | 2.00 |" in table
    assert stock_gpt.by_part([{"variant": "bf16"}]) == ""
