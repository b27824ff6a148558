#!/bin/bash
# fp16 (#1) vs bf16 kernels on paper 8 layers, batch 16, rule scopes; HLOs kept for offline analysis
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
V="fp16:scalify_config=rule_scopes=true"
B="python -m experiments.nanogpt.bench --model paper --pack-scales --isolate none --steps 10 --warmup 3 --profile 2 --dump-hlo --no-plain-trace"
mkdir -p $OUT/p8
( timeout 450 $B --batch-size 16 --configs "bf16,$V" --out $OUT/p8 ) 2>&1 | grep -v -i warn > $OUT/p8/log.txt
tail -6 $OUT/p8/log.txt
T=$(find $OUT/p8 -name "perfetto_trace.json.gz" -path "*rule_scopes*" | head -1)
H=$(ls $OUT/p8/hlo_fp16*rule_scopes*.txt.gz | head -1)
python benchmarks/profile_by_scope.py "$T" "$H" 2 --by rule > $OUT/p8/by_rule.md 2>&1
python benchmarks/profile_by_scope.py "$T" "$H" 2 > $OUT/p8/by_scope.md 2>&1
python benchmarks/kernel_classes.py $OUT/p8/hlo_bf16*.txt.gz "$H" > $OUT/p8/kernel_classes.md 2>&1
rm -rf $OUT/p8/trace_*
ls -la $OUT/p8
