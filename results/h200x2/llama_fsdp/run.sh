#!/bin/bash
# Llama FSDP strong scaling on one 2-GPU H200 host: bf16 against the scalify FP8 recipes,
# 1 GPU then 2 GPUs with one process each, every variant of a device count in one process.
#   OUT=... bash results/h200x2/llama_fsdp/run.sh 8b-shape 4   # preset, global batch
#   OUT=... GATHER=0 bash results/h200x2/llama_fsdp/run.sh 1b 4 bf16,fp8-head
# writes $OUT/SIZE/{llama_fsdp.json,llama_fsdp.md,log.txt}.
export PYTHONPATH=$PWD
SIZE=$1; BATCH=$2; V=${3:-bf16,fp8,fp8-head}
D=$OUT/$SIZE
B="python -m benchmarks.llama_fsdp --size $SIZE --batch $BATCH --out $D"
mkdir -p $D
nvidia-smi -L > $D/log.txt
run() { timeout ${TIMEOUT:-280} $B "$@" 2>&1 | tee -a $OUT/full.log | grep -v -i "warn\|gloo" | grep "^\[llama_fsdp\]" | tee -a $D/log.txt; }
run --variants $V --devices 1
run --variants $V --devices 2 --processes 2
# Every FP8 kernel all-gathered as E4M3 words (FSDP(mesh, fp8_gather=True)), for comparison
# (GATHER=0 leaves it out).
[ "${GATHER:-1}" = 1 ] && run --variants fp8-head --gather e4m3 --devices 2 --processes 2
cat $D/llama_fsdp.md
