#!/usr/bin/env bash
# GPU step time and kernel profile of the scalified NanoGPT step (paper widths, 2 layers)
# for several ScalifyConfig.scale_barrier depths, plus the bf16 baseline. Run on the device:
#   bash benchmarks/scale_barrier_gpu.sh OUT_DIR [BARRIERS] [LAYERS]
# Writes OUT_DIR/scale_barrier_gpu.md (each run's bench.md and profile.md).
set -u
out=${1:?output directory}; barriers=${2:-"1 4 8 0"}; layers=${3:-2}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$out"
first=1
for b in $barriers; do
  configs=fp8; [ $first = 1 ] && configs=bf16,fp8; first=0
  SCALIFY_SCALE_BARRIER=$b python -m experiments.nanogpt.bench --model paper --gpt n_layers=$layers \
    --seq-len 512 --batch-size 16 --steps 10 --warmup 3 --configs $configs --isolate none \
    --no-plain-trace --profile 3 --out "runs/barrier$b" 2>&1 | grep "^\[bench\]"
  { echo "## SCALIFY_SCALE_BARRIER=$b"; echo; cat "runs/barrier$b/bench.md" "runs/barrier$b/profile.md"; } \
    >> "$out/scale_barrier_gpu.md"
done
