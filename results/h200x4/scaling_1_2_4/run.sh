#!/bin/bash
# 1, 2 and 4 GPUs with one process per GPU, `paper` model, bf16 against scalify fp8, DP and
# FSDP, strong (global batch 32) and weak (16 sequences per GPU) scaling, on one 4-GPU
# machine, in three device calls:
#   OUT=... bash run.sh strong4   # 1 GPU (batch 32), 4 GPUs (batch 32)
#   OUT=... bash run.sh weak4     # 1 GPU (batch 16), 4 GPUs (batch 64)
#   OUT=... bash run.sh x2        # 2 GPUs (GPUs 0 and 1): weak (batch 32), then strong (batch 32)
# Each writes $OUT/{strong,weak}/{scaling.json,scaling.md,log.txt}, merged with the records
# of the earlier calls kept beside this script (copy each call's output here before the next).
export PYTHONPATH=$PWD
HERE=$(dirname "$0")
S="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --steps 8 --warmup 3 --repeats 2 --loss-steps 2 --pack-scales"
for d in strong weak; do
  mkdir -p $OUT/$d
  for f in scaling.json log.txt; do [ -f $HERE/$d/$f ] && cp $HERE/$d/$f $OUT/$d/; done
done
# run TIMEOUT strong|weak ARGS...: one scaling_bench command, its result lines appended to the log.
run() {
  T=$1; D=$2; shift 2
  case $D in strong) B="--batch-size 32";; weak) B="--weak --batch-size 16";; esac
  echo "== $B $*" >> $OUT/$D/log.txt
  timeout $T $S --out $OUT/$D $B "$@" 2>&1 | grep -v -i "warn\|gloo" | grep "^\[scaling\]" >> $OUT/$D/log.txt
}
four() {
  run 130 $1 --configs bf16,fp8 --devices 1
  run 130 $1 --configs bf16 --meshes dp,fsdp --devices 4 --processes 4
  run 150 $1 --configs fp8 --meshes dp:bfloat16 --devices 4 --processes 4
  run 150 $1 --configs fp8 --meshes fsdp:e4m3:bfloat16 --devices 4 --processes 4
}
two() {
  export CUDA_VISIBLE_DEVICES=0,1
  run 60 $1 --configs bf16 --meshes dp --devices 2 --processes 2
  run 120 $1 --configs fp8 --meshes dp:bfloat16 --devices 2 --processes 2
  run 60 $1 --configs bf16 --meshes fsdp --devices 2 --processes 2
  run 120 $1 --configs fp8 --meshes fsdp:e4m3:bfloat16 --devices 2 --processes 2
}
case $1 in
  strong4) four strong; nvidia-smi -L >> $OUT/strong/log.txt;;
  weak4) four weak; run 70 strong --configs bf16 --meshes fsdp --devices 4 --processes 4;;
  x2) two weak; two strong;;
  *) echo "usage: run.sh strong4|weak4|x2"; exit 2;;
esac
for d in strong weak; do echo "# $d"; cat $OUT/$d/log.txt 2>/dev/null; done
