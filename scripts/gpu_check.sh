#!/usr/bin/env bash
# GPU checks, for a machine with an NVIDIA GPU, run from the repository root:
#
#   bash scripts/gpu_check.sh [--torch-only]
#
# 0. First, the torch-only checks (scripts/gpu_check_torch.py: no vLLM, no
#    network, no pytest; under 5 minutes): the talker's code predictor
#    captured as CUDA graphs replays to exactly its eager results, and its
#    seeded counter-based sampler under replay (the device's noise equals
#    the CPU's, a seeded request draws the same codes replayed again and
#    among other rows of its bucket), and Code2Wav on the device (its decode
#    against the CPU's, its streams decoded together against alone), and the
#    memory plan's arithmetic against the device's allocator. They
#    run with $TORCH_PYTHON, else the
#    first of $VENV's python and python3 whose torch sees the GPU.
#    `--torch-only` stops after them: for an image that has a CUDA torch but
#    no vLLM and no network.
#
# Then installs what the rest needs from the project's own files
# (scripts/install.sh with the `cuda` extra: vLLM's CUDA build and its torch)
# into $VENV (default .venv-gpu; an existing one whose torch sees the GPU is
# reused), and runs, each bounded by a timeout (together well under 5
# minutes once installed):
#
# 1. tests/test_cuda_staging.py (marker `gpu`): the arena registered as pinned
#    host memory (cudaHostRegister), the copy stream, readiness only after
#    the copy (the slot is not ready while the copy waits behind busy compute
#    work), and a decode step's rows kept on the device through row
#    selection and the talker's codes, then staged, equal to the host run;
# 2. tests/test_step_devices.py: the same step bookkeeping on the fake
#    device (no op mixes devices, one device->host read per step);
# 3. async == sync on the device: tests/test_vllm_backend.py's
#    test_pipeline_sync_and_async_paths_give_identical_audio (marker
#    `vllm`) with the tiny models on the GPU (vLLM's CUDA build places them
#    there): the materializer path's audio equals the in-process path's.
# 4. with 2 or more GPUs: tensor parallelism (tests/test_thinker_tp.py,
#    tests/test_parallel_config.py; docs/profiles.md).
#
# The tests of 1 skip on a host without CUDA; the others also run there.
# Environment: VENV, TORCH_PYTHON, TORCH_TIMEOUT_S (default 300),
# PYTEST_TIMEOUT_S (default 240), TP_TIMEOUT_S (default 1200).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
TORCH_TIMEOUT_S=${TORCH_TIMEOUT_S:-300}
PYTEST_TIMEOUT_S=${PYTEST_TIMEOUT_S:-240}
TP_TIMEOUT_S=${TP_TIMEOUT_S:-1200}
TORCH_ONLY=0
if [ "${1:-}" = "--torch-only" ]; then
    TORCH_ONLY=1
elif [ -n "${1:-}" ]; then
    echo "gpu_check: unknown argument ${1} (expected --torch-only or nothing)" >&2
    exit 2
fi

cuda_python() {  # the first of the given pythons whose torch sees the GPU
    for py in "$@"; do
        if [ -n "${py}" ] && "${py}" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
            echo "${py}"
            return 0
        fi
    done
    return 1
}

torch_checks() {
    echo "gpu_check: torch-only checks with $1 (code predictor: CUDA graph replay == eager, the seeded sampler under replay)"
    timeout "${TORCH_TIMEOUT_S}" "$1" scripts/gpu_check_torch.py
}

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

TORCH_CHECKED=0
if TORCH_PY=$(cuda_python "${TORCH_PYTHON:-}" "${VENV}/bin/python" python3); then
    torch_checks "${TORCH_PY}"
    TORCH_CHECKED=1
elif [ "${TORCH_ONLY}" = 1 ]; then
    echo "gpu_check: no python here has a torch that sees the GPU (set TORCH_PYTHON)" >&2
    exit 2
fi
if [ "${TORCH_ONLY}" = 1 ]; then
    echo "gpu_check: done (torch-only; the vLLM checks below were not run)"
    exit 0
fi

if ! "${VENV}/bin/python" -c 'import sys, torch, vllm; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: installing into ${VENV} (extras dev,cuda)"
    VENV="${VENV}" OMNI_EXTRAS=dev,cuda bash scripts/install.sh
fi
PYTHON="${VENV}/bin/python"
"${PYTHON}" -c 'import torch; assert torch.cuda.is_available(), "torch in the venv does not see the GPU"; print("gpu_check: torch", torch.__version__, torch.cuda.get_device_name(0))'
if [ "${TORCH_CHECKED}" = 0 ]; then
    torch_checks "${PYTHON}"
fi

PYTEST=("${PYTHON}" -m pytest -q -p no:cacheprovider -x -rs)

echo "gpu_check: staging (pinned arena, copy stream, readiness) and the step's devices"
timeout "${PYTEST_TIMEOUT_S}" "${PYTEST[@]}" tests/test_cuda_staging.py tests/test_step_devices.py

echo "gpu_check: async == sync on the device (tiny models)"
timeout "${PYTEST_TIMEOUT_S}" "${PYTEST[@]}" -m vllm tests/test_vllm_backend.py \
    -k test_pipeline_sync_and_async_paths_give_identical_audio

if [ "${NUM_GPUS}" -lt 2 ]; then
    echo "gpu_check: fewer than 2 GPUs: tensor parallelism checks skipped"
    echo "gpu_check: done"
    exit 0
fi

echo "gpu_check: tensor parallelism (thinker tensor_parallel_size=2)"
timeout "${TP_TIMEOUT_S}" "${PYTEST[@]}" -m vllm tests/test_thinker_tp.py tests/test_parallel_config.py
echo "gpu_check: done"
