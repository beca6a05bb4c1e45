"""Browser credentials on the WebSocket routes: subprotocol keys, minted client keys, Origin.

The real gateway (`GatewayThread`) over `FakeDecoder` (a test double), with
and without a token. Handshakes are sent with the stdlib (`http.client`), so
the test sees the exact status, headers and JSON body of a refused upgrade
and the ``Sec-WebSocket-Protocol`` a 101 echoes; whole calls run through
aiohttp's client. Keys are minted with the official `openai` client.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from fakes import FakeDecoder, FakeDecoderConfig, GatewayThread

from gateway.http_auth import (
    KEY_PROTOCOL_PREFIX,
    AllowedOrigins,
    ClientKeys,
    parse_allowed_origins,
)
from gateway.http_realtime import PROTOCOL as REALTIME_PROTOCOL
from gateway.http_realtime import ROUTE as REALTIME_ROUTE
from gateway.http_ws import PROTOCOL, ROUTE
from omni_common.errors import InvalidArgumentError

TOKEN = "ws-test-token"
OTHER_ORIGIN = "http://app.example:3000"


# ---------------------------------------------------------------------------
# Client keys and origins, no server.


def test_client_keys_round_trip_expire_and_belong_to_their_token() -> None:
    now = 1_700_000_000.0
    keys = ClientKeys(TOKEN, clock=lambda: now)
    key, expires_at = keys.mint(60)
    assert key.startswith("ek_") and expires_at == 1_700_000_060, (key, expires_at)
    assert keys.valid(key)
    # Another gateway with the same token accepts it; one with another token does not.
    assert ClientKeys(TOKEN, clock=lambda: now).valid(key)
    assert not ClientKeys("other-token", clock=lambda: now).valid(key)
    assert not ClientKeys(TOKEN, clock=lambda: now + 60).valid(key), "valid at its expiry"
    assert ClientKeys(TOKEN, clock=lambda: now + 59).valid(key)
    assert keys.mint(60)[0] != key, "two keys minted in the same second are equal"
    # Every character counts (57 bytes are 76 base64 characters, no spare bits).
    for i in range(len(key)):
        flipped = key[:i] + ("A" if key[i] != "A" else "B") + key[i + 1 :]
        assert not keys.valid(flipped), f"still valid with character {i} changed"
    for garbage in ("", "ek_", "ek_!!!!", "ek_é", TOKEN, key[3:], key + "A", key[:-4]):
        assert not keys.valid(garbage), garbage


@pytest.mark.parametrize("seconds", [9, 7201, -1, 0])
def test_client_key_lifetime_is_bounded(seconds: int) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        ClientKeys(TOKEN).mint(seconds)
    assert info.value.field == "expires_after.seconds", info.value


def test_allowed_origins_are_parsed_and_normalised() -> None:
    got = parse_allowed_origins(["HTTPS://App.Example:443, http://a.example:80", "*"])
    assert got == ("https://app.example", "http://a.example", "*"), got
    assert parse_allowed_origins("http://[::1]:8080") == ("http://[::1]:8080",)
    assert parse_allowed_origins("") == ()
    for bad in ("https://a.example/", "ftp://a.example", "a.example", "http://", "null"):
        with pytest.raises(InvalidArgumentError, match="--allowed-origins") as info:
            parse_allowed_origins(bad)
        assert info.value.field == "--allowed-origins", bad


@pytest.mark.parametrize(
    ("origin", "host", "listed", "ok"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1:8000", (), True),
        ("http://LOCALHOST:8000", "localhost:8000", (), True),
        ("https://omni.example", "omni.example", (), True),  # behind a proxy that ends TLS
        ("https://omni.example", "omni.example:443", (), True),
        ("http://omni.example", "omni.example:80", (), True),
        ("http://[::1]:8000", "[::1]:8000", (), True),
        ("http://127.0.0.1:8001", "127.0.0.1:8000", (), False),
        ("http://localhost:8000", "127.0.0.1:8000", (), False),
        ("https://omni.example", "omni.example:8443", (), False),
        ("http://evil.example", "127.0.0.1:8000", (), False),
        ("http://evil.example", None, (), False),
        ("null", "127.0.0.1:8000", (), False),
        ("http://127.0.0.1:8000/x", "127.0.0.1:8000", (), False),
        (OTHER_ORIGIN, "127.0.0.1:8000", (OTHER_ORIGIN,), True),
        ("http://app.example:3001", "127.0.0.1:8000", (OTHER_ORIGIN,), False),
        ("https://app.example:3000", "127.0.0.1:8000", (OTHER_ORIGIN,), False),
        ("http://anything.example", "127.0.0.1:8000", ("*",), True),
    ],
)
def test_origin_rules(origin: str, host: str | None, listed: tuple, ok: bool) -> None:
    assert AllowedOrigins(listed).allows(origin, host) is ok


# ---------------------------------------------------------------------------
# Handshakes against the real gateway.


class Handshake:
    """The answer to one upgrade request: status, headers (lower-case names), JSON body."""

    def __init__(self, response: http.client.HTTPResponse) -> None:
        self.status = response.status
        self.headers = {k.lower(): v for k, v in response.getheaders()}
        self.body = response.read() if self.status != 101 else b""

    @property
    def error(self) -> dict:
        return json.loads(self.body)["error"]


def handshake(port: int, headers: dict[str, str], path: str = ROUTE) -> Handshake:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(
            "GET",
            path,
            headers={
                "Upgrade": "websocket",
                "Connection": "Upgrade",
                "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode(),
                "Sec-WebSocket-Version": "13",
                **headers,
            },
        )
        return Handshake(conn.getresponse())
    finally:
        conn.close()


def key_protocols(key: str) -> dict[str, str]:
    return {"Sec-WebSocket-Protocol": f"{PROTOCOL}, {KEY_PROTOCOL_PREFIX}{key}"}


def accepted(answer: Handshake) -> None:
    assert answer.status == 101, (answer.status, answer.body[:300])


def refused(answer: Handshake, status: int, code: str, param: str | None) -> None:
    assert answer.status == status, (answer.status, answer.body[:300])
    error = answer.error
    assert (error["code"], error["param"]) == (code, param), error
    assert error["type"] == "invalid_request_error", error


def speak_over_websocket(
    port: int, *, headers: dict[str, str] | None = None, protocols: tuple[str, ...] = ()
) -> tuple[str | None, list[str], int]:
    """One whole call: (echoed protocol, event types, audio bytes)."""

    async def run() -> tuple[str | None, list[str], int]:
        url = f"http://127.0.0.1:{port}{ROUTE}"
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(url, headers=headers or {}, protocols=protocols) as ws,
        ):
            await ws.send_json({"type": "config", "seed": 1})
            await ws.send_json({"type": "text", "text": "Hello there."})
            await ws.send_json({"type": "end"})
            events, audio = [], 0
            async for message in ws:
                if message.type is aiohttp.WSMsgType.BINARY:
                    audio += len(message.data)
                else:
                    event = json.loads(message.data)
                    # an error event carries its message, so a failure says why
                    events.append(event["type"] if event["type"] != "error" else f"error: {event}")
            return ws.protocol, events, audio

    return asyncio.run(run())


@pytest.fixture
def decoder(sock_dir: Path) -> Iterator[FakeDecoder]:
    with FakeDecoder(sock_dir / "decoder.sock", FakeDecoderConfig(num_chunks=3)) as fake:
        yield fake


@pytest.fixture
def gateway(decoder: FakeDecoder, sock_dir: Path) -> Iterator[GatewayThread]:
    with GatewayThread(
        decoder.target,
        sock_dir,
        http_host="127.0.0.1",
        http_port=0,
        auth_token=TOKEN,
        allowed_origins=(OTHER_ORIGIN,),
    ) as gw:
        yield gw


def mint(port: int, api_key: str = TOKEN, seconds: int = 60) -> tuple[str, int]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0)
    secret = client.realtime.client_secrets.create(
        expires_after={"anchor": "created_at", "seconds": seconds}
    )
    return secret.value, secret.expires_at


WHOLE_CALL = ["ready", "segment.start", "segment.end", "end"]


def test_a_minted_key_in_the_subprotocol_opens_the_websocket(gateway: GatewayThread) -> None:
    port = gateway.http_port
    before = time.time()
    key, expires_at = mint(port)
    assert key.startswith("ek_") and before + 59 <= expires_at <= time.time() + 60, expires_at
    answer = handshake(port, key_protocols(key))
    accepted(answer)
    # The route's protocol is echoed, never the entry that carries the key.
    assert answer.headers["sec-websocket-protocol"] == PROTOCOL, answer.headers
    protocol, events, audio = speak_over_websocket(
        port, protocols=(PROTOCOL, KEY_PROTOCOL_PREFIX + key)
    )
    assert (protocol, events) == (PROTOCOL, WHOLE_CALL) and audio == 3 * 480 * 2, (events, audio)
    # The key also works as a bearer header on the WebSocket route...
    accepted(handshake(port, {"Authorization": f"Bearer {key}"}))
    # ...and nowhere else: not the HTTP API, not /metrics, not minting another key.
    for method, path in (
        ("POST", "/v1/audio/speech"),
        ("GET", "/metrics"),
        ("POST", "/v1/realtime/client_secrets"),
    ):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request(method, path, body=b"{}", headers={"Authorization": f"Bearer {key}"})
        status = conn.getresponse().status
        conn.close()
        assert status == 401, (method, path, status)


def test_the_token_in_the_subprotocol_opens_the_websocket(gateway: GatewayThread) -> None:
    answer = handshake(gateway.http_port, key_protocols(TOKEN))
    accepted(answer)
    assert answer.headers["sec-websocket-protocol"] == PROTOCOL, answer.headers
    protocol, events, _ = speak_over_websocket(
        gateway.http_port, protocols=(PROTOCOL, KEY_PROTOCOL_PREFIX + TOKEN)
    )
    assert (protocol, events) == (PROTOCOL, WHOLE_CALL)


def test_wrong_expired_and_foreign_keys_are_401(
    gateway: GatewayThread, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    port = gateway.http_port
    expired, _ = ClientKeys(TOKEN).mint(10, now=time.time() - 11)
    foreign, _ = ClientKeys("another-token").mint(60)
    live, _ = mint(port)
    for key in ("nope", expired, foreign, live[:-2], TOKEN + "x"):
        answer = handshake(port, key_protocols(key))
        refused(answer, 401, "invalid_api_key", None)
        assert answer.headers["www-authenticate"] == "Bearer", answer.headers
        assert "Sec-WebSocket-Protocol" in answer.error["message"], answer.error
        assert "sec-websocket-protocol" not in answer.headers, answer.headers
        assert key not in answer.body.decode(), "the key is in the answer"
    # No credentials at all, a wrong header, or a wrong key beside a right header.
    refused(handshake(port, {}), 401, "invalid_api_key", None)
    refused(handshake(port, {"Authorization": "Bearer nope"}), 401, "invalid_api_key", None)
    both = {"Authorization": f"Bearer {TOKEN}", **key_protocols("nope")}
    refused(handshake(port, both), 401, "invalid_api_key", None)
    accepted(handshake(port, {"Authorization": f"Bearer {TOKEN}", **key_protocols(live)}))
    # Basic credentials a browser holds for the site are not the gateway's: the key decides.
    basic = {"Authorization": "Basic dXNlcjpwYXNz"}
    accepted(handshake(port, {**basic, **key_protocols(live)}))
    refused(handshake(port, {**basic, **key_protocols("nope")}), 401, "invalid_api_key", None)
    refused(handshake(port, basic), 401, "invalid_api_key", None)
    refused(handshake(port, {"Authorization": "Bearer"}), 401, "invalid_api_key", None)
    assert "no valid WebSocket credentials" in caplog.text, "the refusals are not in the log"
    assert "minted a WebSocket client key" in caplog.text, "the minting is not in the log"
    for secret in (TOKEN, live, expired, foreign):
        assert secret not in caplog.text, "a credential was logged"


def test_malformed_protocol_offers_are_400(gateway: GatewayThread) -> None:
    port = gateway.http_port
    key, _ = mint(port)
    only_key = {"Sec-WebSocket-Protocol": KEY_PROTOCOL_PREFIX + key}
    answer = handshake(port, only_key)
    refused(answer, 400, "invalid_argument", "Sec-WebSocket-Protocol")
    assert PROTOCOL in answer.error["message"] and key not in answer.body.decode(), answer.error
    two_keys = {
        "Sec-WebSocket-Protocol": f"{PROTOCOL}, {KEY_PROTOCOL_PREFIX}{key}, "
        f"{KEY_PROTOCOL_PREFIX}{key}"
    }
    refused(handshake(port, two_keys), 400, "invalid_argument", "Sec-WebSocket-Protocol")


def test_origin_is_checked_on_upgrades(gateway: GatewayThread) -> None:
    port = gateway.http_port
    key, _ = mint(port)
    same = f"http://127.0.0.1:{port}"
    accepted(handshake(port, {"Origin": same, **key_protocols(key)}))
    accepted(handshake(port, {"Origin": OTHER_ORIGIN, **key_protocols(key)}))
    for origin in ("http://evil.example", f"http://localhost:{port}", "null"):
        # Refused before the credentials are looked at: a right token does not help.
        answer = handshake(port, {"Origin": origin, "Authorization": f"Bearer {TOKEN}"})
        refused(answer, 403, "origin_not_allowed", "Origin")
        assert answer.error["message"].startswith("Origin: "), answer.error
    # Without Origin (not a browser) the bearer header is enough, as before.
    protocol, events, _ = speak_over_websocket(port, headers={"Authorization": f"Bearer {TOKEN}"})
    assert (protocol, events) == (None, WHOLE_CALL)


def test_the_realtime_route_takes_a_browsers_credentials_as_openais_clients_send_them(
    gateway: GatewayThread,
) -> None:
    """``GET /v1/realtime``: a minted key (or the token) in an
    ``openai-insecure-api-key.`` entry beside ``realtime``; the same refusals
    as the other WebSocket route; a session opens (``session.created``)."""
    port = gateway.http_port
    key, _ = mint(port)
    offer = {"Sec-WebSocket-Protocol": f"{REALTIME_PROTOCOL}, {KEY_PROTOCOL_PREFIX}{key}"}
    answer = handshake(port, {"Origin": f"http://127.0.0.1:{port}", **offer}, path=REALTIME_ROUTE)
    accepted(answer)
    assert answer.headers["sec-websocket-protocol"] == REALTIME_PROTOCOL, answer.headers
    refused(handshake(port, {}, path=REALTIME_ROUTE), 401, "invalid_api_key", None)
    refused(handshake(port, {"Sec-WebSocket-Protocol": f"{REALTIME_PROTOCOL}, {KEY_PROTOCOL_PREFIX}nope"},
                      path=REALTIME_ROUTE), 401, "invalid_api_key", None)
    refused(handshake(port, {"Origin": "http://evil.example", **offer}, path=REALTIME_ROUTE), 403,
            "origin_not_allowed", "Origin")

    async def first_event() -> tuple[str | None, dict]:
        url = f"http://127.0.0.1:{port}{REALTIME_ROUTE}"
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(url, protocols=(REALTIME_PROTOCOL, KEY_PROTOCOL_PREFIX + key)) as ws,
        ):
            return ws.protocol, json.loads((await ws.receive()).data)

    protocol, event = asyncio.run(first_event())
    assert (protocol, event["type"]) == (REALTIME_PROTOCOL, "session.created"), event


def test_minting_checks_its_body_and_needs_the_token(gateway: GatewayThread) -> None:
    port = gateway.http_port

    def post(body: bytes, token: str | None = TOKEN) -> tuple[int, dict, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        conn.request("POST", "/v1/realtime/client_secrets", body=body, headers=headers)
        response = conn.getresponse()
        out = (response.status, dict(response.getheaders()), json.loads(response.read()))
        conn.close()
        return out

    status, headers, body = post(b"")
    assert status == 200 and headers["Cache-Control"] == "no-store", (status, headers)
    assert body["expires_at"] - time.time() == pytest.approx(600, abs=2), body
    assert body["session"] == {"type": "realtime"} and ClientKeys(TOKEN).valid(body["value"])
    session = {"type": "realtime", "audio": {"output": {"voice": "alice"}}}
    assert post(json.dumps({"session": session}).encode())[2]["session"] == session
    for raw, param in (
        (b'{"expires_after": {"seconds": 9}}', "expires_after.seconds"),
        (b'{"expires_after": {"seconds": 7201}}', "expires_after.seconds"),
        (b'{"expires_after": {"seconds": 60.5}}', "expires_after.seconds"),
        (b'{"expires_after": {"anchor": "now", "seconds": 60}}', "expires_after.anchor"),
        (b'{"expires_after": 60}', "expires_after"),
        (b'{"session": "x"}', "session"),
        (b"[]", "body"),
        (b"{nope", None),
    ):
        status, _, body = post(raw)
        assert (status, body["error"]["param"]) == (400, param), (raw, body)
    assert post(b"{}", token=None)[0] == 401
    assert post(b"{}", token="wrong")[0] == 401


def test_an_open_gateway_is_unchanged_but_checks_origin(
    decoder: FakeDecoder, sock_dir: Path
) -> None:
    with GatewayThread(decoder.target, sock_dir, http_host="127.0.0.1", http_port=0) as gw:
        port = gw.http_port
        # A client of an open gateway sends nothing, as before.
        protocol, events, audio = speak_over_websocket(port)
        assert (protocol, events) == (None, WHOLE_CALL) and audio > 0, events
        # Code written for a protected gateway works too: any key, the protocol echoed.
        key, _ = mint(port, api_key="anything")
        for offered in (key, "whatever"):
            answer = handshake(
                port, {"Origin": f"http://127.0.0.1:{port}", **key_protocols(offered)}
            )
            accepted(answer)
            assert answer.headers["sec-websocket-protocol"] == PROTOCOL, answer.headers
        # Other origins are refused here too: no page on the web may use a local gateway.
        answer = handshake(port, {"Origin": OTHER_ORIGIN})
        refused(answer, 403, "origin_not_allowed", "Origin")
