#!/bin/bash
# FSDP weak scaling (16 sequences per GPU) on 4 GPUs with one process per GPU, against its
# own one-GPU reference measured in the same call. Usage: OUT=... bash run.sh
export PYTHONPATH=$PWD
S="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --steps 8 --warmup 3 --repeats 2 --loss-steps 2 --pack-scales --weak --batch-size 16"
mkdir -p $OUT/weak_fsdp
run() { T=$1; shift; echo "== $*" >> $OUT/weak_fsdp/log.txt; timeout $T $S --out $OUT/weak_fsdp "$@" 2>&1 | grep -v -i "warn\|gloo" | grep "^\[scaling\]" >> $OUT/weak_fsdp/log.txt; }
run 110 --configs bf16,fp8 --devices 1
run 150 --configs fp8 --meshes fsdp:e4m3:bfloat16 --devices 4 --processes 4
run 75 --configs bf16 --meshes fsdp --devices 4 --processes 4
nvidia-smi -L >> $OUT/weak_fsdp/log.txt
cat $OUT/weak_fsdp/log.txt
