#!/usr/bin/env bash
# cuDNN FP8 fused attention against bf16 cuDNN flash attention at the Llama presets' shapes.
#   bash results/h200/fp8_attention/run.sh OUT
set -uo pipefail
OUT=${1:?give an output folder}
mkdir -p "$OUT"
PYTHONPATH=$PWD python -m benchmarks.fp8_attention --out "$OUT" 2>&1 | tee "$OUT/log.txt"
