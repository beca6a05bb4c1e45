"""Helpers shared by the end-to-end speech tests (not a test double)."""

from __future__ import annotations

import hashlib
import threading
import urllib.request

import grpc
import torch

from decoder_svc.backend import RequestSpec
from decoder_svc.pipeline import Pipeline
from decoder_svc.profile import load_profile
from decoder_svc.testing.fake_engine import FakeBackend, fake_vocoder
from gateway.audio import pcm16le
from omni_common.materialize import payload_tensors
from omni_common.modality import OutputModality
from omni_serving.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


def speak_chunks(
    target: str,
    text: str,
    seed: int,
    request_id: str = "",
    voice: str = "",
    max_audio_seconds: float = 0.0,
) -> list[gateway_pb2.SpeakResponse]:
    with grpc.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.OmniGatewayServiceStub(channel)
        req = gateway_pb2.SpeakRequest(
            request_id=request_id, text=text, voice=voice, sampling_params=common_pb2.SamplingParams(seed=seed, max_audio_seconds=max_audio_seconds),
        )
        return list(stub.Speak(req, timeout=120))


def check_chunks(chunks: list[gateway_pb2.SpeakResponse]) -> bytes:
    """Contiguous sequence numbers, one final flag at the end; returns the PCM."""
    seqs = [c.sequence_number for c in chunks]
    assert seqs == list(range(len(chunks))), f"sequence numbers not contiguous: {seqs=}"
    finals = [c.final for c in chunks]
    assert finals[-1] and not any(finals[:-1]), f"final flag misplaced: {finals=}"
    assert len({c.request_id for c in chunks}) == 1, "request id not echoed consistently"
    return b"".join(c.audio for c in chunks)


def reference_audio_sync(text: str, seed: int, profile: str = "tts", voice: str = "default") -> bytes:
    """PCM16 of the same request through the same backend, payloads built
    synchronously in-process (no materializer, no arena)."""
    pipeline = Pipeline(
        load_profile(profile), {"talker": FakeBackend()}, vocoder=fake_vocoder(load_profile(profile)),
        materializer_target=None, shm_prefix="omni-sync", arena=None,
    )
    assert not pipeline.decision.use_async
    pipeline.start()
    pieces: list[torch.Tensor] = []
    done = threading.Event()

    def sink(resp) -> None:
        if resp.multimodal_output.tensors:
            pieces.append(payload_tensors(resp.multimodal_output)["audio"].clone())
        if resp.finished:
            done.set()

    try:
        pipeline.submit(
            RequestSpec(request_id="sync", prompt=text, seed=seed, voice=voice, modality=OutputModality.AUDIO), sink
        )
        assert done.wait(60), "in-process reference request did not finish"
    finally:
        pipeline.stop()
    return pcm16le(pieces)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def describe_pcm_difference(a: bytes, b: bytes) -> str:
    """Where two PCM16 streams differ, in words: their lengths, the first
    differing sample and how far apart they are (a sampling flip changes the
    codes and so the whole rest; rounding noise moves samples by a few LSB)."""
    if a == b:
        return "identical"
    x = torch.frombuffer(bytearray(a), dtype=torch.int16).to(torch.int32)
    y = torch.frombuffer(bytearray(b), dtype=torch.int16).to(torch.int32)
    n = min(len(x), len(y))
    diff = (x[:n] - y[:n]).abs()
    where = diff.nonzero()
    first = int(where[0]) if len(where) else n
    return (f"{len(x)} vs {len(y)} samples; first difference at sample {first} ({first / 24000:.3f} s at 24 kHz); "
            f"{len(where)} of {n} common samples differ, by at most {int(diff.max()) if n else 0}")


def metric(stack, name: str, **labels: str) -> float:
    """The sum of a series of the decoder's /metrics over its label sets
    (those with ``labels``, when given); histograms by their sample names
    (``..._bucket`` with ``le``, ``..._count``, ``..._sum``)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(stack.service("decoder").metrics_url, timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def talker_codes(engine, specs) -> dict:  # noqa: ANN001
    """Each spec's codes [frames, G] (torch) from the engine's talker, stepped in process."""
    import torch

    talker = engine.backends["talker"]
    codes: dict[str, list] = {s.request_id: [] for s in specs}
    for s in specs:
        talker.add_request(engine.prepare(s))
    while talker.has_unfinished():
        out = talker.step()
        if out is not None:
            c, _ = out.mm_outputs["codec_codes"]
            for i, rid in enumerate(out.request_ids):
                codes[rid].append(c[i])
    return {rid: torch.stack(v) for rid, v in codes.items()}
