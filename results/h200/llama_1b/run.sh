#!/usr/bin/env bash
# The Llama-3-style `1b` preset (experiments/llama/model.py) through benchmarks/stock_gpt.py
# on one H200: bf16, Flax's FP8 ops and the scalify recipes, in several processes (one process
# compiling all six variants takes longer than ten minutes), each with its own bf16 row:
#   bash results/h200/llama_1b/run.sh OUT [GROUP ...]   (GROUP: a, b or d; default a b)
# Writes OUT/a (bf16, fp8-bf16, fp8, fp8-fp16-state: #3 and #4 side by side),
# OUT/b (bf16, flax-fp8, fp8-fp16-state, fp16) and OUT/d (bf16, fp8-bf16 and its
# float16-state variants: #3 and #4 with bfloat16 activations; PROFILE=0: no profile).
set -uo pipefail
OUT=${1:?give an output folder}
shift; GROUPS_=${*:-a b}
export PYTHONPATH=$PWD
for g in $GROUPS_; do
  case $g in
    a) recipes=bf16,fp8-bf16,fp8,fp8-fp16-state ;;
    b) recipes=bf16,flax-fp8,fp8-fp16-state,fp16 ;;
    d) recipes=bf16,fp8-bf16,fp8-bf16-fp16state,fp8-bf16-fp16state-fp8w ;;
    *) echo "unknown group $g"; exit 2 ;;
  esac
  mkdir -p "$OUT/$g"
  python -m benchmarks.stock_gpt --arch llama --size 1b --recipes "$recipes" \
    --warmup 3 --steps 10 --repeats 2 --profile ${PROFILE:-2} --out "$OUT/$g" 2>&1 | tee "$OUT/$g/log.txt"
done
