#!/usr/bin/env bash
# What: the EAGLE-3 head against the EAGLE-2 head on all 80 MT-bench first turns, reference tree
# 5/10/60, batch 16, T = 0 (with plain decoding: greedy identity) and T = 1 (seed 0). Reproduces the
# "All 80 MT-bench first turns" figures of docs/performance.md and the EAGLE-3 head's model card.
# T = 0 first: both heads advance together, 16 questions at a time (--resume with a growing --limit),
# so wherever it stops they cover the same questions; then T = 1 the same way. Rerun to continue.
#
#   bash scripts/measure_eagle3_mt80.sh [eagle3 head] [version]    # default: the shipped EAGLE-3 head, runs/bench/e3all
#   TEMPS=1 bash scripts/measure_eagle3_mt80.sh                     # one temperature only
#
# Time: 80-93 min per temperature on a 2-core CPU, 3-4 h for both.
set -u
cd "$(dirname "$0")/.."
E3=${1:-eagle2_jax/heads/smollm2-135m-instruct-eagle3}
V=${2:-e3all}
E2=eagle2_jax/heads/smollm2-135m-instruct
Q=../shared/data/eval/mt_bench.jsonl
B=runs/bench/$V
mkdir -p "$B"
REF="--questions $Q --depth 5 --top-k 10 --total-tokens 60 --max-new-tokens 256 --batch 16 --resume"
for T in ${TEMPS:-0 1}; do
  for L in 16 32 48 64 80; do
    for h in e3 e2; do
      D=$E3; [ $h = e2 ] && D=$E2
      M=eagle; [ $h = e3 ] && [ $T = 0 ] && M=plain,eagle
      name=tau_mt_bench_t${T}_$h
      echo "== $(date +%T) $name, first $L questions"
      python -m infer.bench $REF --limit $L --methods $M --draft $D --temperature $T --seed 0 \
          --out $B/$name >> $B/$name.log 2>&1 || { echo "failed: see $B/$name.log"; exit 1; }
      tail -n 6 $B/$name/results.md
    done
  done
done
