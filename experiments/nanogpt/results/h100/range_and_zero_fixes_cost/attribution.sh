#!/usr/bin/env bash
# The bf16, fp16 and fp8 `paper` steps at the commits given as arguments, one process per commit
# (each a `git archive <commit> scalify experiments/__init__.py experiments/nanogpt` in
# .data/v_<commit>, results left out), with bf16
# in each process as the common reference.
set -euo pipefail
B="python -m experiments.nanogpt.bench --model paper --pack-scales --isolate none --steps 10 --warmup 3 --no-plain-trace --batch-size 16"
for c in "$@"; do
  echo "## $c"
  (cd .data/v_$c && PYTHONPATH=$PWD $B --configs bf16,fp16,fp8 --out /tmp/attr_$c 2>&1 | grep -E "^\| (bf16|fp16|fp8) ")
done
