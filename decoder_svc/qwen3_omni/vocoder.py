"""The checkpoint's Code2Wav as the generation stage's vocoder, and how a worker rebuilds it.

``CheckpointVocoder`` puts the Qwen3-Omni Code2Wav (``.code2wav``) behind the
streaming-vocoder interface of ``decoder_svc.code2wav`` (``new_stream``,
``voices``, ``sample_rate``, ``num_codebooks``, ``codebook_size``; and
``push_many``, one forward for the next chunk of many streams), from the
checkpoint directory alone (read only). A code2wav worker process rebuilds it
from ``worker_spec()``: an importable factory path and keyword arguments,
nothing of torch pickled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .code2wav import SAMPLE_RATE, Code2Wav, Code2WavStream
from .code2wav_batch import push_many


class _NumpyStream:
    """A Code2WavStream behind the generation stage's numpy interface."""

    def __init__(self, stream: Code2WavStream) -> None:
        self._stream = stream

    def push(self, codes: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(codes, dtype=np.int64))
        return self._stream.push(t).numpy()


# OpenAI's voice names -> Qwen3-Omni's speakers (Chelsie: female; Ethan and
# Aiden: male), so that clients written for OpenAI's speech and chat APIs
# work unchanged; a model's own voice of the same name wins
# (omni_common.voices). docs/gateway.md lists the table.
OPENAI_VOICES = {
    "alloy": "chelsie", "ash": "aiden", "ballad": "ethan", "cedar": "ethan", "coral": "chelsie", "echo": "ethan",
    "fable": "aiden", "marin": "chelsie", "nova": "chelsie", "onyx": "ethan", "sage": "chelsie",
    "shimmer": "chelsie", "verse": "aiden",
}


class StreamingVocoder:
    """A streaming codec decoder (``.code2wav.CodecDecoder``) behind the
    generation stage's interface: ``new_stream``, ``push_many``, the facts
    (``voices``, ``sample_rate``, ``num_codebooks``, ``codebook_size``,
    ``frames_per_second``) and ``worker_spec`` (``FACTORY``: the subclass's
    importable path, built again in a code2wav worker from the checkpoint
    directory, its voices, device and dtype)."""

    FACTORY = ""
    model: Any

    def _setup(self, model: Any, model_dir: str, voices: Sequence[str], device: str, dtype: str,
               aliases: dict[str, str]) -> None:
        self.model = model
        self.model_dir, self.device, self.dtype = str(model_dir), str(device), str(dtype)
        self.voices = tuple(voices)
        self.voice_aliases = {alias: v for alias, v in aliases.items() if v in self.voices}
        self.sample_rate = int(getattr(model, "sample_rate", SAMPLE_RATE))
        self.num_codebooks = int(model.num_quantizers)
        self.frames_per_second = self.sample_rate / int(model.samples_per_frame)
        self.codebook_size = int(model.codebook_size)

    def new_stream(self, voice: str) -> _NumpyStream:  # the voice is in the codes already
        return _NumpyStream(self.model.new_stream())

    def push_many(self, streams: Sequence[_NumpyStream], blocks: Sequence[np.ndarray]) -> list[np.ndarray]:
        """``push`` of each stream's block, in one forward over all of them
        (``.code2wav_batch.push_many``; a bad block raises ``InvalidRow``
        naming it before any stream changed)."""
        codes = [torch.from_numpy(np.ascontiguousarray(b, dtype=np.int64)) for b in blocks]
        return [a.numpy() for a in push_many([s._stream for s in streams], codes)]

    def worker_spec(self) -> tuple[str, dict[str, Any]]:
        return (self.FACTORY, {"model_dir": self.model_dir, "voices": [str(v) for v in self.voices],
                               "device": self.device, "dtype": self.dtype})


class CheckpointVocoder(StreamingVocoder):
    """The checkpoint's Code2Wav behind the generation stage's streaming
    interface, built from the checkpoint directory alone (read only): what a
    code2wav worker process rebuilds from ``worker_spec()``. Same arithmetic
    as the engine's vocoder: the same tensors, the same stream."""

    FACTORY = "decoder_svc.qwen3_omni.vocoder:CheckpointVocoder"

    def __init__(self, model_dir: str, voices: Sequence[str], checkpoint: Any = None, *, device: str = "cpu",
                 dtype: str = "float32") -> None:
        """model_dir: the checkpoint directory; checkpoint: the same, already
        open (the decoder's engine has it), else it is opened here; device
        and dtype: where its weights live and what they compute in (the
        generation stage's resolved settings,
        ``decoder_svc.engine_settings.resolve_vocoder``); audio comes back
        as float32 on the host."""
        if checkpoint is None:
            from decoder_svc.qwen3_omni.checkpoint import OmniCheckpoint

            checkpoint = OmniCheckpoint.open(model_dir)
        model = Code2Wav.from_config_and_tensors(checkpoint.code2wav_config, checkpoint.tensors("code2wav."),
                                                 device=str(device), dtype=getattr(torch, str(dtype)))
        self._setup(model, str(checkpoint.path), voices, device, dtype, OPENAI_VOICES)


def worker_spec(model_dir: str | Any, voices: Sequence[str], *, device: str = "cpu",
                dtype: str = "float32") -> tuple[str, dict[str, Any]]:
    """How a code2wav worker process rebuilds the vocoder of the checkpoint in
    `model_dir` (factory path, keyword arguments; nothing of torch pickled)."""
    return (
        CheckpointVocoder.FACTORY,
        {"model_dir": str(model_dir), "voices": [str(v) for v in voices], "device": device, "dtype": dtype},
    )
