#!/bin/bash
# Where the 2-GPU step's collectives run against compute, per collective, `paper` model,
# global batch 32: a kernel profile of 3 blocking steps per mode (one process drives both
# GPUs: the profiler traces one process), then the dp steps timed with one process per GPU
# at XLA's default all-reduce combining and with a smaller combine threshold.
# Usage: OUT=... bash run.sh
export PYTHONPATH=$PWD
S="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --batch-size 32 --devices 2 --pack-scales"
P="$S --steps 6 --warmup 2 --repeats 1 --loss-steps 1 --profile 3 --timing blocking --out $OUT/profile"
T="$S --steps 8 --warmup 3 --repeats 2 --loss-steps 2 --processes 2"
mkdir -p $OUT/profile $OUT/combine
log() { F=$1; shift; echo "== $*" >> $F; "$@" 2>&1 | grep -v -i "warn\|gloo" | grep "^\[scaling\]" >> $F; }
log $OUT/profile/log.txt timeout 120 $P --configs bf16 --meshes dp,fsdp
log $OUT/profile/log.txt timeout 170 $P --configs fp8 --meshes dp:bfloat16,fsdp:e4m3:bfloat16
rm -rf $OUT/profile/traces
for B in default 8388608; do
  [ $B = default ] && unset XLA_FLAGS || export XLA_FLAGS="--xla_gpu_all_reduce_combine_threshold_bytes=$B"
  echo "== XLA_FLAGS=$XLA_FLAGS" >> $OUT/combine/log.txt
  log $OUT/combine/log.txt timeout 70 $T --configs bf16 --meshes dp --out $OUT/combine/$B
  log $OUT/combine/log.txt timeout 110 $T --configs fp8 --meshes dp:bfloat16 --out $OUT/combine/$B
done
cat $OUT/profile/log.txt $OUT/combine/log.txt
