#!/bin/bash
# fp16 (#1) with param_rescale=previous (new default) vs max (old): accuracy on small, then speed on paper 8L
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
mkdir -p $OUT/acc $OUT/paper8
A="--model small --data .data/wikitext --tokenizer byte --steps 1000 --batch-size 16 --eval-every 250 --eval-batches 40 --checkpoint-every 0 --no-progress --no-plots --attention cudnn"
t0=$(date +%s)
timeout 220 python -m experiments.nanogpt.train --config fp16 $A --out $OUT/acc/fp16 > $OUT/acc/fp16.log 2>&1
echo "acc wall $(( $(date +%s) - t0 )) s"; grep -E "steps 1000|val" $OUT/acc/fp16.log | tail -4
B="python -m experiments.nanogpt.bench --model paper --pack-scales --isolate none --steps 10 --warmup 3 --profile 2 --no-plain-trace"
( timeout 340 $B --batch-size 16 --configs bf16,fp16,fp16:param_rescale=max --out $OUT/paper8 ) 2>&1 | grep -v -i warn > $OUT/paper8/log.txt
tail -8 $OUT/paper8/log.txt
rm -rf $OUT/*/trace_*
find $OUT/acc -name "*.npz" -o -name "*.msgpack" | xargs rm -f
