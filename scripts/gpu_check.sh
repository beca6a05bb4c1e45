#!/usr/bin/env bash
# GPU checks, for a machine with an NVIDIA GPU and the project installed with
# the `cuda` extra (OMNI_EXTRAS=dev,cuda bash scripts/install.sh), run from the
# repository root:
#
#   bash scripts/gpu_check.sh
#
# 1. the GPU-marked tests (pytest marker `gpu`: tests/test_cuda_staging.py);
# 2. with 2 or more GPUs visible, tensor parallelism: tests/test_thinker_tp.py
#    (pytest marker `vllm`) runs the tiny Qwen3-Omni checkpoint's thinker with
#    tensor_parallel_size=2 and with 1, greedy, and checks the same steps,
#    tokens and captured rows (thinker_embed / thinker_hidden / hidden_states,
#    allclose), then an omni request through the decoder's pipeline with the
#    thinker on 2 GPUs (audio out); tests/test_parallel_config.py checks the
#    profile keys and the refusals (talker tensor parallelism, pipeline
#    parallelism, explicit executor backends). See docs/profiles.md, "Tensor
#    and pipeline parallelism".
#
# This script has NOT been run: it was written on a CPU-only machine (no GPU).
# Environment: PYTEST_TIMEOUT_S (default 900), TP_TIMEOUT_S (default 1200).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
PYTEST_TIMEOUT_S=${PYTEST_TIMEOUT_S:-900}
TP_TIMEOUT_S=${TP_TIMEOUT_S:-1200}

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: nvidia-smi not found: this check needs an NVIDIA GPU" >&2
    exit 2
fi
NUM_GPUS=$(nvidia-smi --list-gpus | grep -c '^GPU ' || true)
echo "gpu_check: ${NUM_GPUS} GPU(s) visible"
if [ "${NUM_GPUS}" -lt 1 ]; then
    echo "gpu_check: no GPU visible" >&2
    exit 2
fi

echo "gpu_check: GPU-marked tests"
timeout "${PYTEST_TIMEOUT_S}" "${PYTHON}" -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_staging.py

if [ "${NUM_GPUS}" -lt 2 ]; then
    echo "gpu_check: fewer than 2 GPUs: tensor parallelism checks skipped"
    exit 0
fi

echo "gpu_check: tensor parallelism (thinker tensor_parallel_size=2)"
timeout "${TP_TIMEOUT_S}" "${PYTHON}" -m pytest -q -p no:cacheprovider -m vllm \
    tests/test_thinker_tp.py tests/test_parallel_config.py
echo "gpu_check: done"
