#!/usr/bin/env bash
# The deepest Llama at the 8B model's width (batch 2 x seq 2048) that trains on one H200,
# per variant (benchmarks/llama_memory.py), JAX's allocator allowed 95% of the GPU.
#   bash results/h200/llama_memory/run.sh OUT [RECIPES [ARGS...]]   (default: bf16,fp8-fp16-state;
#   ARGS: more options of benchmarks/llama_memory.py, e.g. --layers 54 or --hlo-dir OUT/hlo)
set -uo pipefail
OUT=${1:?give an output folder}
RECIPES=${2:-bf16,fp8-fp16-state}
mkdir -p "$OUT"
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
python -m benchmarks.llama_memory --recipes "$RECIPES" --out "$OUT" "${@:3}" 2>&1 | tee "$OUT/log.txt"
