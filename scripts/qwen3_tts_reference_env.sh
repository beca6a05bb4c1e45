#!/usr/bin/env bash
# The Qwen3-TTS reference implementation's environment (for scripts/gen_golden_qwen3_tts.py):
# qwen-tts 0.1.1 with the transformers it pins, on the project's CPU torch.
#   bash scripts/qwen3_tts_reference_env.sh DIR
# torchaudio (needed only by the reference's 25 Hz tokenizer) is left out: no wheel matches this torch.
set -euo pipefail
dir=${1:?usage: qwen3_tts_reference_env.sh DIR}
python3.11 -m venv "$dir"
"$dir/bin/pip" install -q torch==2.13.0
"$dir/bin/pip" install -q transformers==4.57.3 accelerate==1.12.0 librosa soundfile sox onnxruntime einops safetensors numpy
"$dir/bin/pip" install -q --no-deps qwen-tts==0.1.1
"$dir/bin/python" -c "import qwen_tts" 2>/dev/null || true
echo "$dir"
