"""`FakeDecoder`: a test double of `DecoderService`, NOT a decoder.

A real grpc.aio server on a Unix socket whose servicer replays deterministic
audio chunks (a function of prompt, voice, seed and chunk index), records
`Abort` calls and the requests it saw, and can be told to be slow. A target
with nothing listening (`absent_target`) stands in for a decoder that is down.

`BackgroundLoop` runs an event loop on a thread so tests (which have no
pytest-asyncio) can host real servers and call them with blocking clients.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np

from omni_serving.v1 import (
    common_pb2,
    decoder_pb2,
    decoder_pb2_grpc,
    payload_pb2,
    tensor_pb2,
)

T = TypeVar("T")

FAKE_VOICES = ("alice", "bob")
FAKE_SAMPLE_RATE = 24000


class BackgroundLoop:
    """An asyncio event loop running on a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        """Run `coro` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()


def fake_audio(request: decoder_pb2.GenerateRequest, chunk_index: int, samples: int) -> np.ndarray:
    """Deterministic float32 samples in [-1, 1] for one chunk of one request."""
    seed = request.sampling_params.seed if request.sampling_params.HasField("seed") else 0
    key = f"{request.prompt}|{request.voice}|{seed}|{chunk_index}".encode()
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
    t = np.arange(samples, dtype=np.float64) + chunk_index * samples
    tone = 0.5 * np.sin(2 * np.pi * 220.0 * t / FAKE_SAMPLE_RATE)
    return np.clip(tone + 0.1 * rng.standard_normal(samples), -1.0, 1.0).astype(np.float32)


def audio_payload(
    audio: np.ndarray, sample_rate: int = FAKE_SAMPLE_RATE
) -> payload_pb2.MultimodalPayload:
    """A decoder `multimodal_output` carrying one audio chunk."""
    payload = payload_pb2.MultimodalPayload()
    payload.tensors.add(
        name="audio",
        tensor=tensor_pb2.TensorRef(
            dtype=tensor_pb2.D_TYPE_FLOAT32,
            shape=[audio.shape[0]],
            inline_data=np.ascontiguousarray(audio, dtype="<f4").tobytes(),
        ),
    )
    payload.metadata["sample_rate"].int_value = sample_rate
    return payload


Script = Callable[[decoder_pb2.GenerateRequest], Sequence[decoder_pb2.GenerateResponse]]


@dataclass
class FakeDecoderConfig:
    """How the fake behaves; tests may change fields while it runs."""

    num_chunks: int = 4
    chunk_samples: int = 480
    delay_s: float = 0.0
    """Sleep before each chunk (a slow decoder)."""
    voices: tuple[str, ...] = FAKE_VOICES
    voice_aliases: dict[str, str] = field(default_factory=dict)  # GetDecoderInfo's, as given
    supports_instructions: bool = False  # GetDecoderInfo's: a text stage (instructions, conversations)
    sample_rate: int = FAKE_SAMPLE_RATE
    script: Script | None = None
    """If set, replay these responses instead of generated audio."""
    fail_after: int | None = None
    """End the stream with `fail_code` after this many messages (a decoder that breaks)."""
    fail_code: grpc.StatusCode = grpc.StatusCode.INTERNAL


@dataclass
class FakeDecoderState:
    """What the fake observed (read from the test thread)."""

    requests: list[decoder_pb2.GenerateRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    active: set[str] = field(default_factory=set)
    cancelled: list[str] = field(default_factory=list)


def fake_prompt_tokens(request: decoder_pb2.GenerateRequest) -> int:
    """The fake's prompt token count: the prompt's words (it has no tokenizer)."""
    return len(request.prompt.split())


class FakeDecoderServicer(decoder_pb2_grpc.DecoderServiceServicer):
    """Replays deterministic outputs; a test double, not a decoder."""

    def __init__(self, config: FakeDecoderConfig, state: FakeDecoderState) -> None:
        self.config = config
        self.state = state

    def _responses(
        self, request: decoder_pb2.GenerateRequest
    ) -> list[decoder_pb2.GenerateResponse]:
        if self.config.script is not None:
            return list(self.config.script(request))
        n = self.config.num_chunks
        out = []
        for i in range(n):
            out.append(
                decoder_pb2.GenerateResponse(
                    request_id=request.request_id,
                    stage_id=2,
                    multimodal_output=audio_payload(
                        fake_audio(request, i, self.config.chunk_samples), self.config.sample_rate
                    ),
                    metrics=common_pb2.RequestMetrics(num_steps=i + 1, prompt_tokens=fake_prompt_tokens(request)),
                )
            )
        out.append(
            decoder_pb2.GenerateResponse(
                request_id=request.request_id,
                stage_id=2,
                finished=True,
                finish_reason="stop",
                metrics=common_pb2.RequestMetrics(num_steps=n, prompt_tokens=fake_prompt_tokens(request)),
            )
        )
        return out

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        rid = request.request_id
        self.state.requests.append(request)
        self.state.active.add(rid)
        try:
            for sent, response in enumerate(self._responses(request)):
                if sent == self.config.fail_after:
                    await context.abort(self.config.fail_code, "fake decoder failure (test)")
                if self.config.delay_s:
                    await asyncio.sleep(self.config.delay_s)
                if rid in self.state.aborts:
                    await context.abort(grpc.StatusCode.ABORTED, f"request {rid!r} aborted")
                await context.write(response)
        except asyncio.CancelledError:
            self.state.cancelled.append(rid)
            raise
        finally:
            self.state.active.discard(rid)

    async def Abort(self, request, context):  # noqa: N802
        self.state.aborts.extend(request.request_ids)
        running = [rid for rid in request.request_ids if rid in self.state.active]
        return decoder_pb2.AbortResponse(aborted_request_ids=running)

    async def GetDecoderInfo(self, request, context):  # noqa: N802
        return decoder_pb2.GetDecoderInfoResponse(
            profile="fake",
            engine="fake",
            voices=list(self.config.voices),
            voice_aliases=self.config.voice_aliases,
            supports_instructions=self.config.supports_instructions,
            sample_rate_hz=self.config.sample_rate,
            active_requests=len(self.state.active),
        )


class FakeDecoder:
    """A FakeDecoderServicer served on a Unix socket from its own background loop."""

    def __init__(self, socket_path: Path, config: FakeDecoderConfig | None = None) -> None:
        self.socket_path = socket_path
        self.config = config or FakeDecoderConfig()
        self.state = FakeDecoderState()
        self._loop: BackgroundLoop | None = None
        self._server: grpc.aio.Server | None = None

    @property
    def target(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self) -> FakeDecoder:
        self._loop = BackgroundLoop("fake-decoder")
        self._loop.run(self._start())
        return self

    async def _start(self) -> None:
        self._server = grpc.aio.server()
        decoder_pb2_grpc.add_DecoderServiceServicer_to_server(
            FakeDecoderServicer(self.config, self.state), self._server
        )
        self._server.add_insecure_port(self.target)
        await self._server.start()

    def stop(self) -> None:
        if self._loop is None:
            return
        if self._server is not None:
            self._loop.run(self._server.stop(0))
        self._loop.close()
        self._loop = None

    def __enter__(self) -> FakeDecoder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
        """Poll `predicate` (over `state`) until true or the timeout passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.01)
        return predicate()

    @staticmethod
    def absent_target(directory: Path) -> str:
        """A target where no decoder listens (the decoder is down)."""
        return f"unix://{directory / 'no-decoder.sock'}"


__all__ = [
    "FAKE_SAMPLE_RATE",
    "FAKE_VOICES",
    "BackgroundLoop",
    "FakeDecoder",
    "FakeDecoderConfig",
    "FakeDecoderServicer",
    "FakeDecoderState",
    "audio_payload",
    "fake_audio",
]
