#!/usr/bin/env bash
# Trace, lower and compile time and HLO instructions of the README's recipe step (FP8_BF16)
# and of FP8 against the plain step, stock Flax GPT, on CPU (benchmarks/trace_time.py):
# the benchmark's default model (2 layers, d_model 128) and 4 layers, d_model 256.
#   bash results/cpu/compile_time/run.sh > results/cpu/compile_time/output.txt
set -euo pipefail
export PYTHONPATH=$PWD
python -m benchmarks.trace_time --variants recipe-fp8-bf16,recipe-fp8 --repeat 3
python -m benchmarks.trace_time --variants recipe-fp8-bf16,recipe-fp8 --repeat 3 --layers 4 --d-model 256
