#!/usr/bin/env bash
# Measurements for the shipped SmolLM2-135M-Instruct head (issue notes / model card / README).
# Each step writes under runs/bench/; rerunning skips steps whose results exist.
set -u
cd "$(dirname "$0")/.."
H=eagle2_jax/heads/smollm2-135m-instruct
EVAL=../shared/data/eval
run() {  # name, then the command
  local name=$1; shift
  if [ -f "runs/bench/$name/results.json" ] || [ -f "runs/bench/$name.done" ]; then echo "skip $name"; return; fi
  mkdir -p runs/bench
  echo "== $name: $*"; local t0=$(date +%s)
  "$@" > "runs/bench/$name.log" 2>&1 && touch "runs/bench/$name.done"
  echo "   $(( $(date +%s) - t0 ))s"; tail -n 12 "runs/bench/$name.log"
}
run tau_mt_bench_t0 python -m infer.bench --questions $EVAL/mt_bench.jsonl --methods eagle --batch 16 \
    --max-new-tokens 256 --depth 5 --top-k 10 --total-tokens 60 --out runs/bench/tau_mt_bench_t0
for q in humaneval gsm8k alpaca; do
  run tau_${q}_t0 python -m infer.bench --questions $EVAL/$q.jsonl --limit 16 --methods eagle --batch 16 \
      --max-new-tokens 256 --depth 5 --top-k 10 --total-tokens 60 --out runs/bench/tau_${q}_t0
done
run tau_mt_bench_t1 python -m infer.bench --questions $EVAL/mt_bench.jsonl --limit 16 --methods eagle --batch 16 \
    --max-new-tokens 256 --temperature 1.0 --depth 5 --top-k 10 --total-tokens 60 --out runs/bench/tau_mt_bench_t1
run speed_mt_bench python -m infer.bench --questions $EVAL/mt_bench.jsonl --limit 10 --methods plain,eagle,hf \
    --max-new-tokens 128 --out runs/bench/speed_mt_bench
