#!/bin/bash
# bf16 and fp8 on d_model 2048 with the compiled programs, for benchmarks/fp8_speedup_bound.py
export PYTHONPATH=$PWD  # OUT=DIR bash run.sh, from the repository root
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
B="python -m experiments.nanogpt.bench --model paper --pack-scales --isolate none --steps 10 --warmup 3 --profile 2 --no-plain-trace"
mkdir -p $OUT/d2048
( timeout 560 $B --gpt d_model=2048 --batch-size 8 --dump-hlo --configs bf16,fp8 --out $OUT/d2048 ) 2>&1 | grep -v -i warn > $OUT/d2048/log.txt
tail -4 $OUT/d2048/log.txt
ls $OUT/d2048
python benchmarks/fp8_speedup_bound.py $OUT/d2048/bench.json --hlo $(ls $OUT/d2048/hlo_fp8*.txt* | head -1)
rm -rf $OUT/d2048/trace_*
