#!/usr/bin/env bash
# FP8 with bfloat16 activations (`fp8-bf16`) on the Llama `8b-shape` preset, beside bf16,
# Flax fp8_ops and `fp8`, each with and without its head in FP8, in one process on one H200.
#   bash results/h200/llama_8b_shape_fp8_bf16/run.sh OUT
set -uo pipefail
OUT=${1:?give an output folder}
bash "$(dirname "$0")/../llama_8b_shape/run.sh" "$OUT" bf16,flax-fp8,fp8,fp8-bf16,fp8-bf16-head,fp8-head
