#!/usr/bin/env bash
# The GPU check (tests/gpu, `pytest -m gpu`) on a lent device machine: no network there, its python3 has
# torch (CUDA), an older transformers, accelerate, peft, safetensors, scipy and pytest, not datasets, wandb,
# deepspeed or gguf, and at most 64 MiB travels with a call. On a GPU machine with selfdraft installed,
# `SELFDRAFT_TEST_DEVICE=cuda python -m pytest -m gpu` is the whole check; this script only carries
# what such a machine lacks.
#
#   bash scripts/gpu_check.sh prepare      # HERE (registries reachable): .whl/ (transformers) and .gpu_assets/
#   bash scripts/gpu_check.sh run          # THERE, in one device call that carries .whl and .gpu_assets:
#                                          #   run(command="bash scripts/gpu_check.sh run", carry=[".whl", ".gpu_assets"], timeout_s=540)
#
# It writes $OUT/gpu_check.json (every figure, after each test), $OUT/pytest.log (a line per test) and
# $OUT/bench/. GPU_CHECK_SECONDS bounds the pytest run (default 480); GPU_CHECK_PYTEST_ARGS adds pytest
# arguments (a -k expression to rerun what a cut-short run did not reach).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}

case "$mode" in
  prepare)
    PY=${PYTHON:-.venv/bin/python}
    # transformers 5.24 (what selfdraft is tested with): its needs are on the device image already.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl transformers==5.24.0
    HF_HUB_OFFLINE=1 "$PY" tests/gpu/assets.py .gpu_assets
    du -sh .whl .gpu_assets
    ;;
  run)
    [ -d .gpu_assets ] || { echo "no .gpu_assets: run 'bash scripts/gpu_check.sh prepare' here first and carry it"; exit 2; }
    site=/tmp/selfdraft-site
    mkdir -p "$site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    # selfdraft without installing it: its package-dir mapping (selfdraft.heads = heads/, ...) as links.
    rm -rf "$site/selfdraft" && mkdir -p "$site/selfdraft"
    for f in selfdraft/*.py; do ln -s "$PWD/$f" "$site/selfdraft/"; done
    for d in heads train inference configs; do ln -s "$PWD/$d" "$site/selfdraft/$d"; done
    OUT=${OUT:-gpu_check_out}
    mkdir -p "$OUT"
    export PYTHONPATH="$site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
      SELFDRAFT_TEST_DEVICE=${SELFDRAFT_TEST_DEVICE:-cuda} SELFDRAFT_GPU_ASSETS="$PWD/.gpu_assets" \
      SELFDRAFT_GPU_REPORT="$OUT/gpu_check.json"
    # -P: the working directory is not put first on sys.path, where the repository's own selfdraft/ folder
    # (without heads/, configs/, ...) would hide the links above. The GPU check first, then the exactness
    # suites on the device (the chi-square file last: many small sampled steps).
    timeout "${GPU_CHECK_SECONDS:-480}" python3 -P -m pytest -m gpu -v -p no:cacheprovider tests/gpu \
      tests/test_tree_session.py tests/test_decode_devices.py tests/test_greedy_exact.py tests/test_sampling_exact.py \
      ${GPU_CHECK_PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log"
    ;;
  *)
    echo "usage: bash scripts/gpu_check.sh prepare|run"; exit 2 ;;
esac
