#!/usr/bin/env bash
# Validation loss of the five configurations on the NanoGPT `small` model, one GPU, the
# five processes at once. DATA: a folder with wiki.test.tokens and wiki.valid.tokens.
#   DATA=path/to/wikitext OUT=... bash results/h200/accuracy_small/run.sh
set -uo pipefail
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.15
A="--model small --data $DATA --tokenizer byte --steps 1000 --batch-size 16 --eval-every 250
   --eval-batches 40 --checkpoint-every 0 --no-progress --no-plots"
mkdir -p "$OUT/logs"
# #0 float32 with the softmax attention (cuDNN flash attention needs a 16-bit model);
# #1-#4 with cuDNN flash attention (what --attention auto picks on a GPU for them)
python -m experiments.nanogpt.train --config fp32 $A --out "$OUT/fp32" > "$OUT/logs/fp32.log" 2>&1 &
for c in fp16 fp16-master fp8 fp8-fp16-state; do
  python -m experiments.nanogpt.train --config $c $A --attention cudnn --out "$OUT/scalified" \
    > "$OUT/logs/$c.log" 2>&1 &
done
wait
grep -h "steps 1000" "$OUT"/logs/*.log
tar -czf "$OUT/accuracy_small.tar.gz" -C "$OUT" logs fp32 scalified
