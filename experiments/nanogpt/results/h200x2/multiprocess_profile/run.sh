#!/bin/bash
# Kernel profiles of the `dp` steps with one process per GPU (process 0 traces GPU 0) and of
# the one-GPU steps at the same 16 sequences per GPU, `paper` model, blocking steps.
# Usage: OUT=... bash run.sh   (on a 2-GPU machine; the 2-GPU profiles first)
export PYTHONPATH=$PWD
S="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --pack-scales --steps 6 --warmup 2 --repeats 1 --loss-steps 1 --profile 3 --timing blocking"
mkdir -p $OUT/x2 $OUT/x1
log() { F=$1; shift; echo "== $*" >> $F; "$@" 2>&1 | grep -v -i "warn\|gloo" | grep "^\[scaling\]" >> $F; rm -rf $OUT/*/traces; }
log $OUT/x2/log.txt timeout 100 $S --batch-size 32 --configs bf16 --meshes dp --devices 2 --processes 2 --out $OUT/x2
log $OUT/x2/log.txt timeout 170 $S --batch-size 32 --configs fp8 --meshes dp:bfloat16 --devices 2 --processes 2 --out $OUT/x2
log $OUT/x1/log.txt timeout 60 $S --batch-size 16 --configs bf16 --devices 1 --out $OUT/x1
log $OUT/x1/log.txt timeout 100 $S --batch-size 16 --configs fp8 --devices 1 --out $OUT/x1
cat $OUT/x2/log.txt $OUT/x1/log.txt
