#!/bin/bash
# `dp:bfloat16` with the vectors' gradients (biases, LayerNorm) and the loss averaged in
# float32, the matrices' in bfloat16 (`parallel._vectors_own_dtype`), and the references of
# the strong table, `paper` model, global batch 32, one process per GPU, one machine; the
# fp8 2-GPU step first. Each command appends its result line to $OUT/log.txt.
# Usage: OUT=... bash run.sh
export PYTHONPATH=$PWD
S="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --steps 8 --warmup 3 --repeats 2 --loss-steps 2 --pack-scales --batch-size 32"
run() { T=$1; shift; echo "== $S $*" >> $OUT/log.txt; timeout $T $S --out $OUT "$@" 2>&1 | grep -v -i "warn\|gloo" | grep "^\[scaling\]" >> $OUT/log.txt; }
run 110 --configs fp8 --meshes dp:bfloat16 --devices 2 --processes 2
run 90 --configs fp8 --devices 1
run 50 --configs bf16 --meshes dp --devices 2 --processes 2
run 40 --configs bf16 --devices 1
cat $OUT/log.txt
