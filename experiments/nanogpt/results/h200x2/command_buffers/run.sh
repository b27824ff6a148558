#!/bin/bash
# One GPU and two (one process per GPU, `dp` / `dp:bfloat16`) with XLA's default CUDA-graph
# command buffers, then with none (`XLA_FLAGS=--xla_gpu_enable_command_buffer=`: every
# kernel launched from the host), bf16 and fp8, `paper` model, global batch 32, one machine.
# Usage: OUT=... bash run.sh   (writes $OUT/{default,off}/{scaling.json,scaling.md,log.txt})
export PYTHONPATH=$PWD
S="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --steps 8 --warmup 3 --repeats 2 --loss-steps 2 --pack-scales --batch-size 32"
for M in default off; do
  mkdir -p $OUT/$M
  [ $M = off ] && export XLA_FLAGS="--xla_gpu_enable_command_buffer="
  run() { T=$1; shift; echo "== XLA_FLAGS=$XLA_FLAGS $*" >> $OUT/$M/log.txt; timeout $T $S --out $OUT/$M "$@" 2>&1 | grep -v -i "warn\|gloo" | grep "^\[scaling\]" >> $OUT/$M/log.txt; }
  run 130 --configs bf16,fp8 --devices 1
  run 60 --configs bf16 --meshes dp --devices 2 --processes 2
  run 110 --configs fp8 --meshes dp:bfloat16 --devices 2 --processes 2
done
cat $OUT/*/log.txt
