#!/usr/bin/env bash
# The Llama-3-style `8b-shape` preset (the 8B model's width, 4 layers, batch 2 x seq 2048)
# through benchmarks/stock_gpt.py on one H200: bf16, Flax fp8_ops and the recipes in one process.
#   bash results/h200/llama_8b_shape/run.sh OUT [RECIPES] [more benchmarks.stock_gpt options]
#   (default: bf16, Flax fp8_ops, the recipes, and fp8, fp8-bf16, #4 with bfloat16 activations
#   with their head in FP8)
set -uo pipefail
OUT=${1:?give an output folder}
RECIPES=${2:-bf16,flax-fp8,fp8,fp8-bf16,fp8-head,fp8-bf16-head,fp8-bf16-fp16state-head,fp8-fp16-state,fp16}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
python -m benchmarks.stock_gpt --arch llama --size 8b-shape --recipes "$RECIPES" \
  --warmup 3 --steps 10 --repeats 2 --profile 2 --out "$OUT" "${@:3}" 2>&1 | tee "$OUT/log.txt"
