#!/bin/bash
# Two GPUs with one process per GPU against one GPU, `paper` model, on a 2-GPU machine.
# Usage: OUT=... bash run.sh strong   (global batch 32)
#        OUT=... bash run.sh weak     (16 sequences per GPU)
# Each phase fits one device call; each writes $OUT/<phase>/{scaling.json,scaling.md,log.txt}
# (strong: also the optimized HLO of fp8 dp:bfloat16, hlo_fp8_dp-bfloat16_x2.txt.gz).
export PYTHONPATH=$PWD
S="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --steps 8 --warmup 3 --repeats 2 --loss-steps 2 --pack-scales"
P=$1
case $P in strong) B="--batch-size 32";; weak) B="--weak --batch-size 16";; *) echo "usage: run.sh strong|weak"; exit 2;; esac
mkdir -p $OUT/$P
run() { T=$1; shift; echo "== $B $*" >> $OUT/$P/log.txt; timeout $T $S --out $OUT/$P $B "$@" 2>&1 | grep -v -i "warn\|gloo" | grep "^\[scaling\]" >> $OUT/$P/log.txt; }
run 150 --configs bf16,fp8 --devices 1
run 100 --configs bf16 --meshes dp,fsdp --devices 2 --processes 2
run 165 --configs fp8 --meshes dp:bfloat16 --devices 2 --processes 2 $([ $P = strong ] && echo --dump-hlo)
run 165 --configs fp8 --meshes fsdp:e4m3:bfloat16 --devices 2 --processes 2
cat $OUT/$P/log.txt
