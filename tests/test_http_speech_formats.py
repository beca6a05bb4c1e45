"""``/v1/audio/speech`` formats and fields, ``/v1/models`` and the HTTP metrics.

Most tests run the real gateway against `FakeDecoder` (a test double whose
audio is a function of prompt, voice, seed and chunk index); the audio
HTTP returns is compared byte for byte with what gRPC ``Speak`` returns.
The last tests run the three real services (fake engine, tts profile) for
the length caps and the finish reasons the decoder reports.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
import soundfile
from fakes import FakeDecoder, FakeDecoderConfig, GatewayThread

from omni_serving.v1 import common_pb2, decoder_pb2, decoder_pb2_grpc, gateway_pb2

TEXT = "the quick brown fox"
SPEECH = "/v1/audio/speech"


@pytest.fixture
def decoder(sock_dir: Path) -> Iterator[FakeDecoder]:
    with FakeDecoder(sock_dir / "decoder.sock", FakeDecoderConfig(num_chunks=5)) as fake:
        yield fake


@pytest.fixture
def gateway(decoder: FakeDecoder, sock_dir: Path) -> Iterator[GatewayThread]:
    with GatewayThread(
        decoder.target, sock_dir, http_host="127.0.0.1", http_port=0, max_text_chars=100
    ) as gw:
        yield gw


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)


class Reply:
    def __init__(self, response: http.client.HTTPResponse) -> None:
        self.status = response.status
        self.headers = {k.lower(): v for k, v in response.getheaders()}
        self.content = response.read()

    def json(self) -> dict:
        return json.loads(self.content)


def post(port: int, body: object, path: str = SPEECH) -> Reply:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
        return Reply(conn.getresponse())
    finally:
        conn.close()


def get(port: int, path: str) -> Reply:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        return Reply(conn.getresponse())
    finally:
        conn.close()


def grpc_speak(gw: GatewayThread, seed: int, voice: str = "bob") -> bytes:
    request = gateway_pb2.SpeakRequest(
        text=TEXT, voice=voice, sampling_params=common_pb2.SamplingParams(seed=seed)
    )
    return b"".join(c.audio for c in gw.stub.Speak(request, timeout=10))


def sse_events(content: bytes) -> list[dict]:
    """The JSON of every ``data:`` line of an SSE body, in order."""
    events = []
    for block in content.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            events.append(json.loads(block.removeprefix("data: ")))
    return events


# --- formats ------------------------------------------------------------------


def test_flac_is_lossless_and_sent_whole(gateway: GatewayThread) -> None:
    want = grpc_speak(gateway, seed=4)
    body = {"model": "m", "input": TEXT, "voice": "bob", "response_format": "flac", "seed": 4}
    reply = post(gateway.http_port, body)  # no "stream": flac defaults to a whole body
    assert reply.status == 200, reply.content
    assert reply.headers["content-type"] == "audio/flac"
    assert reply.headers["x-finish-reason"] == "stop"
    assert "chunked" not in reply.headers.get("transfer-encoding", "")
    samples, rate = soundfile.read(io.BytesIO(reply.content), dtype="int16")
    assert rate == 24000
    assert samples.astype("<i2").tobytes() == want
    # The official client, same bytes.
    sdk = client(gateway.http_port).audio.speech.create(
        model="m", voice="bob", input=TEXT, response_format="flac", extra_body={"seed": 4}
    )
    assert sdk.content == reply.content


def test_stream_true_with_flac_is_400(gateway: GatewayThread) -> None:
    body = {"model": "m", "input": TEXT, "response_format": "flac", "stream": True}
    reply = post(gateway.http_port, body)
    assert reply.status == 400 and reply.json()["error"]["param"] == "stream", reply.content
    body = {"model": "m", "input": TEXT, "response_format": "flac", "stream_format": "sse"}
    reply = post(gateway.http_port, body)
    assert reply.status == 400 and reply.json()["error"]["param"] == "stream_format"


@pytest.mark.parametrize("response_format", ["pcm", "wav"])
def test_sse_deltas_and_done(gateway: GatewayThread, response_format: str) -> None:
    want = grpc_speak(gateway, seed=9, voice="alice")
    body = {
        "model": "m",
        "input": TEXT,
        "voice": "alice",
        "seed": 9,
        "response_format": response_format,
        "stream_format": "sse",
    }
    with client(gateway.http_port).audio.speech.with_streaming_response.create(
        model="m",
        voice="alice",
        input=TEXT,
        response_format=response_format,
        stream_format="sse",
        extra_body={"seed": 9},
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        content = response.read()
    assert post(gateway.http_port, body).content == content
    events = sse_events(content)
    deltas, done = events[:-1], events[-1]
    assert all(e["type"] == "speech.audio.delta" for e in deltas), events
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    if response_format == "wav":
        assert audio[:4] == b"RIFF" and audio[44:] == want
    else:
        assert audio == want
    assert done["type"] == "speech.audio.done"
    assert done["finish_reason"] == "stop"
    words = len(TEXT.split())  # the fake decoder's prompt token count
    assert done["usage"] == {"input_tokens": words, "output_tokens": 5, "total_tokens": words + 5}


def test_buffered_wav_and_pcm_carry_finish_reason(gateway: GatewayThread) -> None:
    want = grpc_speak(gateway, seed=2)
    for fmt in ("wav", "pcm"):
        body = {"model": "m", "input": TEXT, "voice": "bob", "seed": 2, "response_format": fmt}
        reply = post(gateway.http_port, {**body, "stream": False})
        assert reply.status == 200, reply.content
        assert reply.headers["x-finish-reason"] == "stop"
        pcm = reply.content if fmt == "pcm" else reply.content[44:]
        assert pcm == want, fmt
        # A raw stream cannot carry it: its headers leave before the audio is made.
        streamed = post(gateway.http_port, body)
        assert "x-finish-reason" not in streamed.headers
        assert (streamed.content if fmt == "pcm" else streamed.content[44:]) == want


def test_mid_stream_failure_ends_sse_with_an_error_event(sock_dir: Path) -> None:
    config = FakeDecoderConfig(num_chunks=10, fail_after=3)
    with (
        FakeDecoder(sock_dir / "d.sock", config) as fake,
        GatewayThread(fake.target, sock_dir, http_host="127.0.0.1", http_port=0) as gw,
    ):
        body = {"model": "m", "input": "hi", "response_format": "pcm", "stream_format": "sse"}
        reply = post(gw.http_port, body)
        assert reply.status == 200
        events = sse_events(reply.content)
        assert [e["type"] for e in events] == ["speech.audio.delta"] * 3 + ["error"], events
        assert events[-1]["error"]["type"] == "server_error"


# --- fields -------------------------------------------------------------------


def test_sampling_fields_reach_the_decoder(gateway: GatewayThread, decoder: FakeDecoder) -> None:
    body = {
        "model": "m",
        "input": TEXT,
        "max_tokens": 40,
        "max_audio_seconds": 2.5,
        "temperature": 0.7,
        "seed": 11,
        "speed": 1.0,
    }
    assert post(gateway.http_port, body).status == 200
    params = decoder.state.requests[-1].sampling_params
    assert (params.max_tokens, params.max_audio_seconds, params.seed) == (40, 2.5, 11)
    assert params.temperature == pytest.approx(0.7) and not params.model_defaults
    # No temperature: the model's own sampling defaults, so the seed matters.
    assert post(gateway.http_port, {"model": "m", "input": TEXT, "seed": 3}).status == 200
    params = decoder.state.requests[-1].sampling_params
    assert params.model_defaults and params.temperature == 0 and params.seed == 3


def test_instructions_refused_where_unsupported(
    gateway: GatewayThread, decoder: FakeDecoder
) -> None:
    before = len(decoder.state.requests)
    body = {"model": "m", "input": TEXT, "instructions": "speak slowly"}
    reply = post(gateway.http_port, body)
    assert reply.status == 400, reply.content
    assert reply.json()["error"]["param"] == "instructions", reply.json()
    assert len(decoder.state.requests) == before


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"speed": 1.5}, "speed"),
        ({"speed": "fast"}, "speed"),
        ({"stream_format": "chunks"}, "stream_format"),
        ({"stream_format": 1}, "stream_format"),
        ({"stream_format": "sse", "stream": False}, "stream_format"),
        ({"response_format": "mp3"}, "response_format"),
        ({"instructions": 5}, "instructions"),
        ({"instructions": "x" * 101}, "instructions"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_audio_seconds": 0}, "max_audio_seconds"),
        ({"max_audio_seconds": -1}, "max_audio_seconds"),
        ({"max_audio_seconds": "10"}, "max_audio_seconds"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"voice": 3}, "voice"),
        ({"some_future_field": {"ignored": True}}, "some_future_field"),  # never silently ignored
        ({"language": "en"}, "language"),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else v,
)
def test_bad_fields_are_400_naming_them(gateway: GatewayThread, extra: dict, param: str) -> None:
    reply = post(gateway.http_port, {"model": "m", "input": TEXT, **extra})
    assert reply.status == 400, reply.content
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(param), error


# --- models -------------------------------------------------------------------


def test_models_list_and_get(gateway: GatewayThread) -> None:
    listing = client(gateway.http_port).models.list()
    (card,) = listing.data
    assert card.id == "omni-serving" and card.object == "model"
    assert card.owned_by == "omni-serving"
    raw = get(gateway.http_port, "/v1/models").json()
    assert raw["object"] == "list"
    (model,) = raw["data"]
    assert model == {
        "id": "omni-serving",
        "object": "model",
        "created": model["created"],
        "owned_by": "omni-serving",
        "profile": "fake",
        "modalities": [],
        "voices": ["alice", "bob"],
        "voice_aliases": {},
        "sample_rate_hz": 24000,
        "limits": {
            "default_audio_seconds": 0.0,
            "max_audio_seconds": 0.0,
            "default_text_tokens": 0,
            "max_text_tokens": 0,
            "context_tokens": 0,
            "audio_frames_per_second": 0.0,
            "default_temperature": 0.0,
            "default_top_p": 0.0,
            "default_top_k": 0,
            "max_first_chunk_frames": 0,
            "max_input_audio_parts": 0,
            "max_input_audio_seconds": 0.0,
            "max_input_image_parts": 0,
            "max_input_image_pixels": 0,
        },
        "supports_instructions": False,
        "speech_instructions": False,
        "voice_registry": False,
        "languages": [],
        "engine_settings": {},  # the fake decoder's stages say none
    }
    assert get(gateway.http_port, "/v1/models/omni-serving").json() == model
    assert client(gateway.http_port).models.retrieve("omni-serving").id == "omni-serving"
    missing = get(gateway.http_port, "/v1/models/other")
    assert missing.status == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    assert missing.json()["error"]["param"] == "model"


# --- metrics ------------------------------------------------------------------


def metric(port: int, name: str, **labels: str) -> float:
    """One sample of the gateway's /metrics (0 when absent)."""
    text = get(port, "/metrics").content.decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match and ",".join(sorted(match.group(1).split(","))) == want:
            return float(match.group(2))
    return 0.0


def test_http_requests_are_counted_by_route_and_status(gateway: GatewayThread) -> None:
    port = gateway.http_port
    total = "omni_gateway_http_requests_total"
    series = [
        ({"api": SPEECH, "status": "200"}, "OK"),
        ({"api": SPEECH, "status": "400"}, "INVALID_ARGUMENT"),
        ({"api": "/v1/models/{model_id}", "status": "404"}, "NOT_FOUND"),
        ({"api": "unmatched", "status": "404"}, None),
    ]
    before = [metric(port, total, **labels) for labels, _ in series]
    grpc_before = [
        metric(port, "omni_gateway_requests_total", api=labels["api"], code=code)
        for labels, code in series
        if code
    ]
    assert post(port, {"model": "m", "input": TEXT}).status == 200
    assert post(port, {"model": "m", "input": TEXT, "speed": 2}).status == 400
    assert post(port, {"model": "m", "input": ""}).status == 400
    assert get(port, "/v1/models/nope").status == 404
    assert get(port, "/no/such/route").status == 404
    after = [metric(port, total, **labels) for labels, _ in series]
    assert [b - a for a, b in zip(before, after, strict=True)] == [1, 2, 1, 1]
    grpc_after = [
        metric(port, "omni_gateway_requests_total", api=labels["api"], code=code)
        for labels, code in series
        if code
    ]
    assert [b - a for a, b in zip(grpc_before, grpc_after, strict=True)] == [1, 2, 1]
    count = metric(port, "omni_gateway_http_request_seconds_count", api=SPEECH)
    assert count >= 3


# --- the real stack -------------------------------------------------------------


@pytest.fixture(scope="module")
def tts_stack(tmp_path_factory):
    from omni_stack.config import StackConfig
    from omni_stack.stack import Stack

    stack = Stack(
        StackConfig(
            profile="tts",
            engine="fake",
            runtime_dir=str(tmp_path_factory.mktemp("rt")),
            port=0,
            http_port=0,
            log_level="WARNING",
        )
    )
    stack.start()
    yield stack
    assert stack.stop() == []


@pytest.mark.e2e
def test_models_card_matches_decoder_info(tts_stack) -> None:
    with grpc.insecure_channel(tts_stack.decoder_target) as channel:
        info = decoder_pb2_grpc.DecoderServiceStub(channel).GetDecoderInfo(
            decoder_pb2.GetDecoderInfoRequest()
        )
    port = tts_stack.cfg.http_port
    (card,) = get(port, "/v1/models").json()["data"]
    assert card["profile"] == "tts" and card["modalities"] == ["audio"], card
    assert card["voices"] == list(info.voices)
    assert card["supports_instructions"] is False
    assert card["limits"]["max_audio_seconds"] == pytest.approx(info.limits.max_audio_seconds)
    assert card["limits"]["max_audio_seconds"] > 0, card
    assert card["id"] == (info.model or "omni-serving")


@pytest.mark.e2e
def test_max_audio_seconds_caps_the_audio_with_finish_reason_length(tts_stack) -> None:
    port = tts_stack.cfg.http_port
    text = "a long sentence for the speech engine to speak " * 3
    body = {"model": "m", "input": text, "response_format": "pcm", "stream": False, "seed": 1}
    whole = post(port, body)
    assert whole.status == 200, whole.content
    assert whole.headers["x-finish-reason"] == "stop"
    whole_s = len(whole.content) / 2 / 24000
    cap = round(whole_s / 2, 2)
    capped = post(port, {**body, "max_audio_seconds": cap})
    assert capped.status == 200, capped.content
    assert capped.headers["x-finish-reason"] == "length"
    assert len(capped.content) / 2 / 24000 <= cap + 0.05
    assert whole.content.startswith(capped.content[: len(capped.content) // 2])
    # The same through SSE: the done event says why it ended.
    sse = post(port, {**body, "max_audio_seconds": cap, "stream": True, "stream_format": "sse"})
    events = sse_events(sse.content)
    assert events[-1]["finish_reason"] == "length"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert audio == capped.content
    # Above the deployment's maximum: 400 naming the field.
    (card,) = get(port, "/v1/models").json()["data"]
    over = post(port, {**body, "max_audio_seconds": card["limits"]["max_audio_seconds"] + 1})
    assert over.status == 400 and over.json()["error"]["param"] == "max_audio_seconds"


@pytest.mark.e2e
def test_wav_stream_on_real_stack_matches_grpc(tts_stack) -> None:
    from tests.speech_helpers import check_chunks, speak_chunks

    want = check_chunks(speak_chunks(tts_stack.gateway_target, TEXT, 5, voice="alloy"))
    body = {"model": "m", "input": TEXT, "voice": "alloy", "seed": 5, "temperature": 0}
    # speak_chunks sends no temperature and no model_defaults: greedy, as temperature 0.
    reply = post(tts_stack.cfg.http_port, body)
    assert reply.status == 200, reply.content
    assert reply.content[:4] == b"RIFF" and reply.content[44:] == want
