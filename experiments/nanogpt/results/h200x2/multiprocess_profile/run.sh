#!/bin/bash
# Kernel profiles of the `dp` steps with one process per GPU (process 0 traces GPU 0) and of
# the one-GPU steps at the same 16 sequences per GPU, `paper` model, blocking steps. One
# folder per command (each writes its own profile.md).
# Usage: OUT=... bash run.sh   (on a 2-GPU machine; the 2-GPU profiles first)
export PYTHONPATH=$PWD
S="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --pack-scales --steps 6 --warmup 2 --repeats 1 --loss-steps 1 --profile 3 --timing blocking"
run() { D=$OUT/$1; T=$2; shift 2; mkdir -p $D; echo "== $S $* --out $D" > $D/log.txt
        timeout $T $S "$@" --out $D 2>&1 | grep -v -i "warn\|gloo" | grep "^\[scaling\]" >> $D/log.txt; rm -rf $D/traces; }
run bf16_dp_x2 100 --batch-size 32 --configs bf16 --meshes dp --devices 2 --processes 2
run fp8_dp-bfloat16_x2 170 --batch-size 32 --configs fp8 --meshes dp:bfloat16 --devices 2 --processes 2
run bf16_x1 60 --batch-size 16 --configs bf16 --devices 1
run fp8_x1 100 --batch-size 16 --configs fp8 --devices 1
cat $OUT/*/log.txt
