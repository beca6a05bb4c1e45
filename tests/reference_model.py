"""The reference implementation (transformers' Qwen3-Omni-MoE) as the parity
tests load it: the checkpoint with the torchvision shim installed first, and
the model, tokenizer and processor in float32."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch


def with_shim(checkpoint: Path) -> Path:
    """``checkpoint``, once the torchvision shim is installed (before transformers loads)."""
    from omni_common import torchvision_compat

    torchvision_compat.install()
    return checkpoint


def load_reference(checkpoint: Path) -> SimpleNamespace:
    """model, tok (the tokenizer), proc (the processor: audio and images), cfg."""
    from transformers import AutoProcessor, AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    return SimpleNamespace(model=model, tok=AutoTokenizer.from_pretrained(str(checkpoint)), cfg=model.config,
                           proc=AutoProcessor.from_pretrained(str(checkpoint)))
