"""How the thinker's encoders read media: audio (rate, tokens per clip) and images (resize, grid, tokens)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MAX_ASPECT_RATIO", "AudioFeatures", "ImageFeatures"]


@dataclass(frozen=True)
class AudioFeatures:
    """How the thinker's audio tower reads audio (preprocessor_config.json,
    the thinker's audio_config): log-mel frames of ``hop`` samples at ``rate``
    Hz, ``n_window`` the encoder's window (its token count per frames)."""

    rate: int
    hop: int
    n_window: int

    def tokens(self, samples: int) -> int:
        """Audio tokens of a clip of ``samples`` samples (a multiple of ``hop``):
        the feature frames after the encoder's convolutions (each full window of
        2 * n_window frames gives 13 tokens)."""
        frames = samples // self.hop
        chunk = 2 * self.n_window
        rest = frames % chunk
        if rest:
            conv = (rest - 1) // 2 + 1
            tail = ((conv - 1) // 2 + 1 - 1) // 2 + 1
        else:
            tail = 0
        return tail + (frames // chunk) * 13


MAX_ASPECT_RATIO = 200
"""The image processor refuses an image whose long side is more than this many times its short side."""


@dataclass(frozen=True)
class ImageFeatures:
    """How the thinker's vision tower reads an image (preprocessor_config.json):
    resized to sides that are multiples of ``patch * merge`` within
    [``min_pixels``, ``max_pixels``], cut in ``patch``-pixel patches, every
    ``merge`` x ``merge`` of them one token."""

    patch: int
    merge: int
    min_pixels: int
    max_pixels: int

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) the processor resizes an image to (Qwen2-VL's smart resize)."""
        factor = self.patch * self.merge
        h = max(factor, round(height / factor) * factor)
        w = max(factor, round(width / factor) * factor)
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return h, w

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """The image's (t, h, w) grid of patches (one temporal patch: an image)."""
        h, w = self.resized(height, width)
        return 1, h // self.patch, w // self.patch

    def tokens(self, height: int, width: int) -> int:
        t, h, w = self.grid(height, width)
        return t * h * w // (self.merge * self.merge)
