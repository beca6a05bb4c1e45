#!/usr/bin/env bash
# Create .venv and install omni-serving with what its tests and default engine need.
#   bash scripts/install.sh            # dev tools + the CPU vLLM engine
#   OMNI_EXTRAS=dev bash scripts/install.sh   # without the engine (reference backend only)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${OMNI_EXTRAS:-dev,cpu}

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is required"'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
if [[ ",${EXTRAS}," != *",cuda,"* ]]; then
  # The CPU build of torch first: anything later that asks for torch finds it
  # satisfied (the cuda extra brings vLLM's own CUDA torch instead).
  "${PIP[@]}" install -q "torch==2.13.0"
fi
"${PIP[@]}" install -q -e ".[${EXTRAS}]"
if [[ ",${EXTRAS}," == *",cpu,"* ]]; then
  # PyPI's torchaudio/torchcodec are CUDA builds that break (torchvision stays:
  # see omni_common/torchvision_compat.py)
  # `import vllm` next to CPU torch; triton is useless on CPU.
  "${PIP[@]}" uninstall -q -y torchaudio torchcodec triton 2>/dev/null || true
fi
# Compiled bytecode makes `import vllm` several times faster.
env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -m compileall -q -j 2 "$VENV/lib" >/dev/null 2>&1 || true
echo "installed into $VENV (extras: $EXTRAS)"
