#!/bin/bash
# The rows run.sh and run2.sh left out: 2 GPUs with one process per GPU (strong, dp and fsdp)
# and FSDP weak scaling on 4, on a 4-GPU machine (the 2-GPU runs use its first two GPUs).
# Usage: OUT=... bash run3.sh
export PYTHONPATH=$PWD
S="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --steps 8 --warmup 3 --repeats 2 --loss-steps 2 --pack-scales"
mkdir -p $OUT/strong2 $OUT/weak
run() { D=$1; shift; echo "== $*" >> $OUT/$D/log.txt; timeout 170 $S --out $OUT/$D "$@" 2>&1 | grep -v -i "warn\|gloo" | grep "^\[scaling\]" >> $OUT/$D/log.txt; }
run strong2 --batch-size 32 --configs bf16,fp8 --devices 1
run strong2 --batch-size 32 --configs bf16 --meshes dp,fsdp --devices 2 --processes 2
run strong2 --batch-size 32 --configs fp8 --meshes dp:bfloat16,fsdp:e4m3:bfloat16 --devices 2 --processes 2
cp experiments/nanogpt/results/h100x4/multiprocess/weak/scaling.json $OUT/weak/
run weak --weak --batch-size 16 --configs bf16 --meshes fsdp --devices 4 --processes 4
run weak --weak --batch-size 16 --configs fp8 --meshes fsdp:e4m3:bfloat16 --devices 4 --processes 4
cat $OUT/strong2/log.txt $OUT/weak/log.txt
