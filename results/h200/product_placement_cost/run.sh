#!/usr/bin/env bash
# The cost of placing float16/FP8 products of two tensors from their maximum, on the
# NanoGPT `paper` step (8 layers, batch 16 x seq 512, cuDNN attention), one H200:
# the code before the placement (a checkout of it in $OLD) and this checkout, each
# process timing bf16 and the fp8 recipe side by side.
#   OLD=.data/old OUT=... bash results/h200/product_placement_cost/run.sh
set -euo pipefail
OLD=${OLD:-.data/old}
args=(--model paper --pack-scales --isolate none --steps 20 --warmup 3 --no-plain-trace
      --batch-size 16 --configs bf16,fp8)
(cd "$OLD" && PYTHONPATH=$PWD python -m experiments.nanogpt.bench "${args[@]}" --out "$OUT/before") 2>&1 | tail -n 20
PYTHONPATH=$PWD python -m experiments.nanogpt.bench "${args[@]}" --out "$OUT/after" 2>&1 | tail -n 20
cat "$OUT/before/bench.md" "$OUT/after/bench.md"
