#!/usr/bin/env bash
# The Llama-3-style `8b-shape` preset (the 8B model's width, 4 layers) at batch 4 x seq 2048
# through benchmarks/stock_gpt.py on one H200: bf16, Flax fp8_ops and the FP8 recipes in one
# process, with kernel profiles (the FP8 zero-overhead bound).
#   bash results/h200/llama_8b_shape_batch4/run.sh OUT [RECIPES]
set -uo pipefail
OUT=${1:?give an output folder}
RECIPES=${2:-bf16,flax-fp8,fp8,fp8-head}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
python -m benchmarks.stock_gpt --arch llama --size 8b-shape --batch 4 --recipes "$RECIPES" \
  --warmup 3 --steps 10 --repeats 2 --profile 2 --out "$OUT" 2>&1 | tee "$OUT/log.txt"
