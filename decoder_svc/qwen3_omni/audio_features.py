"""How the thinker's audio tower reads audio: its input rate and token count per clip."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AudioFeatures"]


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
