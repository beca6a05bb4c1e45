"""Qwen3-Omni-MoE: checkpoint loading, the thinker and talker on vLLM, Code2Wav."""

from omni_common import torchvision_compat

torchvision_compat.install()  # before transformers loads (its image code imports torchvision)
