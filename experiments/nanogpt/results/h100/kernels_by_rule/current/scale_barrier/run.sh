#!/bin/bash
# scale barrier depth on the current fp8 step, paper 8L, one process
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
B="python -m experiments.nanogpt.bench --model paper --pack-scales --isolate none --steps 10 --warmup 3 --profile 2 --no-plain-trace"
mkdir -p $OUT/sb
( timeout 540 $B --batch-size 16 --configs bf16,fp8,fp8:scalify_config=scale_barrier=0,fp8:scalify_config=scale_barrier=8 --out $OUT/sb ) 2>&1 | grep -v -i warn > $OUT/sb/log.txt
tail -8 $OUT/sb/log.txt
grep -E "^### |kernels per step" $OUT/sb/profile.md
rm -rf $OUT/sb/trace_*
