#!/bin/bash
# Kernel profiles of the 2-GPU `dp` steps, one process per GPU (process 0 traces GPU 0),
# `paper` model, global batch 32, 3 blocking steps, with the kernels of the other streams
# that overlap each gradient-bucket concatenation (benchmarks/concurrent_kernels.py, run on
# the trace where it was written). Each folder comes back as one archive, the trace beside
# it when under 15 MB.
# Usage: OUT=... bash run.sh   (on a 2-GPU machine)
export PYTHONPATH=$PWD:$PWD/benchmarks
S="python -m experiments.nanogpt.scaling_bench --model paper --seq-len 512 --pack-scales --steps 6 --warmup 2 --repeats 1 --loss-steps 1 --profile 3 --timing blocking --batch-size 32 --devices 2 --processes 2"
run() { N=$1; T=$2; shift 2; D=$OUT/$N; mkdir -p $D; echo "== $S $* --out $D" > $D/log.txt
        timeout $T $S "$@" --out $D 2>&1 | grep -v -i "warn\|gloo" | grep "^\[scaling\]" >> $D/log.txt
        TR=$(find $D/traces -name perfetto_trace.json.gz | sort | tail -1)
        python benchmarks/concurrent_kernels.py $TR 3 'concatenate' > $D/concat.md
        [ $(stat -c %s $TR) -lt 15000000 ] && cp $TR $OUT/${N}_trace.json.gz
        rm -rf $D/traces; tar -czf $OUT/$N.tgz -C $OUT $N; rm -rf $D; }
run bf16_dp_x2 100 --configs bf16 --meshes dp
run fp8_dp-bfloat16_x2 170 --configs fp8 --meshes dp:bfloat16
ls -la $OUT
