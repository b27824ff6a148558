#!/usr/bin/env bash
# The stock Flax GPT (benchmarks/stock_gpt.py) on one H200: bf16 with cuDNN attention, Flax's
# FP8 ops and the scalify recipes, side by side in one process per size.
#   bash results/h200/stock_gpt/run.sh OUT [SIZE ...]      (default: d1024 d2048 d4096)
# Writes OUT/<size>/stock_gpt.{json,md}, OUT/<size>/profile_<variant>.md and OUT/<size>/log.txt.
set -uo pipefail
OUT=${1:?give an output folder}; shift
SIZES=${*:-d1024 d2048 d4096}
export PYTHONPATH=$PWD
for size in $SIZES; do
  recipes=bf16,flax-fp8,fp8,fp8-bf16,fp16,fp8-fp16-state
  [ "$size" = d2048 ] && recipes=bf16,flax-fp8,fp8,fp8-bf16,fp16
  mkdir -p "$OUT/$size"
  python -m benchmarks.stock_gpt --size "$size" --recipes "$recipes" \
    --warmup 5 --steps 15 --repeats 3 --profile 2 --out "$OUT/$size" 2>&1 | tee "$OUT/$size/log.txt"
done
