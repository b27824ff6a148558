#!/bin/bash
# The dp steps with XLA's one-shot all-reduce kernel off: scalify fp8 `dp:bfloat16` averages
# its float32 loss in an all-reduce of its own, which XLA runs as its one-shot kernel (a
# fused scalar all-reduce, `psum.*-fusion` in profile.md); bf16 `dp` sends its loss with the
# float32 gradients (NCCL). One process per GPU, global batch 32, as ../multiprocess/.
# Usage: OUT=... bash run3.sh   (about 2.5 minutes on a 2-GPU machine)
export PYTHONPATH=$PWD
T="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --batch-size 32 --devices 2 --pack-scales --steps 8 --warmup 3 --repeats 2 --loss-steps 2 --processes 2"
mkdir -p $OUT/oneshot_off
export XLA_FLAGS=--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false
log() { echo "== XLA_FLAGS=$XLA_FLAGS $*" >> $OUT/oneshot_off/log.txt; "$@" 2>&1 | grep -v -i "warn\|gloo" | grep "^\[scaling\]" >> $OUT/oneshot_off/log.txt; }
log timeout 70 $T --configs bf16 --meshes dp --out $OUT/oneshot_off
log timeout 120 $T --configs fp8 --meshes dp:bfloat16 --out $OUT/oneshot_off
cat $OUT/oneshot_off/log.txt
