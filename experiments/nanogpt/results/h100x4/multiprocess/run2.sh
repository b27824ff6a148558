#!/bin/bash
# Weak scaling (16 sequences per GPU, DP) and strong scaling with FSDP (global batch 32),
# one process per GPU; the strong records of run.sh are the one-GPU reference of the FSDP rows.
export PYTHONPATH=$PWD
R=experiments/nanogpt/results/h100x4/multiprocess
S="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --steps 8 --warmup 3 --repeats 2 --loss-steps 2 --pack-scales"
mkdir -p $OUT/weak $OUT/strong; cp $R/strong/scaling.json $OUT/strong/
run() { D=$1; shift; echo "== $*" >> $OUT/$D/log.txt; timeout 170 $S --out $OUT/$D "$@" 2>&1 | grep -v -i "warn\|gloo" | grep "^\[scaling\]" >> $OUT/$D/log.txt; }
run weak --weak --batch-size 16 --configs bf16,fp8 --devices 1
run weak --weak --batch-size 16 --configs bf16 --meshes dp --devices 4 --processes 4
run weak --weak --batch-size 16 --configs fp8 --meshes dp:bfloat16 --devices 4 --processes 4
run strong --batch-size 32 --configs bf16 --meshes fsdp --devices 4 --processes 4
run strong --batch-size 32 --configs fp8 --meshes fsdp:e4m3:bfloat16 --devices 4 --processes 4
cat $OUT/weak/log.txt $OUT/strong/log.txt
