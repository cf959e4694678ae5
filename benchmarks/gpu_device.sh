#!/bin/bash
# On a bare GPU machine: join the parts that benchmarks/gpu_payload.py made (in $PARTS, default /tmp/parts), unpack
# and install them, run benchmarks/gpu.py (arguments are passed on) and pack its results folder into
# $OUT/gpu-results.tar. Run from the repository's root:  bash benchmarks/gpu_device.sh [gpu.py arguments]
set -u
PARTS=${PARTS:-/tmp/parts}
PAYLOAD=${PAYLOAD:-/tmp/dpl-payload}
PYTHON=${PYTHON:-python3}
RESULTS=${RESULTS:-benchmarks/results/gpu}
OUT=${OUT:-/tmp/out}
start=$(date +%s)
say() { echo "[device $(( $(date +%s) - start )) s] $*"; }

mkdir -p "$PAYLOAD" "$OUT"
if [ ! -d "$PAYLOAD/site" ]; then
  cat $(ls "$PARTS"/p* | sort -V) > "$PAYLOAD.tar.xz" || { say "no parts in $PARTS"; exit 2; }
  "$PYTHON" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$PAYLOAD.tar.xz" "$PAYLOAD" \
    || { say "the parts do not join into the payload"; exit 2; }
  rm -f "$PAYLOAD.tar.xz"
  say "unpacked $(du -sh "$PAYLOAD" | cut -f1)"
fi
if ls "$PAYLOAD"/wheels/*.whl >/dev/null 2>&1; then
  "$PYTHON" -m pip install --quiet --no-deps --no-index "$PAYLOAD"/wheels/*.whl 2>&1 | tail -3
fi
# dpl itself, for its plugins' entry points (skipped where this checkout is installed already)
"$PYTHON" -c "import dpl_plugins" 2>/dev/null \
  || "$PYTHON" -m pip install --quiet --no-deps --no-index --no-build-isolation . 2>&1 | tail -3
if [ -d "$PAYLOAD/data" ] && [ ! -e ../shared/data ]; then
  mkdir -p ../shared && ln -s "$PAYLOAD/data" ../shared/data
fi
say "installed"
export PYTHONPATH="$PAYLOAD/site${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PYTHON" benchmarks/gpu.py --out "$RESULTS" "$@" 2>&1 | tee "$OUT/gpu.log" | grep -E "^\[|budget|wrote"
status=${PIPESTATUS[0]}
tar cf "$OUT/gpu-results.tar" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
say "gpu.py exited $status; results in $OUT/gpu-results.tar"
exit "$status"
