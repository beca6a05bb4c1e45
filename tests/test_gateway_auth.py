"""Access to the gateway: TLS on both listeners, a bearer token on both, health left open.

The certificate is self-signed and made here (the `cryptography` package when
installed, else the `openssl` command); clients trust it as their CA.
"""

from __future__ import annotations

import asyncio
import datetime
import http.client
import ipaddress
import json
import shutil
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from fakes import FakeDecoder, GatewayThread
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.app import GatewayConfig, start_gateway
from omni_cli import speak_client
from omni_common.errors import FailedPreconditionError, InvalidArgumentError
from omni_common.server import bearer_token_matches, wait_for_health_sync
from omni_serving.v1 import gateway_pb2, gateway_pb2_grpc

TOKEN = "s3cret-token"
SPEECH_BODY = {"model": "m", "input": "hello", "response_format": "pcm"}


def make_self_signed(directory: Path) -> tuple[Path, Path]:
    """(cert.pem, key.pem) for CN=localhost, SAN localhost and 127.0.0.1."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl command is available")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2",
             "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
            check=True, capture_output=True,
        )  # fmt: skip
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, key


@pytest.fixture
def tls_files(sock_dir: Path) -> tuple[Path, Path]:
    return make_self_signed(sock_dir)


def speak_request(stub, metadata=None) -> list[gateway_pb2.SpeakResponse]:
    request = gateway_pb2.SpeakRequest(request_id="a", text="hello")
    return list(stub.Speak(request, timeout=10, metadata=metadata))


def health_status(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def post(port: int, body: object, headers: dict[str, str], *, context=None):
    conn = (
        http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
        if context is not None
        else http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    )
    try:
        conn.request("POST", "/v1/audio/speech", body=json.dumps(body), headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def get(port: int, path: str, headers: dict[str, str] | None = None, *, context=None):
    conn = (
        http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
        if context is not None
        else http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    )
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


# ---------------------------------------------------------------------------
# The token check itself.


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (f"Bearer {TOKEN}", True),
        (f"bearer {TOKEN}", True),
        (f"  Bearer   {TOKEN} ", True),
        (f"Bearer {TOKEN}x", False),
        (f"Bearer {TOKEN[:-1]}", False),
        (TOKEN, False),
        (f"Basic {TOKEN}", False),
        ("Bearer", False),
        ("", False),
        (None, False),
        (f"Bearer {TOKEN}".encode(), True),
        ("Bearer \ud800", False),
    ],
)
def test_bearer_token_matches(header, ok: bool) -> None:
    assert bearer_token_matches(header, TOKEN) is ok


# ---------------------------------------------------------------------------
# Token, plaintext.


def test_grpc_requires_the_token_but_health_stays_open(decoder: FakeDecoder, sock_dir) -> None:
    with GatewayThread(decoder.target, sock_dir, auth_token=TOKEN) as gw:
        for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", TOKEN)]):
            with pytest.raises(grpc.RpcError) as info:
                speak_request(gw.stub, metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()
            assert info.value.details().startswith("authorization: ")
            assert TOKEN not in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            list(gw.stub.Generate(gateway_pb2.OmniGatewayServiceGenerateRequest(prompt="hi")))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Unauthenticated bytes are not even parsed.
        raw = gw.channel.unary_stream("/omni_serving.v1.OmniGatewayService/Speak")
        with pytest.raises(grpc.RpcError) as info:
            list(raw(b"\xff\xff", timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

        chunks = speak_request(gw.stub, [("authorization", f"Bearer {TOKEN}")])
        assert chunks[-1].final and any(c.audio for c in chunks)
        assert health_status(gw.channel) == health_pb2.HealthCheckResponse.SERVING
    assert [r.request_id for r in decoder.state.requests] == ["a"], "refused calls reached it"


def test_http_requires_the_token_but_health_stays_open(decoder: FakeDecoder, sock_dir) -> None:
    with GatewayThread(
        decoder.target, sock_dir, auth_token=TOKEN, http_host="127.0.0.1", http_port=0
    ) as gw:
        port = gw.http_port
        json_type = {"Content-Type": "application/json"}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
            status, response_headers, body = post(port, SPEECH_BODY, {**json_type, **headers})
            assert status == 401, body
            error = json.loads(body)["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert error["message"].startswith("authorization: ")
            assert response_headers.get("WWW-Authenticate") == "Bearer"
        assert get(port, "/metrics")[0] == 401
        assert get(port, "/metrics", {"Authorization": f"Bearer {TOKEN}"})[0] == 200
        assert get(port, "/health")[0] == 200
        status, _, body = post(port, SPEECH_BODY, {**json_type, "Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and len(body) > 0

        base = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError) as info:
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).audio.speech.create(
                model="m", voice="alice", input="hi", response_format="pcm"
            )
        assert info.value.status_code == 401
        ok = openai.OpenAI(base_url=base, api_key=TOKEN, max_retries=0).audio.speech.create(
            model="m", voice="alice", input="hi", response_format="pcm"
        )
        assert len(ok.content) > 0


def test_speak_client_passes_the_token(
    decoder: FakeDecoder, sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(speak_client.TOKEN_ENV, raising=False)
    with GatewayThread(
        decoder.target, sock_dir, auth_token=TOKEN, http_host="127.0.0.1", http_port=0
    ) as gw:
        out = sock_dir / "out.wav"
        http_url = f"http://127.0.0.1:{gw.http_port}"
        for url in (None, http_url):
            with pytest.raises(speak_client.SpeakClientError) as info:
                speak_client.speak(gw.gateway.address, "hi", out, http_url=url, progress=False)
            assert info.value.code in ("UNAUTHENTICATED", "401") and not out.exists()
            result = speak_client.speak(
                gw.gateway.address, "hi", out, http_url=url, token=TOKEN, progress=False
            )
            assert result["samples"] > 0
        # the CLI: --token-file, and without it the environment
        from omni_cli.main import main as cli

        token_file = sock_dir / "token"
        token_file.write_text(TOKEN + "\n")
        out.unlink()
        argv = ["speak", "hi", "-o", str(out), "--target", gw.gateway.address, "-q"]
        assert cli(argv) == 1 and not out.exists()
        assert cli([*argv, "--token-file", str(token_file)]) == 0 and out.stat().st_size > 44
        monkeypatch.setenv(speak_client.TOKEN_ENV, TOKEN)  # what `omni-serving speak` reads
        assert speak_client.speak(gw.gateway.address, "hi", out, progress=False)["samples"] > 0


# ---------------------------------------------------------------------------
# TLS (and the token over it).


def test_tls_on_grpc_and_http(decoder: FakeDecoder, sock_dir: Path, tls_files) -> None:
    cert, key = tls_files
    with GatewayThread(
        decoder.target,
        sock_dir,
        tls_cert=str(cert),
        tls_key=str(key),
        auth_token=TOKEN,
        http_host="127.0.0.1",
        http_port=0,
    ) as gw:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        # Over a Unix socket the authority is the socket path: name the certificate's host.
        name = [("grpc.ssl_target_name_override", "localhost")]
        with grpc.secure_channel(gw.gateway.address, credentials, options=name) as channel:
            stub = gateway_pb2_grpc.OmniGatewayServiceStub(channel)
            assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as info:
                speak_request(stub)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            chunks = speak_request(stub, [("authorization", f"Bearer {TOKEN}")])
            assert chunks[-1].final
        # A plaintext client cannot talk to it.
        with pytest.raises(grpc.RpcError) as info:
            speak_request(gw.stub, [("authorization", f"Bearer {TOKEN}")])
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        wait_for_health_sync(
            gw.gateway.address, 5, credentials=credentials, tls_server_name="localhost"
        )

        context = ssl.create_default_context(cafile=str(cert))
        port = gw.http_port
        assert get(port, "/health", context=context)[0] == 200
        status, _, body = post(
            port,
            SPEECH_BODY,
            {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
            context=context,
        )
        assert status == 200 and len(body) > 0
        with pytest.raises((ssl.SSLError, http.client.HTTPException, ConnectionError)):
            get(port, "/health")  # plain HTTP to a TLS port
        with httpx.Client(verify=context) as http_client:
            client = openai.OpenAI(
                base_url=f"https://127.0.0.1:{port}/v1",
                api_key=TOKEN,
                max_retries=0,
                http_client=http_client,
            )
            audio = client.audio.speech.create(
                model="m", voice="alice", input="hello", response_format="pcm"
            ).content
        assert audio == body

        out = sock_dir / "tls.wav"
        for url in (None, f"https://127.0.0.1:{port}"):
            result = speak_client.speak(
                gw.gateway.address,
                "hello",
                out,
                voice="alice",
                http_url=url,
                token=TOKEN,
                tls_ca=str(cert),
                tls_server_name="localhost",
                progress=False,
            )
            assert result["samples"] * 2 == len(body)


def test_python_m_gateway_tls_and_token_from_env_and_file(
    decoder: FakeDecoder, sock_dir: Path, tls_files
) -> None:
    cert, key = tls_files
    token_file = sock_dir / "token"
    token_file.write_text(f"{TOKEN}\n")
    env = {
        "OMNI_GATEWAY_TLS_CERT": str(cert),
        "OMNI_GATEWAY_TLS_KEY": str(key),
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--listen", "127.0.0.1:0", "--decoder", decoder.target,
         "--auth-token-file", str(token_file), "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("gateway listening on 127.0.0.1:") and line.rstrip().endswith(
            "(TLS)"
        ), f"{line=} stderr={proc.stderr.read() if proc.poll() is not None else ''}"
        address = line.split()[3]
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(address, credentials) as channel:
            stub = gateway_pb2_grpc.OmniGatewayServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                speak_request(stub)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert speak_request(stub, [("authorization", f"Bearer {TOKEN}")])[-1].final
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, proc.stderr.read()


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--tls-cert", "/x.pem"], {}, "--tls-cert and --tls-key"),
        ([], {"OMNI_GATEWAY_TLS_KEY": "/k.pem"}, "--tls-cert and --tls-key"),
        (["--auth-token-file", "/nonexistent/token"], {}, "--auth-token-file"),
        (["--allowed-origins", "https://app.example/"], {}, "--allowed-origins: "),
        ([], {"OMNI_GATEWAY_ALLOWED_ORIGINS": "app.example"}, "--allowed-origins: "),
    ],
)
def test_bad_access_options_are_refused(args, env, message, monkeypatch, capsys) -> None:
    from gateway.__main__ import parse_args

    for name in ACCESS_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit):
        parse_args(["--listen", "127.0.0.1:0", "--decoder", "unix:///d.sock", *args])
    assert message in capsys.readouterr().err


ACCESS_ENV = (
    "OMNI_GATEWAY_TLS_CERT",
    "OMNI_GATEWAY_TLS_KEY",
    "OMNI_GATEWAY_TOKEN",
    "OMNI_GATEWAY_TOKEN_FILE",
    "OMNI_GATEWAY_ALLOWED_ORIGINS",
)


def test_allowed_origins_from_the_option_or_the_environment(monkeypatch) -> None:
    from gateway.__main__ import parse_args

    for name in ACCESS_ENV:
        monkeypatch.delenv(name, raising=False)
    base = ["--listen", "127.0.0.1:0", "--decoder", "unix:///d.sock"]
    assert parse_args(base).allowed_origins == ()
    monkeypatch.setenv("OMNI_GATEWAY_ALLOWED_ORIGINS", "https://a.example, http://b.example:81")
    assert parse_args(base).allowed_origins == ("https://a.example", "http://b.example:81")
    # The option wins; it may be repeated.
    args = [*base, "--allowed-origins", "https://c.example:443", "--allowed-origins", "*"]
    assert parse_args(args).allowed_origins == ("https://c.example", "*")
    with pytest.raises(InvalidArgumentError, match="allowed_origins"):
        GatewayConfig(listen="127.0.0.1:0", decoder="unix:///d.sock", allowed_origins=["x"])


def test_unreadable_certificate_is_refused_before_serving(decoder: FakeDecoder, sock_dir) -> None:
    (sock_dir / "bad.pem").write_text("not a certificate")
    config = GatewayConfig(
        listen=f"unix://{sock_dir / 'gw.sock'}",
        decoder=decoder.target,
        tls_cert=str(sock_dir / "bad.pem"),
        tls_key=str(sock_dir / "bad.pem"),
    )
    with pytest.raises(FailedPreconditionError, match="bad.pem: not a PEM file"):
        asyncio.run(start_gateway(config))
    assert not (sock_dir / "gw.sock").exists()
    with pytest.raises(InvalidArgumentError, match="tls"):
        GatewayConfig(listen="127.0.0.1:0", decoder=decoder.target, tls_cert="/c.pem")
