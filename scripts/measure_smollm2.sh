#!/usr/bin/env bash
# Measurements for the shipped SmolLM2-135M-Instruct head (issue notes / model card / README).
# Each step writes under runs/bench/<version>/; rerunning skips steps whose results exist.
# usage: bash scripts/measure_smollm2.sh [version]   (steps run in order of importance)
set -u
cd "$(dirname "$0")/.."
H=eagle2_jax/heads/smollm2-135m-instruct
EVAL=../shared/data/eval
source scripts/run_step.sh  # run NAME CMD...
V=${1:-v7}  # results go to runs/bench/$V (v2: head of 240d81e, v3: rollout-trained head, v4: same head after 30cee77,
            # v6: same head with the few-row CPU matmul kernel, v7: the run-3 head, twice the data,
            # v8/v9: the run-3 head on a second, AVX2-only machine; v9 ran speed_mt_bench80, batch4, batch16
            # and speed_mt_bench_t1 only; v11: packed Q4_1/Q8_0 target weights, speed_mt_bench80, batch4,
            # batch16 and speed_mt_bench_t1 only; v12: one-uniform sampling, speed_mt_bench_t1 and
            # speed_mt_bench80_t1 (run by hand as runs/bench/v12/t1_first10, t1_all80))
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
