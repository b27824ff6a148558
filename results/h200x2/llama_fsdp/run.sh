#!/bin/bash
# Llama FSDP strong scaling on one 2-GPU H200 host: bf16 against the scalify FP8 recipe
# with its head in FP8 too (fp8-head) and the FP8 recipe (fp8), the `8b-shape` preset
# (4 layers) at a global batch of 4 x 2048 tokens, 1 GPU then 2 GPUs with one process each.
#   OUT=... bash results/h200x2/llama_fsdp/run.sh [VARIANTS]
export PYTHONPATH=$PWD
V=${1:-bf16,fp8-head,fp8}
B="python -m benchmarks.llama_fsdp --size 8b-shape --batch 4 --variants $V --out $OUT"
mkdir -p $OUT
nvidia-smi -L > $OUT/log.txt
timeout 280 $B --devices 1 2>&1 | grep -v -i "warn\|gloo" | tee -a $OUT/log.txt | grep "^\[llama_fsdp\]"
timeout 300 $B --devices 2 --processes 2 2>&1 | grep -v -i "warn\|gloo" | tee -a $OUT/log.txt | grep "^\[llama_fsdp\]"
cat $OUT/llama_fsdp.md
