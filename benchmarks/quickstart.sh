#!/bin/bash
# The quickstart as shipped: R unseeded DP runs (epsilon = 8) and one non-private reference (sigma = 0, same
# clipping), each a plain `dpl fit`; prints val_acc, wall-clock and CPU time (user + sys) of every run.
#   bash benchmarks/quickstart.sh            # R = 3
#   R=1 bash benchmarks/quickstart.sh -- --trainer.max_epochs 1   # extra dpl arguments after --
#   PARALLEL=1 bash benchmarks/quickstart.sh                      # the runs side by side
# Wall-clock depends on the machine's load; CPU time much less so (report both).
set -euo pipefail
cd "$(dirname "$0")/.."
R=${R:-3}
OUT=${OUT:-/tmp/dpl-quickstart-bench}
if [ "${1:-}" = "--" ]; then shift; fi
mkdir -p "$OUT"
run() {
  local name=$1; shift
  /usr/bin/time -f "%e %U %S" -o "$OUT/$name.time" dpl fit --config configs/quickstart.yaml \
    --trainer.default_root_dir "$OUT/$name" --trainer.enable_checkpointing false "$@" > "$OUT/$name.log" 2>&1
  read -r wall user sys < "$OUT/$name.time"
  local summary; summary=$(grep -o 'val_acc=[0-9.]*' "$OUT/$name.log" | tail -1)
  local eps; eps=$(grep -o 'epsilon=[0-9.inf]*' "$OUT/$name.log" | tail -1)
  printf "%-12s %-14s %-16s wall %6.1f s  cpu %6.1f s\n" "$name" "$eps" "$summary" "$wall" "$(echo "$user + $sys" | bc)"
}
if [ -n "${PARALLEL:-}" ]; then  # all runs at once (same CPU time, less wall-clock on an idle multi-core machine)
  for i in $(seq 1 "$R"); do run "dp_$i" "$@" & done
  run "nonprivate" --model.init_args.privacy.noise_multiplier 0 "$@" &
  wait
else
  for i in $(seq 1 "$R"); do run "dp_$i" "$@"; done
  run "nonprivate" --model.init_args.privacy.noise_multiplier 0 "$@"
fi
