#!/usr/bin/env bash
# The stock Flax GPT (benchmarks/stock_gpt.py) on one H200, the recipes with delayed
# statistics (the default), beside bf16, Flax's FP8 ops and `fp8` with bfloat16 activations.
#   bash results/h200/stock_gpt_delayed/run.sh OUT
# Writes OUT/<size>/probe_<size>.json and OUT/<size>/profile_<variant>.md.
set -uo pipefail
OUT=${1:?give an output folder}
export PYTHONPATH=$PWD PROFILE=2 STEPS=15 REPEATS=2
python results/h200/stock_gpt_delayed/probe.py d1024 bf16,flax-fp8,fp8,fp8-bf16act,fp16 "$OUT/d1024"
python results/h200/stock_gpt_delayed/probe.py d4096 bf16,flax-fp8,fp8,fp8-bf16act "$OUT/d4096"
