#!/usr/bin/env bash
# XLA's compile time of the Llama `1b` step by compiler pass, bf16, FP8_BF16 and FP8, at 4, 8
# and 16 layers, in one process on one GPU (benchmarks/compile_passes.py).
#   bash results/h200/compile_passes/run.sh OUT
set -uo pipefail
OUT=${1:?give an output folder}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
python -m benchmarks.compile_passes --preset 1b --variants bf16,fp8-bf16,fp8 --layers 4,8,16 --out "$OUT" 2>&1 \
  | tee "$OUT/log.txt"
