#!/bin/bash
# The fp8 steps with the code before the packed scales left their vector through one
# optimization barrier ("before"): the one-GPU step and the 2-GPU `dp:bfloat16` step (one
# process per GPU, with its optimized HLO), `paper` model, global batch 32, on the machine
# that has just run `../multiprocess/run.sh strong` with the current code ("after").
# Usage: OUT=... bash run.sh OLD   (OLD: scalify/ and experiments/ of the commit before the
#        change: `git archive 29c92af scalify experiments | tar -x -C .data/old`)
OLD=$(cd $1 && pwd); REPO=$PWD
S="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --batch-size 32 --steps 8 --warmup 3 --repeats 2 --loss-steps 2 --pack-scales --configs fp8"
mkdir -p $OUT/before
log() { echo "== $*" >> $OUT/before/log.txt; "$@" 2>&1 | grep -v -i "warn\|gloo" | grep "^\[scaling\]" >> $OUT/before/log.txt; }
cd $OLD  # python -m puts the cwd first
export PYTHONPATH=$OLD:$REPO
log timeout 120 $S --devices 1 --out $OUT/before
log timeout 165 $S --meshes dp:bfloat16 --devices 2 --processes 2 --out $OUT/before --dump-hlo
cat $OUT/before/log.txt
