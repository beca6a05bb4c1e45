"""Streaming text-to-speech client: the gateway's `Speak` (or its HTTP facade) to a WAV file.

Audio is written as it arrives (PCM16 mono, `wave` fixes the header sizes on
close), with a progress bar of audio seconds on stderr when stderr is a TTY.
TTFP and RTF are measured here, as the client sees them; the gateway's own
figures (gRPC only) are returned alongside.

A gateway that requires a token gets it as ``authorization: Bearer <token>``
(gRPC metadata or HTTP header): from `token`, else from the environment
variable ``OMNI_GATEWAY_TOKEN``. A TLS gateway is dialled with the CA
certificate in `tls_ca` (else ``OMNI_GATEWAY_TLS_CA``); over HTTP an
``https://`` URL does the same.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
import wave
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from tqdm import tqdm

from omni_common.server import client_options, client_target
from omni_serving.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

DEFAULT_SAMPLE_RATE_HZ = 24000
BYTES_PER_SAMPLE = 2
HTTP_MODEL = "omni"
_HTTP_READ_BYTES = 8192
TOKEN_ENV = "OMNI_GATEWAY_TOKEN"
TLS_CA_ENV = "OMNI_GATEWAY_TLS_CA"


class SpeakClientError(RuntimeError):
    """The gateway refused or failed the request. `code` is the gRPC code name or HTTP status."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass
class _Chunk:
    audio: bytes
    sample_rate_hz: int
    request_id: str = ""
    final: bool = False
    server_metrics: common_pb2.RequestMetrics | None = None


@dataclass(frozen=True)
class Access:
    """How to reach a gateway that requires TLS and/or a token."""

    token: str | None = None
    tls_ca: str | None = None
    """PEM file of the CA that signed the gateway's certificate: dial TLS."""
    tls_server_name: str | None = None
    """The name in the gateway's certificate, when not the target's host."""

    @classmethod
    def resolve(
        cls, token: str | None, tls_ca: str | None, tls_server_name: str | None = None
    ) -> Access:
        """Explicit values, else the environment (OMNI_GATEWAY_TOKEN, OMNI_GATEWAY_TLS_CA)."""
        return cls(
            token=token or os.environ.get(TOKEN_ENV) or None,
            tls_ca=tls_ca or os.environ.get(TLS_CA_ENV) or None,
            tls_server_name=tls_server_name,
        )

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel(self, target: str) -> grpc.Channel:
        # client_options: large-message limits and keepalive matching the servers.
        options: list[tuple[str, int | str]] = list(client_options())
        if self.tls_ca is None:
            return grpc.insecure_channel(client_target(target), options=options)
        try:
            with open(self.tls_ca, "rb") as f:
                root = f.read()
        except OSError as exc:
            raise SpeakClientError("INVALID_ARGUMENT", f"tls_ca: {exc}") from exc
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        credentials = grpc.ssl_channel_credentials(root_certificates=root)
        return grpc.secure_channel(client_target(target), credentials, options=options)

    def ssl_context(self) -> ssl.SSLContext | None:
        return ssl.create_default_context(cafile=self.tls_ca) if self.tls_ca else None


def _grpc_chunks(
    target: str, text: str, voice: str, seed: int | None, access: Access
) -> Iterator[_Chunk]:
    request = gateway_pb2.SpeakRequest(text=text, voice=voice)
    if seed is not None:
        request.sampling_params.seed = seed
    with access.channel(target) as channel:
        stub = gateway_pb2_grpc.OmniGatewayServiceStub(channel)
        try:
            for response in stub.Speak(request, metadata=access.metadata):
                yield _Chunk(
                    response.audio,
                    response.sample_rate_hz or DEFAULT_SAMPLE_RATE_HZ,
                    response.request_id,
                    response.final,
                    response.metrics if response.final else None,
                )
        except grpc.RpcError as exc:
            raise SpeakClientError(exc.code().name, exc.details()) from exc


def speech_url(http_url: str) -> str:
    """The facade's speech endpoint under a base URL (``http://host:port`` or ``.../v1``)."""
    base = http_url.rstrip("/")
    if base.endswith("/audio/speech"):
        return base
    if not base.endswith("/v1"):
        base += "/v1"
    return base + "/audio/speech"


def _http_error(exc: urllib.error.HTTPError) -> SpeakClientError:
    try:
        message = json.loads(exc.read())["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = exc.reason
    return SpeakClientError(str(exc.code), str(message))


def _http_chunks(
    http_url: str, text: str, voice: str, seed: int | None, access: Access
) -> Iterator[_Chunk]:
    body: dict[str, object] = {
        "model": HTTP_MODEL,
        "input": text,
        "voice": voice,
        "response_format": "pcm",
        "stream": True,
    }
    if seed is not None:
        body["seed"] = seed
    headers = {"Content-Type": "application/json"}
    if access.token:
        headers["Authorization"] = f"Bearer {access.token}"
    request = urllib.request.Request(
        speech_url(http_url), data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    try:
        response = urllib.request.urlopen(  # noqa: S310 (URL given by the user)
            request, context=access.ssl_context()
        )
    except urllib.error.HTTPError as exc:
        raise _http_error(exc) from exc
    except urllib.error.URLError as exc:
        raise SpeakClientError("UNAVAILABLE", f"{http_url}: {exc.reason}") from exc
    with response:
        rate = int(response.headers.get("X-Sample-Rate") or DEFAULT_SAMPLE_RATE_HZ)
        request_id = response.headers.get("X-Request-Id", "")
        pending = b""  # an HTTP read may end in the middle of a sample
        while True:
            try:
                data = response.read(_HTTP_READ_BYTES)
            except (http.client.HTTPException, OSError) as exc:  # cut mid-stream
                raise SpeakClientError("DATA_LOSS", f"audio stream broke off: {exc!r}") from exc
            if not data:
                break
            data = pending + data
            whole = len(data) - len(data) % BYTES_PER_SAMPLE
            pending = data[whole:]
            yield _Chunk(data[:whole], rate, request_id)
    if pending:
        raise SpeakClientError("DATA_LOSS", "stream ended in the middle of a sample")
    yield _Chunk(b"", rate, request_id, final=True)


def speak(
    target: str,
    text: str,
    out_path: Path,
    *,
    voice: str = "",
    seed: int | None = None,
    http_url: str | None = None,
    progress: bool = True,
    token: str | None = None,
    tls_ca: str | None = None,
    tls_server_name: str | None = None,
) -> dict:
    """Speak `text` through the gateway at `target` (or `http_url`) into a WAV at `out_path`.

    `token` (else env OMNI_GATEWAY_TOKEN) is sent as a bearer token;
    `tls_ca` (else env OMNI_GATEWAY_TLS_CA) dials the gateway over TLS.
    Returns request id, path, sample rate, samples, audio seconds, chunks,
    client-side ``ttfp_ms`` and ``rtf`` (and ``server_ttfp_ms`` /
    ``server_rtf`` from the gateway's final chunk over gRPC), and prints a
    one-line summary. Raises `SpeakClientError` (the partial file is removed).
    """
    out_path = Path(out_path)
    start = time.perf_counter()
    access = Access.resolve(token, tls_ca, tls_server_name)
    chunks = (
        _http_chunks(http_url, text, voice, seed, access)
        if http_url
        else _grpc_chunks(target, text, voice, seed, access)
    )
    bar = tqdm(
        desc="audio",
        unit="s",
        bar_format="{desc}: {n:.2f}{unit} [{elapsed}, {rate_fmt}]",
        file=sys.stderr,
        disable=not progress or not sys.stderr.isatty(),
    )
    samples = n_chunks = 0
    ttfp_s: float | None = None
    rate = DEFAULT_SAMPLE_RATE_HZ
    request_id = ""
    server: common_pb2.RequestMetrics | None = None
    writer: wave.Wave_write | None = None
    try:
        for chunk in chunks:
            if writer is None:
                rate = chunk.sample_rate_hz
                writer = wave.open(str(out_path), "wb")
                writer.setnchannels(1)
                writer.setsampwidth(BYTES_PER_SAMPLE)
                writer.setframerate(rate)
            request_id = chunk.request_id or request_id
            n_chunks += 1
            if chunk.audio:
                if ttfp_s is None:
                    ttfp_s = time.perf_counter() - start
                writer.writeframes(chunk.audio)
                n = len(chunk.audio) // BYTES_PER_SAMPLE
                samples += n
                bar.update(n / rate)
            if chunk.final:
                server = chunk.server_metrics
    except BaseException:  # cleanup only: re-raised
        if writer is not None:
            writer.close()
        out_path.unlink(missing_ok=True)
        raise
    finally:
        chunks.close()  # ends the gRPC call / HTTP response if we stopped early
        bar.close()
    if writer is None:  # no chunk at all: still leave a valid (empty) WAV
        writer = wave.open(str(out_path), "wb")
        writer.setnchannels(1)
        writer.setsampwidth(BYTES_PER_SAMPLE)
        writer.setframerate(rate)
    writer.close()

    wall_s = time.perf_counter() - start
    audio_s = samples / rate if rate else 0.0
    result = {
        "request_id": request_id,
        "path": str(out_path),
        "sample_rate_hz": rate,
        "samples": samples,
        "audio_seconds": audio_s,
        "chunks": n_chunks,
        "wall_s": wall_s,
        "ttfp_ms": (ttfp_s or 0.0) * 1000.0,
        "rtf": wall_s / audio_s if audio_s else 0.0,
        "server_ttfp_ms": server.ttfp_ms if server is not None else None,
        "server_rtf": server.rtf if server is not None else None,
    }
    print(
        f"wrote {out_path} ({audio_s:.2f} s of audio at {rate} Hz): "
        f"TTFP {result['ttfp_ms']:.1f} ms, RTF {result['rtf']:.3f}"
    )
    return result


__all__ = ["Access", "SpeakClientError", "speak", "speech_url"]
