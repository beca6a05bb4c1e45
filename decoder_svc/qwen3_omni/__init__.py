"""Qwen3-Omni-MoE: checkpoint loading, the thinker and talker on vLLM, Code2Wav."""

import omni_common  # noqa: F401 -- installs the torchvision import shim before transformers loads
