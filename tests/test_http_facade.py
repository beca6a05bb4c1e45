"""The OpenAI-compatible HTTP facade, driven by the official `openai` client, against FakeDecoder."""

from __future__ import annotations

import http.client
import io
import json
import re
import wave
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from fakes import FakeDecoder, FakeDecoderConfig, GatewayThread

from omni_cli import speak_client
from omni_serving.v1 import common_pb2, gateway_pb2

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


def client(gw: GatewayThread) -> openai.OpenAI:
    # max_retries=0: a refused request must surface, not be retried.
    return openai.OpenAI(base_url=f"http://127.0.0.1:{gw.http_port}/v1", api_key="x", max_retries=0)


class Reply:
    """A finished HTTP exchange (stdlib client: the test needs no extra package)."""

    def __init__(self, response: http.client.HTTPResponse) -> None:
        self.status_code = response.status
        self.headers = {k.lower(): v for k, v in response.getheaders()}
        self.content = response.read()

    def json(self) -> dict:
        return json.loads(self.content)


def request(
    port: int, method: str, path: str, body: object = None, *, raw: bytes | None = None
) -> Reply:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        return Reply(conn.getresponse())
    finally:
        conn.close()


def open_stream(port: int, body: dict, headers: dict | None = None):
    """Start a streaming speech request; return (connection, response) with headers read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(
        "POST",
        "/v1/audio/speech",
        body=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    return conn, conn.getresponse()


def grpc_audio(gw: GatewayThread, seed: int, voice: str = "bob") -> bytes:
    request = gateway_pb2.SpeakRequest(
        text=TEXT, voice=voice, sampling_params=common_pb2.SamplingParams(seed=seed)
    )
    return b"".join(c.audio for c in gw.stub.Speak(request, timeout=10))


def test_openai_client_pcm_matches_grpc_speak(gateway: GatewayThread) -> None:
    with client(gateway).audio.speech.with_streaming_response.create(
        model="omni-tts",
        voice="bob",
        input=TEXT,
        response_format="pcm",
        extra_body={"seed": 7},
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("audio/pcm")
        assert response.headers["x-sample-rate"] == "24000"
        http_bytes = b"".join(response.iter_bytes())

    want = grpc_audio(gateway, seed=7)
    assert len(want) == 5 * 480 * 2
    assert http_bytes == want, f"http {len(http_bytes)} bytes != grpc {len(want)} bytes"


def test_wav_streaming_and_buffered(gateway: GatewayThread) -> None:
    want = grpc_audio(gateway, seed=1, voice="alice")
    body = {"model": "m", "input": TEXT, "voice": "alice", "response_format": "wav", "seed": 1}
    for stream in (True, False):
        response = request(gateway.http_port, "POST", SPEECH, {**body, "stream": stream})
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "audio/wav"
        data = response.content
        assert data[:4] == b"RIFF" and data[44:] == want, f"{stream=}"
        if stream:
            assert response.headers.get("transfer-encoding") == "chunked"
        else:
            with wave.open(io.BytesIO(data)) as w:  # exact sizes in the header
                assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
                assert w.getnframes() == len(want) // 2


def test_openai_error_shape(gateway: GatewayThread) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(gateway).audio.speech.create(
            model="m", voice="zed", input=TEXT, response_format="pcm"
        )
    err = info.value
    assert err.status_code == 400
    body = err.response.json()
    assert set(body) == {"error"}, f"{body=}"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == "voice"
    assert "alice" in body["error"]["message"], body
    assert body["error"]["code"] == "invalid_argument"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param({"model": "m", "input": ""}, "input", id="empty-input"),
        pytest.param({"model": "m", "input": "x" * 101}, "input", id="long-input"),
        pytest.param({"model": "m", "input": 5}, "input", id="input-type"),
        pytest.param({"input": "hi"}, "model", id="no-model"),
        pytest.param(
            {"model": "m", "input": "hi", "response_format": "mp3"}, "response_format", id="fmt"
        ),
        pytest.param({"model": "m", "input": "hi", "speed": 9}, "speed", id="speed"),
        pytest.param({"model": "m", "input": "hi", "stream": "yes"}, "stream", id="stream"),
    ],
)
def test_validation_errors_name_param(gateway: GatewayThread, body: dict, param: str) -> None:
    response = request(gateway.http_port, "POST", SPEECH, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_invalid_json_and_unknown_route(gateway: GatewayThread) -> None:
    bad = request(gateway.http_port, "POST", SPEECH, raw=b"{nope")
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    missing = request(gateway.http_port, "GET", "/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()


def test_health_and_metrics(gateway: GatewayThread) -> None:
    health = request(gateway.http_port, "GET", "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    grpc_audio(gateway, seed=0)
    metrics = request(gateway.http_port, "GET", "/metrics").content.decode()
    assert "omni_gateway_ttfp_seconds" in metrics


def test_decoder_absent_is_503(sock_dir: Path) -> None:
    with GatewayThread(
        FakeDecoder.absent_target(sock_dir), sock_dir, http_host="127.0.0.1", http_port=0
    ) as gw:
        with pytest.raises(openai.InternalServerError) as info:
            client(gw).audio.speech.create(
                model="m", voice="alice", input="hi", response_format="pcm"
            )
        assert info.value.status_code == 503
        assert info.value.response.json()["error"]["type"] == "server_error"
        assert request(gw.http_port, "GET", "/health").status_code == 503


def test_overload_is_429(sock_dir: Path) -> None:
    config = FakeDecoderConfig(num_chunks=40, delay_s=0.02)
    with (
        FakeDecoder(sock_dir / "d.sock", config) as fake,
        GatewayThread(
            fake.target, sock_dir, http_host="127.0.0.1", http_port=0, max_concurrent=1
        ) as gw,
    ):
        busy = gw.stub.Speak(gateway_pb2.SpeakRequest(request_id="busy", text="long"))
        next(iter(busy))
        with pytest.raises(openai.RateLimitError) as info:
            client(gw).audio.speech.create(
                model="m", voice="alice", input="hi", response_format="pcm"
            )
        assert info.value.status_code == 429
        busy.cancel()
        assert fake.wait_for(lambda: "busy" in fake.state.aborts)


def test_http_disconnect_aborts_decoder_request(sock_dir: Path) -> None:
    config = FakeDecoderConfig(num_chunks=200, delay_s=0.02)
    with (
        FakeDecoder(sock_dir / "d.sock", config) as fake,
        GatewayThread(fake.target, sock_dir, http_host="127.0.0.1", http_port=0) as gw,
    ):
        body = {"model": "m", "input": "long", "response_format": "pcm"}
        conn, response = open_stream(gw.http_port, body, {"X-Request-Id": "http-1"})
        assert response.getheader("X-Request-Id") == "http-1"
        assert response.read(100)
        conn.close()  # the client goes away mid-stream
        assert fake.wait_for(lambda: "http-1" in fake.state.aborts), f"{fake.state.aborts=}"


def test_grpc_and_http_share_admission(sock_dir: Path) -> None:
    """One limit for both front ends: an HTTP stream holds the slot a gRPC call wants."""
    config = FakeDecoderConfig(num_chunks=40, delay_s=0.02)
    with (
        FakeDecoder(sock_dir / "d.sock", config) as fake,
        GatewayThread(
            fake.target, sock_dir, http_host="127.0.0.1", http_port=0, max_concurrent=1
        ) as gw,
    ):
        conn, response = open_stream(gw.http_port, {"model": "m", "input": "a"})
        assert response.read(100)
        with pytest.raises(grpc.RpcError) as info:
            list(gw.stub.Speak(gateway_pb2.SpeakRequest(text="b"), timeout=10))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        conn.close()


def test_mid_stream_failure_cuts_http_stream(sock_dir: Path) -> None:
    config = FakeDecoderConfig(num_chunks=10, fail_after=3)
    with (
        FakeDecoder(sock_dir / "d.sock", config) as fake,
        GatewayThread(fake.target, sock_dir, http_host="127.0.0.1", http_port=0) as gw,
    ):
        conn, response = open_stream(
            gw.http_port, {"model": "m", "input": "hi", "response_format": "pcm"}
        )
        assert response.status == 200
        with pytest.raises(http.client.IncompleteRead):
            response.read()
        conn.close()
        # Not streaming: nothing was sent yet, so the error gets its status and JSON body.
        buffered = request(
            gw.http_port, "POST", SPEECH, {"model": "m", "input": "hi", "stream": False}
        )
        assert buffered.status_code == 500, buffered.content
        assert buffered.json()["error"]["type"] == "server_error"


def test_speak_client_over_http_matches_grpc(gateway: GatewayThread, sock_dir: Path) -> None:
    out_http, out_grpc = sock_dir / "http.wav", sock_dir / "grpc.wav"
    for base in (
        f"http://127.0.0.1:{gateway.http_port}",
        f"http://127.0.0.1:{gateway.http_port}/v1",
    ):
        speak_client.speak("", TEXT, out_http, voice="alice", seed=3, http_url=base, progress=False)
        speak_client.speak(
            gateway.gateway.address, TEXT, out_grpc, voice="alice", seed=3, progress=False
        )
        with wave.open(str(out_http)) as a, wave.open(str(out_grpc)) as b:
            assert a.getparams() == b.getparams()
            assert a.readframes(a.getnframes()) == b.readframes(b.getnframes())


def test_speak_client_http_error(gateway: GatewayThread, sock_dir: Path) -> None:
    with pytest.raises(speak_client.SpeakClientError, match="voice") as info:
        speak_client.speak(
            "",
            TEXT,
            sock_dir / "x.wav",
            voice="zed",
            http_url=f"http://127.0.0.1:{gateway.http_port}",
            progress=False,
        )
    assert info.value.code == "400"


def test_speak_client_http_stream_cut_is_data_loss(sock_dir: Path) -> None:
    config = FakeDecoderConfig(num_chunks=10, fail_after=3)
    with (
        FakeDecoder(sock_dir / "d.sock", config) as fake,
        GatewayThread(fake.target, sock_dir, http_host="127.0.0.1", http_port=0) as gw,
    ):
        out = sock_dir / "cut.wav"
        with pytest.raises(speak_client.SpeakClientError) as info:
            speak_client.speak(
                "", "hi", out, http_url=f"http://127.0.0.1:{gw.http_port}", progress=False
            )
        assert info.value.code == "DATA_LOSS" and not out.exists()


@pytest.mark.parametrize("bug", [KeyError, ValueError, TypeError])
def test_http_bug_is_500_with_a_generic_message(gateway: GatewayThread, bug: type) -> None:
    """A ValueError / KeyError / TypeError of ours is a 500 naming an error id, never a 400/404."""

    async def broken(request):
        raise bug("/srv/secret/path.py")
        yield  # an async generator, like the real one

    gateway.gateway.engine.speak = broken
    response = request(gateway.http_port, "POST", SPEECH, {"model": "m", "input": "hi"})
    assert response.status_code == 500, response.content
    error = response.json()["error"]
    assert error["type"] == "server_error" and "secret" not in error["message"], error
    assert error["code"] == "internal" and error["param"] is None, error
    assert re.fullmatch(
        r"internal error \(error id [0-9a-f]{12}\); the server log has the details",
        error["message"],
    ), error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param(b'{"model": "m", "input": "hi", "speed": 1' + b"0" * 400 + b"}", "speed"),
        pytest.param(b'{"model": "m", "input": "hi", "seed": 9223372036854775808}', "seed"),
        pytest.param(b'{"model": "m", "input": "\\ud800"}', "input"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, None),
    ],
    ids=["speed-10e400", "seed-2**63", "lone-surrogate", "deep-nesting"],
)
def test_http_hostile_bodies_are_400(gateway: GatewayThread, body: bytes, param) -> None:
    response = request(gateway.http_port, "POST", SPEECH, raw=body)
    assert response.status_code == 400, response.content[:300]
    error = response.json()["error"]
    assert error["param"] == param and len(error["message"]) <= 512, error


HTTP_ENDPOINTS = ("http_speech", "http_chat", "http_ws", "http_models")


def _gateway_imports(module: str) -> set[str]:
    """The ``gateway.*`` modules a gateway module imports, anywhere in it (ast, not run)."""
    import ast

    path = Path(__file__).parents[1] / "gateway" / f"{module}.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n.split(".")[1] for n in names if n.startswith("gateway.") and "." in n)
    return found


def test_http_modules_import_downward_only() -> None:
    """The facade imports the endpoints; the endpoints share `http_common`, never each other."""
    facade = _gateway_imports("http_facade")
    assert set(HTTP_ENDPOINTS) <= facade, f"the facade routes to every endpoint: {facade=}"
    assert "http_facade" not in _gateway_imports("http_common")
    for endpoint in HTTP_ENDPOINTS:
        imported = _gateway_imports(endpoint)
        upward = imported & {"http_facade", "app", *HTTP_ENDPOINTS}
        assert not upward, f"{endpoint} imports {sorted(upward)}; share through http_common"
        assert "http_common" in imported, f"{endpoint} does not use http_common: {imported=}"
