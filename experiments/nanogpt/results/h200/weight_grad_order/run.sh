#!/bin/bash
# The FP8 weight gradient of an (out, in) kernel as dot(g, x) (its output already in the
# kernel's order, "after") against dot(x, g) then a transpose ("before"), `paper` model on
# one GPU, global batch 32; bf16 in both runs as the control for machine drift.
# Usage: OUT=... bash run.sh OLD   (OLD: scalify/ and experiments/ of the commit before the
#        change, e.g. `git archive 35c6827 scalify experiments | tar -x -C .data/old`)
OLD=$(cd $1 && pwd); REPO=$PWD
S="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --batch-size 32 --steps 8 --warmup 3 --repeats 3 --loss-steps 2 --pack-scales --devices 1 --configs bf16,fp8"
mkdir -p $OUT/before $OUT/after
log() { F=$1; shift; echo "== $*" >> $F; "$@" 2>&1 | grep "^\[scaling\]" >> $F; }
(cd $OLD && PYTHONPATH=$OLD:$REPO log $OUT/before/log.txt timeout 170 $S --out $OUT/before)  # python -m puts the cwd first
PYTHONPATH=$PWD log $OUT/after/log.txt timeout 170 $S --out $OUT/after
cat $OUT/before/log.txt $OUT/after/log.txt
