"""Fake vocoders for code2wav worker-process tests (test doubles, not models).

A worker process rebuilds its vocoder from an importable factory path, so
these live in a module the worker can import."""

from __future__ import annotations

import os
import time

import numpy as np

from decoder_svc.testing.fake_engine import FakeVocoderFactory, FakeVocoderStream


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


class FakeGatedStream:
    def __init__(self, inner: FakeVocoderStream, gate: str, entered: str) -> None:
        self.inner, self.gate, self.entered = inner, gate, entered

    def push(self, codes: np.ndarray) -> np.ndarray:
        open(self.entered, "a").close()
        while not os.path.exists(self.gate):
            time.sleep(0.005)
        return self.inner.push(codes)


class FakeGatedVocoderFactory(FakeVocoderFactory):
    """The fake engine's vocoder, except that a chunk of `gated_voice` holds its
    worker until the file `gate` exists (it creates `entered` first): a worker
    busy for as long as a test says. Importable by a worker process."""

    def __init__(self, gate: str, entered: str, gated_voice: str = "fable", **kwargs) -> None:
        super().__init__(**kwargs)
        self.gate, self.entered, self.gated_voice = gate, entered, gated_voice

    def new_stream(self, voice: str):
        stream = super().new_stream(voice)
        return FakeGatedStream(stream, self.gate, self.entered) if voice == self.gated_voice else stream

    def worker_spec(self) -> tuple[str, dict]:
        _, kwargs = super().worker_spec()
        return "tests.fakes.code2wav_vocoders:FakeGatedVocoderFactory", {
            **kwargs, "gate": self.gate, "entered": self.entered, "gated_voice": self.gated_voice}
