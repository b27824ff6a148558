#!/bin/bash
# 4-GPU step time of bf16 and fp8 (dp:bfloat16) under XLA command-buffer settings
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
mkdir -p $OUT/r
S="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --steps 10 --warmup 3 --repeats 3 --loss-steps 2 --batch-size 32 --devices 4 --configs bf16,fp8 --meshes dp:bfloat16"
i=0
for F in "" "--xla_gpu_command_buffer_update_mode=FULL_UPDATE_FREE" "--xla_gpu_enable_command_buffer="; do
  i=$((i+1))
  if XLA_FLAGS="$F" timeout 60 python -c "import jax, jax.numpy as jnp; print(jax.jit(lambda x: x + 1)(jnp.ones(3)))" > $OUT/r/probe$i.txt 2>&1; then
    echo "variant $i XLA_FLAGS='$F'"
    XLA_FLAGS="$F" timeout 125 $S --out $OUT/r/v$i 2>&1 | tee $OUT/r/log_v$i.txt | grep -E "^\[scaling\]|Error"
  else
    echo "variant $i XLA_FLAGS='$F' refused:"; tail -3 $OUT/r/probe$i.txt
  fi
done
