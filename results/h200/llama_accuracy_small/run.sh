#!/usr/bin/env bash
# Validation loss of the Llama example's configurations on its `small` preset, one GPU,
# the processes at once (their tokens/s are not speed measurements). DATA: a folder with
# wiki.test.tokens (trained on) and wiki.valid.tokens (evaluated on).
#   DATA=path/to/wikitext OUT=... bash results/h200/llama_accuracy_small/run.sh
set -uo pipefail
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.11
A="--model small --data $DATA --tokenizer byte --steps 1000 --batch-size 8 --eval-every 250
   --eval-batches 40 --checkpoint-every 0 --no-progress --no-plots --out $OUT/runs"
mkdir -p "$OUT/logs"
for c in fp32 bf16 fp16 fp16-master fp8 fp8-fp16-state fp8-head fp8-bf16; do
  python -m experiments.llama.train --config $c $A > "$OUT/logs/$c.log" 2>&1 &
done
wait
tail -n 3 "$OUT"/logs/*.log
tar -czf "$OUT/llama_accuracy_small.tar.gz" -C "$OUT" logs runs
