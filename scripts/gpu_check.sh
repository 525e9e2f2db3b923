#!/usr/bin/env bash
# The prepared GPU check (issue 13), for a session lent a GPU machine (no network there; its python3 has
# torch 2.11 CUDA, transformers 5.17, accelerate, peft, safetensors, scipy, pytest; not datasets,
# wandb, deepspeed or gguf; at most 64 MiB travels).
#
#   bash scripts/gpu_check.sh prepare      # HERE (CPU, registries reachable): .whl/ and .gpu_assets/
#   bash scripts/gpu_check.sh run          # THERE, in one device call: carry .whl and .gpu_assets
#   bash scripts/gpu_check.sh smoke        # here: the same check on the CPU with tiny shapes
#
# The device call, from a session's `run` tool:
#   run(command="bash scripts/gpu_check.sh run", carry=[".whl", ".gpu_assets"], timeout_s=540)
# It writes $OUT/gpu_check.json (every figure), $OUT/log.txt and $OUT/bench/{results.json,report.md}.
# Targets there are random-weight models built from a config (the SmolLM2-135M shape with its
# tokenizer for exactness; the Llama-3.1-8B shape in bf16 for the verify-cost curve): acceptance
# lengths do not depend on the hardware and are measured on the CPU with real weights.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}

# selfdraft without installing it: its package-dir mapping (selfdraft.heads = heads/, ...) as links.
shim() {
  local root=$1
  rm -rf "$root/selfdraft" && mkdir -p "$root/selfdraft"
  for f in selfdraft/*.py; do ln -s "$PWD/$f" "$root/selfdraft/"; done
  for d in heads train inference configs; do ln -s "$PWD/$d" "$root/selfdraft/$d"; done
}

case "$mode" in
  prepare)
    PY=${PYTHON:-.venv/bin/python}
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    grep -qx '/.gpu_assets/' .git/info/exclude 2>/dev/null || echo '/.gpu_assets/' >> .git/info/exclude
    # transformers 5.24 (what selfdraft is tested with): its needs are on the device image already.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl transformers==5.24.0
    HF_HUB_OFFLINE=1 "$PY" scripts/gpu_check.py --prepare --assets .gpu_assets
    du -sh .whl .gpu_assets
    ;;
  run)
    [ -d .gpu_assets ] || { echo "no .gpu_assets: run 'bash scripts/gpu_check.sh prepare' here first and carry it"; exit 2; }
    site=/tmp/selfdraft-site
    mkdir -p "$site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    shim "$site"
    export PYTHONPATH="$site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
    OUT=${OUT:-gpu_check_out}
    mkdir -p "$OUT"
    # GPU_CHECK_DEVICE / GPU_CHECK_ARGS: to try this path elsewhere (e.g. cpu and "--tiny")
    python3 scripts/gpu_check.py --device "${GPU_CHECK_DEVICE:-cuda}" --assets .gpu_assets --out "$OUT" ${GPU_CHECK_ARGS:-} 2>&1 | tee "$OUT/log.txt"
    ;;
  smoke)
    PY=${PYTHON:-.venv/bin/python}
    OUT=${OUT:-/tmp/gpu_check_smoke}
    mkdir -p "$OUT"
    [ -d .gpu_assets ] || HF_HUB_OFFLINE=1 "$PY" scripts/gpu_check.py --prepare --assets .gpu_assets
    HF_HUB_OFFLINE=1 "$PY" scripts/gpu_check.py --device cpu --tiny --assets .gpu_assets --out "$OUT" 2>&1 | tee "$OUT/log.txt"
    ;;
  *)
    echo "usage: bash scripts/gpu_check.sh prepare|run|smoke"; exit 2 ;;
esac
