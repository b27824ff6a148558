#!/bin/bash
# current recipes: bf16, fp8, fp8-fp16-state, fp16 in one process; $1 = paper8 | d2048
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
B="python -m experiments.nanogpt.bench --model paper --pack-scales --isolate none --steps 10 --warmup 3 --profile 2 --no-plain-trace"
mkdir -p $OUT/$1
if [ "$1" = paper8 ]; then EXTRA="--batch-size 16"; else EXTRA="--gpt d_model=2048 --batch-size 8"; fi
( timeout 560 $B $EXTRA --configs bf16,fp8,fp8-fp16-state,fp16 --out $OUT/$1 ) 2>&1 | grep -v -i warn > $OUT/$1/log.txt
tail -8 $OUT/$1/log.txt
grep -E "^### |kernels per step" $OUT/$1/profile.md
rm -rf $OUT/$1/trace_*
