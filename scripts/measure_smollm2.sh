#!/usr/bin/env bash
# What: the CPU measurements of the shipped SmolLM2-135M-Instruct head: acceptance (tau) with the
# reference tree on MT-bench, HumanEval, GSM8K and Alpaca at T = 0 and 1; batch-1 speed with the head's
# CPU tree against plain decoding and transformers (first 20 and all 80 MT-bench first turns, T = 0
# and 1); the round-cost curves (infer.roundcost); the few-row matmul kernel
# (scripts/bench_few_row_matmul.py); batch 4 and 16. Reproduces "Measured on a 2-core CPU:
# SmolLM2-135M-Instruct" in docs/performance.md and the head's MEASUREMENTS.md.
#
#   bash scripts/measure_smollm2.sh [version]   # results under runs/bench/<version>/ (default smollm2)
#
# Steps run in order of importance; each writes under runs/bench/<version>/ and rerunning skips steps
# whose results exist (the tau steps, timing-independent, continue with --resume). Needs the shared
# eval data in ../shared/data/eval; --draft is left at auto (the shipped head).
#
# Time: not timed as a whole (each step prints its seconds).
set -u
cd "$(dirname "$0")/.."
EVAL=../shared/data/eval
source scripts/run_step.sh  # run NAME CMD...
V=${1:-smollm2}
B=runs/bench/$V
# acceptance (timing-independent, so --resume continues an interrupted step): reference tree; all 80 MT-bench first turns first
run $V/tau_mt_bench_t0 python -m infer.bench --questions $EVAL/mt_bench.jsonl --limit 80 --methods eagle --batch 16 \
    --max-new-tokens 256 --depth 5 --top-k 10 --total-tokens 60 --resume --out $B/tau_mt_bench_t0
# speed at batch 1 (tree from the head's tree.json), against transformers
run $V/speed_mt_bench python -m infer.bench --questions $EVAL/mt_bench.jsonl --limit 20 --methods plain,eagle,hf \
    --max-new-tokens 256 --out $B/speed_mt_bench
run $V/speed_mt_bench80 python -m infer.bench --questions $EVAL/mt_bench.jsonl --limit 80 --methods plain,eagle,hf \
    --max-new-tokens 256 --out $B/speed_mt_bench80
for q in humaneval gsm8k alpaca; do
  run $V/tau_${q}_t0 python -m infer.bench --questions $EVAL/$q.jsonl --limit 16 --methods eagle --batch 16 \
      --max-new-tokens 256 --depth 5 --top-k 10 --total-tokens 60 --resume --out $B/tau_${q}_t0
done
run $V/tau_mt_bench_t1 python -m infer.bench --questions $EVAL/mt_bench.jsonl --limit 16 --methods eagle --batch 16 \
    --max-new-tokens 256 --temperature 1.0 --depth 5 --top-k 10 --total-tokens 60 --resume --out $B/tau_mt_bench_t1
run $V/speed_mt_bench_t1 python -m infer.bench --questions $EVAL/mt_bench.jsonl --limit 10 --methods plain,eagle \
    --max-new-tokens 256 --temperature 1.0 --out $B/speed_mt_bench_t1
run $V/speed_mt_bench80_t1 python -m infer.bench --questions $EVAL/mt_bench.jsonl --limit 80 --methods plain,eagle \
    --max-new-tokens 256 --temperature 1.0 --out $B/speed_mt_bench80_t1
run $V/roundcost python -m infer.roundcost --batch 1,4,16 --total-tokens 2,3,4,6,8,16,32 --repeats 3 --out $B/roundcost
run $V/few_row_matmul python scripts/bench_few_row_matmul.py
# tree sizes: the round-cost choice for each batch ($B/roundcost/roundcost.md)
run $V/batch4 python -m infer.bench --questions $EVAL/mt_bench.jsonl --limit 16 --methods plain,eagle --batch 4 \
    --max-new-tokens 256 --total-tokens 2 --out $B/batch4
run $V/batch16 python -m infer.bench --questions $EVAL/mt_bench.jsonl --limit 16 --methods plain,eagle --batch 16 \
    --max-new-tokens 256 --total-tokens 2 --out $B/batch16
