#!/usr/bin/env bash
# The fp8 and fp16 `paper` steps with the scale barrier on (default) and off, in one process,
# with kernel classes of each compiled step from its HLO (benchmarks/kernel_classes.py).
# With BASE set to a checkout of another commit, the same configs run there too, in a
# second process on the same machine.
set -euo pipefail
OUT=${OUT:-runs/scalar_kernels}
C=${CONFIGS:-"bf16,fp8,fp8:scalify_config=scale_barrier=0,fp16,fp16:scalify_config=scale_barrier=0"}
B="-m experiments.nanogpt.bench --model paper --pack-scales --isolate none --steps 10 --warmup 3 --profile 2 --no-plain-trace --batch-size 16 --dump-hlo"
ROOT=$PWD
for d in new ${BASE:+base}; do
  src=$ROOT; [ "$d" = base ] && src=$BASE
  (cd "$src" && PYTHONPATH=$src python $B --configs "$C" --out "$OUT/$d" 2>&1 | grep -vi warn | tail -12)
  echo "== $d"; cat "$OUT/$d/bench.md"
  PYTHONPATH=$ROOT python benchmarks/kernel_classes.py $(ls "$OUT/$d"/hlo_*.txt.gz) > "$OUT/$d/kernel_classes.md"
  grep -E "^## |kernels:" "$OUT/$d/kernel_classes.md"
done
