#!/bin/bash
# One process driving 4 GPUs against one process per GPU (scaling_bench --processes 4),
# `paper` model, bf16 dp against scalify fp8 dp:bfloat16, pipelined steps.
# Usage: OUT=... bash run.sh strong|weak
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | head -4
MODE=${1:-strong}
S="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --steps 10 --warmup 3 --repeats 3 --loss-steps 3 --pack-scales"
if [ "$MODE" = weak ]; then S="$S --weak --batch-size 16"; else S="$S --batch-size 32"; fi
D=$OUT/$MODE
mkdir -p $D
run() { echo "== $*" >> $D/log.txt; timeout 200 $S --out $D "$@" 2>&1 | grep -v -i "warn\|gloo" | grep "^\[scaling\]" >> $D/log.txt; }
run --configs bf16,fp8 --devices 1
run --configs bf16 --meshes dp --devices 4
run --configs fp8 --meshes dp:bfloat16 --devices 4
run --configs bf16 --meshes dp --devices 4 --processes 4
run --configs fp8 --meshes dp:bfloat16 --devices 4 --processes 4
cat $D/log.txt
head -12 $D/scaling.md
