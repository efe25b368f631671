# What: a helper sourced by scripts/measure_smollm2.sh and scripts/measure_eagle3.sh, not run on its
# own. `run NAME CMD...` runs CMD once, logging to runs/bench/NAME.log, and marks it done
# (runs/bench/NAME.done) so a rerun of the script skips it; it prints the step's seconds and the last
# RUN_TAIL (default 12) lines of its log. Time: that of the command it runs.
run() {  # name, then the command
  local name=$1; shift
  if [ -f "runs/bench/$name.done" ]; then echo "skip $name"; return; fi
  mkdir -p "runs/bench/$(dirname "$name")"
  echo "== $name: $*"; local t0=$(date +%s)
  "$@" > "runs/bench/$name.log" 2>&1 && touch "runs/bench/$name.done"
  echo "   $(( $(date +%s) - t0 ))s"; tail -n "${RUN_TAIL:-12}" "runs/bench/$name.log"
}
