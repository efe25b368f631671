#!/usr/bin/env bash
# What: the Llama-3.1-8B-shape programs (random bf16 weights, tree 5/10/N) compiled by XLA for a GPU
# or TPU on this machine with neither attached (deviceless): HBM bytes and kernels of the fused
# programs beside the pre-optimisation figures, at batch 1/4/16, 64- and 4,096-token prompts, XLA and
# Pallas attention (infer.roundcost --analytic --compile-for). Reproduces the figures of "Compiled for
# an H200 without a GPU" and "Compiled for a TPU v6e without a TPU" in docs/performance.md.
#
# How: it needs the compiler plugin matching jax, best in an environment of its own so that nothing
# else here tries that backend (any folder will do for the environment):
#   GPU (h200, h100): python -m venv --system-site-packages /tmp/gpuenv &&
#                     /tmp/gpuenv/bin/pip install --no-deps jax-cuda13-plugin==<jax> jax-cuda13-pjrt==<jax>
#                     (and ptxas on PATH, from a CUDA toolkit)
#   TPU (tpu-v6e):    python -m venv --system-site-packages /tmp/tpuenv && /tmp/tpuenv/bin/pip install 'jax[tpu]'
#   PY=/tmp/gpuenv/bin/python bash scripts/analytic_compiled.sh h200 [out dir]     # -> runs/analytic_h200/
#   PY=/tmp/tpuenv/bin/python bash scripts/analytic_compiled.sh tpu-v6e [out dir]  # -> runs/analytic_tpu_v6e/
# Each shape writes <name>.md (the report), <name>.json, <name>.err (stderr) and <name>.hlo/ (the
# compiled programs' HLO) under the out dir. Resumable: a shape whose JSON exists is skipped.
#
# Time: h200, all seven shapes 5-7 min (docs/performance.md); TPU 4-11 min per shape and tree size
# on 2 cores.
set -euo pipefail
PY=${PY:-python}
FOR=${1:?usage: analytic_compiled.sh h200|h100|tpu-v6e|tpu-v5e [out dir]}
OUT=${2:-runs/analytic_${FOR/-v/_v}}
mkdir -p "$OUT"
export JAX_PLATFORMS=cpu PYTHONPATH=${PYTHONPATH:-.}
if [[ $FOR == tpu-* ]]; then
  export TPU_SKIP_MDS_QUERY=1 ALLOW_MULTIPLE_LIBTPU_LOAD=1 TPU_ACCELERATOR_TYPE=${TPU_ACCELERATOR_TYPE:-v6e-4} \
         TPU_WORKER_HOSTNAMES=${TPU_WORKER_HOSTNAMES:-localhost}
fi
one() {  # name, then roundcost flags
  local name=$1; shift
  [[ -s "$OUT/$name.json" ]] && { echo "skip $name"; return; }
  "$PY" -m infer.roundcost --analytic --model random:llama-3.1-8b --dtype bfloat16 --depth 5 --top-k 10 \
      --max-new-tokens 256 --tau 4.5 --accelerator "$FOR" --compile-for "$FOR" "$@" \
      --dump-hlo "$OUT/$name.hlo" --json "$OUT/$name.json.tmp" 2> "$OUT/$name.err" | tee "$OUT/$name.md"
  mv "$OUT/$name.json.tmp" "$OUT/$name.json"
}
one b1_p64_n60 --batch 1 --prompt-len 64 --total-tokens 60
one b1_p4k_n60 --batch 1 --prompt-len 4096 --total-tokens 60
one b1_p4k_n60_pallas --batch 1 --prompt-len 4096 --total-tokens 60 --attention pallas
one b4_p64 --batch 4 --prompt-len 64 --total-tokens 16,60
one b16_p64 --batch 16 --prompt-len 64 --total-tokens 16,60
one b1_p64_n60_pallas --batch 1 --prompt-len 64 --total-tokens 60 --attention pallas
one b4_p4k_pallas --batch 4 --prompt-len 4096 --total-tokens 16,60 --attention pallas
