#!/bin/bash
# The profile run.sh left out: fp8 `dp:bfloat16` on 2 GPUs, one mode per command, with the
# optimized HLO of both dp steps for benchmarks/collective_neighbours.py.
# Usage: OUT=... bash run2.sh   (about 4 minutes on a 2-GPU machine)
export PYTHONPATH=$PWD
S="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --batch-size 32 --devices 2 --pack-scales"
P="$S --steps 6 --warmup 2 --repeats 1 --loss-steps 1 --profile 3 --timing blocking --dump-hlo --out $OUT/dp"
mkdir -p $OUT/dp
log() { echo "== $*" >> $OUT/dp/log.txt; "$@" 2>&1 | grep -v -i "warn\|gloo" | grep "^\[scaling\]" >> $OUT/dp/log.txt; }
log timeout 90 $P --configs bf16 --meshes dp
log timeout 240 $P --configs fp8 --meshes dp:bfloat16
rm -rf $OUT/dp/traces
python benchmarks/collective_neighbours.py $OUT/dp/hlo_bf16_dp_x2.txt.gz $OUT/dp/hlo_fp8_dp-bfloat16_x2.txt.gz > $OUT/dp/neighbours.md
cat $OUT/dp/log.txt $OUT/dp/neighbours.md
