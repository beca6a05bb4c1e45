#!/usr/bin/env bash
# Serve the released widths on one GPU, for a host with an NVIDIA GPU and vLLM
# (the `cuda` extra), run from the repository root:
#
#   bash scripts/gpu_serve_released.sh [--layers N] [--checkpoint DIR]
#
# 1. writes a random-weight checkpoint at the released Qwen3-Omni-30B-A3B's
#    widths with N layers per stack (default 1, about 1.8 B parameters,
#    3.4 GiB in bfloat16; `omni-serving models create --preset released`)
#    into DIR unless it is there (default: the model cache's);
# 2. prints the memory plan for this GPU (`omni-serving models plan`, the
#    numbers the decoder checks before any engine starts);
# 3. serves it with every stage on the GPU (`device=cuda`, the thinker in the
#    checkpoint's bfloat16, CUDA graphs: `enforce_eager` auto, shares 0.75
#    for the thinker and 0.15 for the talker) through
#    `omni-serving bench checkpoint` at concurrency 1 and 32, which prints
#    and records TTFP, RTF, the vocoder's RTF, resident memory per process and
#    where a step goes (a results file under bench/results/, a run folder with
#    results.md).
#
# It installs the `cuda` extra into $VENV (default .venv-gpu) like
# scripts/gpu_check.sh when the venv has no vLLM that sees the GPU. Both AR
# stages run in the checkpoint's bfloat16 (dtype auto on CUDA).
# Environment: VENV, REQUESTS (per level, default 32), SERVE_TIMEOUT_S
# (default 1800), OMNI_ENGINE_SET (more engine settings, appended).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
REQUESTS=${REQUESTS:-32}
SERVE_TIMEOUT_S=${SERVE_TIMEOUT_S:-1800}
LAYERS=1
CHECKPOINT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --layers) LAYERS=${2:?--layers needs a number}; shift 2 ;;
        --checkpoint) CHECKPOINT=${2:?--checkpoint needs a directory}; shift 2 ;;
        *) echo "gpu_serve_released: unknown argument $1 (expected --layers N, --checkpoint DIR)" >&2; exit 2 ;;
    esac
done

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_serve_released: nvidia-smi not found: this script needs an NVIDIA GPU" >&2
    exit 2
fi
if ! "${VENV}/bin/python" -c 'import sys, torch, vllm; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_serve_released: installing into ${VENV} (extras dev,cuda)"
    VENV="${VENV}" OMNI_EXTRAS=dev,cuda bash scripts/install.sh
fi
CLI="${VENV}/bin/omni-serving"
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | tr -d ' ')
echo "gpu_serve_released: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), ${GPU_MIB} MiB"

if [ -z "${CHECKPOINT}" ]; then
    CHECKPOINT=$("${CLI}" models create --preset released --layers "${LAYERS}")
elif [ ! -d "${CHECKPOINT}" ]; then
    "${CLI}" models create --preset released --layers "${LAYERS}" --out "${CHECKPOINT}" >/dev/null
fi
echo "gpu_serve_released: checkpoint ${CHECKPOINT}"

# every stage on the one GPU: shares that add up (docs/deployment.md, "The memory plan")
SETTINGS="device=cuda,code2wav.device=cuda,thinker.gpu_memory_utilization=0.75,talker.gpu_memory_utilization=0.15"
export OMNI_ENGINE_SET="${SETTINGS}${OMNI_ENGINE_SET:+,${OMNI_ENGINE_SET}}"
echo "gpu_serve_released: engine settings ${OMNI_ENGINE_SET}"
"${CLI}" models plan "${CHECKPOINT}" --profile omni --gpus 1 --gpu-memory "${GPU_MIB}MiB"

timeout "${SERVE_TIMEOUT_S}" "${CLI}" bench checkpoint --checkpoint "${CHECKPOINT}" --concurrency 1,32 \
    --requests "${REQUESTS}" --slug "gpu-released-l${LAYERS}"
echo "gpu_serve_released: done"
