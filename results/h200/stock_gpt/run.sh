#!/usr/bin/env bash
# The stock Flax GPT (benchmarks/stock_gpt.py) on one H200: bf16, Flax's FP8 ops and the
# scalify recipes fp16, fp8, fp8-fp16-state, side by side in one process per size.
#   OUT=... [SIZES="d1024 d2048 d4096"] [PROFILE=3] bash results/h200/stock_gpt/run.sh [STEPS] [REPEATS]
# PROFILE=N: N more steps per variant under the profiler (kernels by category, profile_*.md).
# Each size is its own process (a fresh device); its files are rewritten after every variant,
# so a run stopped part-way keeps the variants done.
# Writes $OUT/<size>/stock_gpt.{json,md} and $OUT/<size>/log.txt, and $OUT/stock_gpt.md (all tables).
set -uo pipefail
: "${OUT:?set OUT}"
STEPS=${1:-20}
REPEATS=${2:-3}
export PYTHONPATH=$PWD
rm -f "$OUT/stock_gpt.md"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__)"
for size in ${SIZES:-d1024 d2048 d4096}; do
  mkdir -p "$OUT/$size"
  start=$SECONDS
  python -m benchmarks.stock_gpt --size "$size" --recipes bf16,flax-fp8,fp16,fp8,fp8-fp16-state \
    --warmup 5 --steps "$STEPS" --repeats "$REPEATS" --profile "${PROFILE:-0}" --out "$OUT/$size" 2>&1 \
    | grep -v -i warn > "$OUT/$size/log.txt"
  rc=${PIPESTATUS[0]}
  echo "[run.sh] $size: exit $rc, $((SECONDS - start)) s"
  if [ "$rc" -ne 0 ]; then tail -n 25 "$OUT/$size/log.txt"; else grep "^\[stock_gpt\] [^ ]*:" "$OUT/$size/log.txt"; fi
  cat "$OUT/$size/stock_gpt.md" >> "$OUT/stock_gpt.md" 2>/dev/null
done
cat "$OUT/stock_gpt.md"
