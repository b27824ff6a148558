#!/usr/bin/env bash
# The `paper` step with the drift guards' zero handling (all-zero data to ZERO_SCALE):
# bf16, fp8, fp16 in one process, kernels and HLO kernel classes.
set -euo pipefail
OUT=${OUT:-runs/zero_scale_guards}
PYTHONPATH=$PWD python -m experiments.nanogpt.bench --model paper --pack-scales --isolate none --steps 10 \
  --warmup 3 --profile 2 --no-plain-trace --batch-size 16 --dump-hlo --configs bf16,fp8,fp16 --out "$OUT" 2>&1 | grep -vi warn | tail -6
PYTHONPATH=$PWD python benchmarks/kernel_classes.py "$OUT"/hlo_*.txt.gz > "$OUT/kernel_classes.md"
grep -E "^## |kernels:" "$OUT/kernel_classes.md"
grep -E "^###|kernels per step" "$OUT/profile.md"
