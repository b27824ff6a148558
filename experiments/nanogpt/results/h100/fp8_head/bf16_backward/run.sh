#!/bin/bash
# OUT=DIR bash run.sh paper8 | d2048 | acc (from the repository root)
# FP8 head with bfloat16 logits and backward: $1 = paper8 | d2048 | acc
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
V="fp8:head_dtype=none:head_matmul=true:head_grad=bfloat16:head_output=bfloat16"
B="python -m experiments.nanogpt.bench --model paper --pack-scales --isolate none --steps 10 --warmup 3 --profile 2 --no-plain-trace"
mkdir -p $OUT/$1
if [ "$1" = acc ]; then
  A="--model small --data path/to/wikitext --tokenizer byte --steps 1000 --batch-size 16 --eval-every 250 --eval-batches 40 --checkpoint-every 0 --no-progress --no-plots --attention cudnn"
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
  python -m experiments.nanogpt.train --config fp8 $A --out $OUT/acc/fp8 > $OUT/acc/fp8.log 2>&1 &
  python -m experiments.nanogpt.train --config fp8 --set head_dtype=none --set head_matmul=true --set head_grad=bfloat16 --set head_output=bfloat16 $A --out $OUT/acc/fp8_head_bf16 > $OUT/acc/fp8_head_bf16.log 2>&1 &
  wait
  for f in $OUT/acc/*.log; do echo == $f; grep -v -i warn $f | tail -4; done
  exit 0
fi
if [ "$1" = paper8 ]; then EXTRA="--batch-size 16"; else EXTRA="--gpt d_model=2048 --batch-size 8"; fi
( timeout 560 $B $EXTRA --configs bf16,fp8,$V --out $OUT/$1 ) 2>&1 | grep -v -i warn > $OUT/$1/log.txt
tail -6 $OUT/$1/log.txt
grep -E "^### |kernels per step" $OUT/$1/profile.md
rm -rf $OUT/$1/trace_*
