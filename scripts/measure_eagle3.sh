#!/usr/bin/env bash
# What: an EAGLE-3 head against the shipped EAGLE-2 head on the CPU: acceptance (tau) with the
# reference tree 5/10/60 at batch 16 on the first MT-bench first turns (T = 0 with plain decoding
# beside it: greedy identity; T = 1, seed 0), HumanEval and GSM8K (T = 0), then batch-1 speed with each
# head's CPU tree, interleaved. Reproduces the "First 16 MT-bench first turns" figures of
# docs/performance.md and the EAGLE-3 head's model card; the check for a head from gpu_train_eagle3.sh.
#
#   bash scripts/measure_eagle3.sh <eagle3 head dir> [version] [mt-bench limit]   (Q=16: HumanEval / GSM8K limit)
#
# Each step writes under runs/bench/<version>/ (default e3); rerunning skips steps whose results exist,
# and an interrupted tau step continues (--resume). Time: not timed as a whole (each step prints its
# seconds). The documented runs pass a limit of 16; at the default, 80, the MT-bench tau steps alone
# are the work of scripts/measure_eagle3_mt80.sh, 80-93 min per temperature on 2 cores.
set -u
cd "$(dirname "$0")/.."
E3=${1:?usage: measure_eagle3.sh <eagle3 head dir> [version] [limit]}
V=${2:-e3}
N=${3:-80}
E2=eagle2_jax/heads/smollm2-135m-instruct
EVAL=../shared/data/eval
B=runs/bench/$V
RUN_TAIL=8
source scripts/run_step.sh  # run NAME CMD...
REF="--depth 5 --top-k 10 --total-tokens 60 --max-new-tokens 256 --batch 16 --resume"  # (tau: an interrupted step continues)
# acceptance, T = 0: both heads on the same questions (plain decoding beside the EAGLE-3 head: greedy identity)
run $V/tau_mt_bench_t0_e3 python -m infer.bench --questions $EVAL/mt_bench.jsonl --limit $N --methods plain,eagle \
    --draft $E3 $REF --out $B/tau_mt_bench_t0_e3
run $V/tau_mt_bench_t0_e2 python -m infer.bench --questions $EVAL/mt_bench.jsonl --limit $N --methods eagle \
    --draft $E2 $REF --out $B/tau_mt_bench_t0_e2
# T = 1
for h in e3 e2; do
  D=$E3; [ $h = e2 ] && D=$E2
  run $V/tau_mt_bench_t1_$h python -m infer.bench --questions $EVAL/mt_bench.jsonl --limit $N --methods eagle \
      --draft $D $REF --temperature 1.0 --seed 0 --out $B/tau_mt_bench_t1_$h
done
for q in humaneval gsm8k; do
  for h in e3 e2; do
    D=$E3; [ $h = e2 ] && D=$E2
    run $V/tau_${q}_t0_$h python -m infer.bench --questions $EVAL/$q.jsonl --limit ${Q:-16} --methods eagle --draft $D \
        $REF --out $B/tau_${q}_t0_$h
  done
done
# CPU speed, batch 1, each head's CPU tree (its tree.json), interleaved: e2, e3, e2, e3
for i in 1 2; do
  for h in e2 e3; do
    D=$E3; [ $h = e2 ] && D=$E2
    run $V/speed_${h}_$i python -m infer.bench --questions $EVAL/mt_bench.jsonl --limit 20 --methods plain,eagle \
        --draft $D --max-new-tokens 256 --out $B/speed_${h}_$i
  done
done
