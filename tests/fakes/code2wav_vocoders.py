"""Fake vocoders for code2wav worker-process tests (test doubles, not models).

A worker process rebuilds its vocoder from an importable factory path, so
these live in a module the worker can import."""

from __future__ import annotations

import numpy as np

from decoder_svc.fake_engine import FakeVocoderFactory, FakeVocoderStream


class FakeFailingStream:
    def __init__(self, inner: FakeVocoderStream) -> None:
        self.inner = inner

    def push(self, codes: np.ndarray) -> np.ndarray:
        raise RuntimeError("fake vocoder failure")


class FakeFailingVocoderFactory(FakeVocoderFactory):
    """The fake engine's vocoder, except that every chunk of `fail_voice` raises."""

    def __init__(self, fail_voice: str = "fable", **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail_voice = fail_voice

    def new_stream(self, voice: str):
        stream = super().new_stream(voice)
        return FakeFailingStream(stream) if voice == self.fail_voice else stream

    def worker_spec(self) -> tuple[str, dict]:
        path, kwargs = super().worker_spec()
        return "tests.fakes.code2wav_vocoders:FakeFailingVocoderFactory", {**kwargs, "fail_voice": self.fail_voice}
