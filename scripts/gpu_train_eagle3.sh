#!/usr/bin/env bash
# What: EAGLE-3 data and training on a lent GPU in one call (docs/training.md, "On a lent GPU"):
# self-distilled responses for every training prompt written by our batched decoder (greedy, plus one
# sample per prompt at temperature 1), an EAGLE-3 head trained on them there (continuing from the
# shipped one, --steps auto so the schedule ends with the time limit), and its bf16 export brought
# back in $OUT/head (default runs/gpu_e3). Measure it on the CPU afterwards (scripts/measure_eagle3.sh)
# and ship it only if it beats the shipped head.
#
#   bash scripts/gpu_bench.sh prepare          # here, once: .gpu/whl (gguf wheel), .gpu/a, .gpu/b (the GGUF halves)
#   bash scripts/gpu_train_eagle3.sh prepare   # here, once: .gpu/shared (the train/ and eval/ prompt files)
#   device: "bash scripts/gpu_train_eagle3.sh a"   carrying .gpu/a          (leaves half the GGUF in /tmp/model)
#   device, at once: "bash scripts/gpu_train_eagle3.sh b"   carrying .gpu/whl .gpu/b .gpu/shared
#
# (gpu_bench.sh's call a also leaves that half, so b can follow it instead.) Every step runs under
# `timeout` within BUDGET seconds; the data are written shard by shard and training stops at its time
# limit and exports, so the call always brings back what it made. A dry run here, on the CPU:
#   OUT=runs/gpu_e3_dry GGUF=<the .gguf> SHARED=../shared/data PROMPTS=12 NEW=16 BATCH=4 HELDOUT=4 TRAIN_BATCH=2 \
#     TRAIN_MIN=0.5 BUDGET=900 bash scripts/gpu_train_eagle3.sh b
#
# Time: call b is sized to BUDGET=560 s (one call of under 10 minutes on one H200): 45% of
# what is left for the greedy data, 25% of the rest for the temperature-1 data, then training for all but
# 90 s of the rest (left for the export). Call a takes seconds. Only dry-run on a CPU so far; no GPU has run it.
set -u
PHASE=${1:?usage: gpu_train_eagle3.sh prepare|a|b}
if [ "$PHASE" = prepare ]; then
  set -e
  mkdir -p .gpu/shared/train .gpu/shared/eval
  cp ../shared/data/train/* .gpu/shared/train/
  cp ../shared/data/eval/* .gpu/shared/eval/
  du -sh .gpu/shared
  exit 0
fi
if [ "$PHASE" = a ]; then
  mkdir -p /tmp/model && cp .gpu/a/model.part /tmp/model/a.part && echo "half a in /tmp/model"
  exit 0
fi
OUT=${OUT:-runs/gpu_e3}
mkdir -p "$OUT" /tmp/e3
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=20 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
if [ -z "${GGUF:-}" ]; then
  if [ ! -f /tmp/model/a.part ]; then echo "no /tmp/model/a.part: run call a on this machine first"; exit 3; fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
  GGUF=/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf
  cat /tmp/model/a.part .gpu/b/model.part > "$GGUF"
  md5sum "$GGUF"  # a1231443440b107ff29f02bdb38c9d0a
fi
SHARED=${SHARED:-.gpu/shared}
BUDGET=${BUDGET:-560}          # seconds for the whole call
PROMPTS=${PROMPTS:-100000}     # all of them (4,875 fit the 384-token prompt cap)
NEW=${NEW:-256}
BATCH=${BATCH:-256}
left() { echo $(( BUDGET - SECONDS )); }
stamp() { echo "=== [$SECONDS s] $*"; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

stamp "greedy responses for every training prompt (batched plain decoding, float32)"
timeout $(( $(left) * 45 / 100 )) python3 -m train.data --target "$GGUF" --shared-data "$SHARED" --out /tmp/e3/greedy \
  --max-prompts $PROMPTS --max-new-tokens $NEW --batch-size $BATCH --shard-size $BATCH
stamp "one sample per prompt at temperature 1"
timeout $(( $(left) * 25 / 100 )) python3 -m train.data --target "$GGUF" --shared-data "$SHARED" --out /tmp/e3/t1 \
  --max-prompts $PROMPTS --max-new-tokens $NEW --batch-size $BATCH --shard-size $BATCH --temperature 1.0 --seed 1
DATA=/tmp/e3/greedy
ls /tmp/e3/t1/shard_*.npz >/dev/null 2>&1 && DATA=$DATA,/tmp/e3/t1
ls /tmp/e3/greedy/shard_*.npz | wc -l; ls /tmp/e3/t1/shard_*.npz 2>/dev/null | wc -l
cp /tmp/e3/greedy/meta.json "$OUT/data_meta.json" 2>/dev/null

# training: the target's features computed in each step (no disk cache), as many steps as fit in the time
# limit (--steps auto: the cosine decay ends with the time), then export
TRAIN_MIN=${TRAIN_MIN:-$(python3 -c "print(max(0.5, ($(left) - 90) / 60))")}
stamp "train the EAGLE-3 head for $TRAIN_MIN min from the shipped one ($DATA)"
timeout $(( $(left) - 5 )) python3 -m train.draft --config configs/smollm2-135m-instruct.yaml --target "$GGUF" \
  --arch eagle3 --rollout 5 --init-from eagle2_jax/heads/smollm2-135m-instruct-eagle3 --data "$DATA" \
  --feature-cache false --batch-size ${TRAIN_BATCH:-32} --lr 5e-4 --warmup-steps 10 --steps auto \
  --time-limit "$TRAIN_MIN" --heldout-examples ${HELDOUT:-32} --log-every 20 --ckpt-every 1000000 --eval-every 1000000 --eval-tau-prompts 0 \
  --out /tmp/e3/run --export "$OUT/head"
cp /tmp/e3/run/log.jsonl "$OUT/train_log.jsonl" 2>/dev/null
ls -la "$OUT/head" 2>/dev/null
stamp "done"
