#!/bin/bash
# The fp8 2-GPU steps whose gradients cross the wire in bfloat16, with the code before the
# FP8 weight gradients were written in bfloat16 by their GEMM ("before"), `paper` model,
# global batch 32, one process per GPU, on the machine that has just run
# `../multiprocess/run.sh strong` with the current code ("after").
# Usage: OUT=... bash run.sh OLD   (OLD: scalify/ and experiments/ of the commit before the
#        change: `git archive af04520 scalify experiments | tar -x -C .data/old`)
OLD=$(cd $1 && pwd); REPO=$PWD
S="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --batch-size 32 --steps 8 --warmup 3 --repeats 2 --loss-steps 2 --pack-scales --configs fp8 --devices 2 --processes 2"
mkdir -p $OUT/before
log() { echo "== $*" >> $OUT/before/log.txt; "$@" 2>&1 | grep -v -i "warn\|gloo" | grep "^\[scaling\]" >> $OUT/before/log.txt; }
cd $OLD  # python -m puts the cwd first
export PYTHONPATH=$OLD:$REPO
log timeout 165 $S --meshes dp:bfloat16 --out $OUT/before --dump-hlo
log timeout 165 $S --meshes fsdp:e4m3:bfloat16 --out $OUT/before
cat $OUT/before/log.txt
