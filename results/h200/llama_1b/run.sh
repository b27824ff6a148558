#!/usr/bin/env bash
# The Llama-3-style `1b` preset (experiments/llama/model.py) through benchmarks/stock_gpt.py
# on one H200: bf16, Flax's FP8 ops and the scalify recipes, side by side in one process.
#   bash results/h200/llama_1b/run.sh OUT [RECIPES]   (default: bf16,flax-fp8,fp8,fp8-fp16-state,fp16)
set -uo pipefail
OUT=${1:?give an output folder}
RECIPES=${2:-bf16,flax-fp8,fp8,fp8-fp16-state,fp16}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
python -m benchmarks.stock_gpt --arch llama --size 1b --recipes "$RECIPES" \
  --warmup 3 --steps 10 --repeats 2 --profile 2 --out "$OUT" 2>&1 | tee "$OUT/log.txt"
