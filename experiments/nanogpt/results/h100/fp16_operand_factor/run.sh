#!/usr/bin/env bash
# float16 GEMMs writing float16 (narrow_dot_bound_factor=operand) against the float32
# accumulator (=output) on the `paper` step, one process, with bf16 and fp8; then the same
# recipes on the code before (a `git archive 8434828` in .data/base), in a second process.
# Run with operand_factor.patch applied (`git apply operand_factor.patch`): the config
# field it adds is not part of the library.
set -euo pipefail
OUT=$(realpath -m "${OUT:-runs/fp16_operand_factor}")
mkdir -p "$OUT/base"
B="python -m experiments.nanogpt.bench --model paper --pack-scales --isolate none --steps 10 --warmup 3 --no-plain-trace --batch-size 16"
PYTHONPATH=$PWD $B --profile 2 --dump-hlo \
  --configs bf16,fp16,fp16:scalify_config=narrow_dot_bound_factor=output,fp8 --out "$OUT" 2>&1 | grep -vi warn | tail -8
PYTHONPATH=$PWD python benchmarks/kernel_classes.py "$OUT"/hlo_*.txt.gz > "$OUT/kernel_classes.md"
grep -E "^## |kernels:" "$OUT/kernel_classes.md" || true
grep -E "^###|kernels per step" "$OUT/profile.md" || true
(cd .data/base && PYTHONPATH=$PWD $B --configs bf16,fp16,fp8 --out "$OUT/base" 2>&1 | grep -vi warn | tail -6)
