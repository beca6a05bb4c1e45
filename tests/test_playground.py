"""The playground page at / in a real headless Chromium (selenium + Debian's chromium-driver).

A real stack (materializer + fake-engine decoder + gateway with HTTP) serves
the page; the browser types text, clicks Speak and streams the audio through
Web Audio. The test compares what the page received with what
``/v1/audio/speech`` returns for the same request, checks the TTFP figure in
the DOM, and saves a screenshot (``$OMNI_TEST_ARTIFACTS`` or pytest's tmp_path).
The stream mode (text in over the WebSocket) runs on an open stack and on a
token-protected one, where the page mints a key for the WebSocket; pages
served from two other origins check the gateway's ``Origin`` rule.

Without /usr/bin/chromium, /usr/bin/chromedriver or selenium the browser
tests skip, except under ``CI=true`` where they fail.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import http.client
import http.server
import json
import os
import re
import shutil
import tempfile
import threading
import tomllib
from collections.abc import Iterator
from decimal import ROUND_HALF_UP, Decimal
from fnmatch import fnmatch
from pathlib import Path

import aiohttp
import pytest
from fakes import FakeDecoder, FakeDecoderConfig, GatewayThread

from gateway.http_auth import KEY_PROTOCOL_PREFIX, ClientKeys
from gateway.http_playground import PLAYGROUND_DIR
from gateway.http_ws import PROTOCOL, ROUTE
from omni_stack.config import StackConfig
from omni_stack.stack import Stack

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
    "--window-size=1100,900",
]
TEXT = "Hello from the playground, streamed while it plays."
VOICE = "alloy"
SEED = 7
TOKEN = "playground-test-token"
LIVE = (
    "const p = window.playground; return p && {state: p.state, ready: p.ready,"
    " samplesReceived: p.samplesReceived, bytesReceived: p.bytesReceived, ttfpMs: p.ttfpMs,"
    " rtf: p.rtf, sampleRate: p.sampleRate, error: p.error, mode: p.mode,"
    " scheduledSeconds: p.scheduledSeconds, transcript: p.transcript, segments: p.segments,"
    " protocol: p.protocol};"
)


def _browser_missing() -> str | None:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        return f"{' and '.join(missing)} not installed (apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the dev extra)"
    return None


def _require_browser() -> None:
    reason = _browser_missing()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and the playground browser test cannot run: {reason}")
    pytest.skip(reason)


def _chromium(*flags: str) -> Iterator:
    """A headless Chromium driven by selenium (CHROMIUM_FLAGS and `flags`), quit after use."""
    _require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="omni-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}", *flags]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    yield from _chromium()


def _stack(tmp_path_factory, profile: str, token: str | None = None) -> Iterator[Stack]:
    _require_browser()  # no services started for a test that will skip
    runtime = tmp_path_factory.mktemp("rt")
    token_file = ""
    if token is not None:
        token_file = str(tmp_path_factory.mktemp("token") / "token")
        Path(token_file).write_text(token)
    s = Stack(
        StackConfig(
            profile=profile,
            engine="fake",
            runtime_dir=str(runtime),
            port=0,
            http_port=0,
            log_level="WARNING",
            auth_token_file=token_file,
            # No /metrics ports: fewer ports picked ahead of the start that another test may take.
            decoder_metrics_port=-1,
            materializer_metrics_port=-1,
        )
    )
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    """The speech (tts) profile."""
    yield from _stack(tmp_path_factory, "tts")


@pytest.fixture(scope="module")
def omni_stack(tmp_path_factory) -> Iterator[Stack]:
    """The omni profile: text and audio, for the chat mode."""
    yield from _stack(tmp_path_factory, "omni")


@pytest.fixture(scope="module")
def token_stack(tmp_path_factory) -> Iterator[Stack]:
    """The speech (tts) profile behind a token."""
    yield from _stack(tmp_path_factory, "tts", token=TOKEN)


def _post_speech(port: int, body: dict, token: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request("POST", "/v1/audio/speech", body=json.dumps(body).encode(), headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _get(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def js_round(x: float, digits: int) -> str:
    """What the page shows for a positive number: JavaScript's Math.round
    (digits 0) and toFixed(digits) round a tie up, Python's round and format
    to the even neighbour (126.5 ms: the page says 127, round() 126)."""
    return str(Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def _live(driver) -> dict:
    return driver.execute_script(LIVE) or {}


def _wait(driver, predicate, timeout_s: float, what: str):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.05).until(predicate)
    except TimeoutException:
        pytest.fail(f"timed out after {timeout_s}s waiting for {what}; page state: {_live(driver)}")


def _open(driver, base: str) -> None:
    driver.get(f"{base}/")
    _wait(driver, lambda d: _live(d).get("ready"), 20, "the model list to load")


def _fill(driver, text: str, *, voice: str | None = None, seed: str = "") -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    area = driver.find_element(By.ID, "text")
    area.clear()
    if text:
        area.send_keys(text)
    if voice is not None:
        select = driver.find_element(By.ID, "voice-select")
        if select.is_displayed():  # voices from /v1/models
            Select(select).select_by_value(voice)
        else:  # the free voice field (no /v1/models)
            field = driver.find_element(By.ID, "voice-input")
            field.clear()
            field.send_keys(voice)
    seed_field = driver.find_element(By.ID, "seed")
    seed_field.clear()
    if seed:
        seed_field.send_keys(seed)


def _speak_and_wait(driver) -> dict:
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "speak").click()
    _wait(
        driver,
        lambda d: _live(d).get("state") in ("done", "error", "stopped"),
        60,
        "the speech stream to end",
    )
    return _live(driver)


def _artifact_dir(tmp_path: Path) -> Path:
    root = os.environ.get("OMNI_TEST_ARTIFACTS")
    path = Path(root) if root else tmp_path
    path.mkdir(parents=True, exist_ok=True)
    return path


def _waveform_pixels(driver) -> int:
    """Painted pixels of the waveform canvas away from its centre line."""
    return driver.execute_script(
        """
        const c = document.getElementById('waveform');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        const mid = Math.floor(c.height / 2), band = 3;
        let n = 0;
        for (let y = 0; y < c.height; y++) {
          if (Math.abs(y - mid) <= band) continue;
          for (let x = 0; x < c.width; x++) if (d[(y * c.width + x) * 4 + 3] > 0) n++;
        }
        return n;
        """
    )


@pytest.mark.e2e
def test_page_streams_speech_like_the_api(browser, stack: Stack, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    base = stack.http_url
    _open(browser, base)
    _fill(browser, TEXT, voice=VOICE, seed=str(SEED))
    browser.find_element(By.ID, "speak").click()
    # Live: audio has arrived and the TTFP figure shows before the end is awaited.
    _wait(
        browser,
        lambda d: (
            _live(d).get("samplesReceived", 0) > 0
            and re.fullmatch(r"\d+ ms", d.find_element(By.ID, "ttfp").text)
        ),
        30,
        "the first audio and the TTFP figure",
    )
    _wait(browser, lambda d: _live(d).get("state") in ("done", "error", "stopped"), 60, "the end")
    live = _live(browser)
    shot = _artifact_dir(tmp_path) / "playground.png"
    browser.save_screenshot(str(shot))
    print(f"playground screenshot: {shot}")

    assert live["state"] == "done" and live["error"] is None, live
    status, pcm = _post_speech(
        stack.cfg.http_port,
        {
            "model": "omni-serving",
            "input": TEXT,
            "voice": VOICE,
            "response_format": "pcm",
            "stream": True,
            "seed": SEED,
        },
    )
    assert status == 200 and len(pcm) > 0, pcm[:300]
    assert live["bytesReceived"] == len(pcm), f"{live=} {len(pcm)=}"
    assert live["samplesReceived"] == len(pcm) // 2, f"{live=} {len(pcm)=}"
    assert live["sampleRate"] == 24000
    # Every sample went to Web Audio (AudioBufferSourceNodes), not just counted.
    assert live["scheduledSeconds"] == pytest.approx(len(pcm) / 2 / 24000, abs=1e-6), live

    assert live["ttfpMs"] > 0 and live["rtf"] > 0, live
    assert browser.find_element(By.ID, "ttfp").text == f"{js_round(live['ttfpMs'], 0)} ms"
    assert browser.find_element(By.ID, "samples").text == str(len(pcm) // 2)
    assert browser.find_element(By.ID, "rtf").text == js_round(live["rtf"], 3)
    assert _waveform_pixels(browser) > 100, "the waveform canvas stayed blank"
    assert not browser.find_element(By.ID, "error").is_displayed()


@pytest.mark.e2e
def test_page_shows_the_servers_error(browser, stack: Stack) -> None:
    from selenium.webdriver.common.by import By

    _open(browser, stack.http_url)
    _fill(browser, "")  # the server refuses an empty input
    live = _speak_and_wait(browser)
    assert live["state"] == "error" and live["samplesReceived"] == 0, live
    shown = browser.find_element(By.ID, "error")
    assert shown.is_displayed()
    assert shown.text.startswith("HTTP 400: input:"), shown.text
    assert "invalid_request_error" in shown.text and "param: input" in shown.text, shown.text
    assert browser.find_element(By.ID, "ttfp").text == "–"


@pytest.mark.e2e
def test_pcm_decoder_joins_odd_byte_boundaries(browser, stack: Stack) -> None:
    _open(browser, stack.http_url)
    got = browser.execute_script(
        """
        const samples = [0, 1, -1, 32767, -32768, 12345, -2];
        const bytes = new Uint8Array(samples.length * 2);
        const view = new DataView(bytes.buffer);
        samples.forEach((s, i) => view.setInt16(2 * i, s, true));
        const dec = new window.playground.Pcm16Decoder();
        const out = [];
        for (const [a, b] of [[0, 1], [1, 4], [4, 5], [5, 5], [5, 12], [12, 14]]) {
          for (const v of dec.push(bytes.subarray(a, b))) out.push(Math.round(v * 32768));
        }
        return {out, pending: dec.pendingBytes};
        """
    )
    assert got == {"out": [0, 1, -1, 32767, -32768, 12345, -2], "pending": 0}


def _chat_reference(port: int, body: dict) -> tuple[str, int]:
    """(transcript, PCM bytes) of a streamed chat completion, read with the stdlib."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        assert response.status == 200, response.read()[:300]
        events = response.read().decode().split("\n\n")
    finally:
        conn.close()
    text, audio = "", 0
    data = [e.removeprefix("data: ") for e in events if e.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    for item in data[:-1]:
        delta = json.loads(item)["choices"][0]["delta"]
        text += delta.get("content") or delta.get("audio", {}).get("transcript", "")
        audio += len(base64.b64decode(delta.get("audio", {}).get("data", "")))
    return text, audio


@pytest.mark.e2e
def test_chat_mode_streams_text_and_audio(browser, omni_stack: Stack, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    _open(browser, omni_stack.http_url)
    Select(browser.find_element(By.ID, "mode")).select_by_value("chat")
    assert browser.find_element(By.ID, "chat-panel").is_displayed()
    _fill(browser, "Hi there", voice=VOICE, seed="3")
    live = _speak_and_wait(browser)
    shot = _artifact_dir(tmp_path) / "playground-chat.png"
    browser.save_screenshot(str(shot))
    print(f"playground chat screenshot: {shot}")
    assert live["state"] == "done" and live["error"] is None and live["mode"] == "chat", live

    model = Select(browser.find_element(By.ID, "model")).first_selected_option.text
    text, audio_bytes = _chat_reference(
        omni_stack.cfg.http_port,
        {
            "model": model,
            "messages": [{"role": "user", "content": "Hi there"}],
            "modalities": ["text", "audio"],
            "audio": {"voice": VOICE, "format": "pcm16"},
            "stream": True,
            "seed": 3,
        },
    )
    assert text and audio_bytes, (text, audio_bytes)
    assert live["transcript"] == text
    assert browser.find_element(By.ID, "transcript").text == text
    assert live["bytesReceived"] == audio_bytes, f"{live=} {audio_bytes=}"
    assert live["samplesReceived"] == audio_bytes // 2
    assert re.fullmatch(r"\d+ ms", browser.find_element(By.ID, "ttfp").text)


@pytest.mark.e2e
def test_stop_aborts_the_stream(browser, sock_dir: Path) -> None:
    from selenium.webdriver.common.by import By

    config = FakeDecoderConfig(num_chunks=200, delay_s=0.05)  # a 10 s stream
    with (
        FakeDecoder(sock_dir / "decoder.sock", config) as fake,
        GatewayThread(fake.target, sock_dir, http_host="127.0.0.1", http_port=0) as gw,
    ):
        _open(browser, f"http://127.0.0.1:{gw.http_port}")
        _fill(browser, TEXT)
        browser.find_element(By.ID, "speak").click()
        _wait(browser, lambda d: _live(d).get("samplesReceived", 0) > 0, 20, "the first audio")
        browser.find_element(By.ID, "stop").click()
        _wait(browser, lambda d: _live(d).get("state") != "streaming", 10, "the stop")
        live = _live(browser)
        assert live["state"] == "stopped" and live["error"] is None, live
        assert 0 < live["samplesReceived"] < 200 * 480, live
        # The page's abort closes the connection; the gateway aborts the decoder request.
        assert fake.wait_for(lambda: len(fake.state.aborts) == 1), f"{fake.state.aborts=}"


@pytest.fixture
def token_gateway(sock_dir: Path) -> Iterator[GatewayThread]:
    with (
        FakeDecoder(sock_dir / "decoder.sock", FakeDecoderConfig(num_chunks=5)) as fake,
        GatewayThread(
            fake.target, sock_dir, http_host="127.0.0.1", http_port=0, auth_token=TOKEN
        ) as gw,
    ):
        yield gw


def test_page_is_open_with_a_token_and_the_api_is_not(token_gateway: GatewayThread) -> None:
    port = token_gateway.http_port
    for path, name, kind in [
        ("/", "index.html", "text/html"),
        ("/playground/playground.js", "playground.js", "text/javascript"),
        ("/playground/playground.css", "playground.css", "text/css"),
    ]:
        for method in ("GET", "HEAD"):
            status, headers, body = _get(port, path, method)
            assert status == 200, (method, path, body[:200])
            assert headers["content-type"].startswith(kind), headers
            assert "connect-src 'self'" in headers["content-security-policy"], headers
            want = b"" if method == "HEAD" else (PLAYGROUND_DIR / name).read_bytes()
            assert body == want, (method, path)
    for method, path in [
        ("GET", "/metrics"),
        ("GET", "/playground/other.js"),
        ("GET", "/playground/../http_facade.py"),
        ("POST", "/"),
    ]:
        status, headers, body = _get(port, path, method)
        assert status == 401, (method, path, status)
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert _post_speech(port, {"model": "m", "input": "hi"})[0] == 401
    status, pcm = _post_speech(port, {"model": "m", "input": "hi"}, token=TOKEN)
    assert status == 200 and pcm


@pytest.mark.e2e
def test_page_sends_the_token(browser, token_gateway: GatewayThread) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    base = f"http://127.0.0.1:{token_gateway.http_port}"
    _open(browser, base)
    _fill(browser, TEXT)
    live = _speak_and_wait(browser)
    assert live["state"] == "error" and "invalid_api_key" in live["error"], live
    token = browser.find_element(By.ID, "token")
    token.send_keys(TOKEN + Keys.TAB)
    live = _speak_and_wait(browser)
    status, pcm = _post_speech(
        token_gateway.http_port,
        {"model": "m", "input": TEXT, "response_format": "pcm"},
        token=TOKEN,
    )
    assert live["state"] == "done" and live["error"] is None, live
    assert live["samplesReceived"] == len(pcm) // 2 > 0, f"{live=} {len(pcm)=}"


def test_page_files_ship_and_stay_on_the_origin() -> None:
    config = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["gateway"]
    files = sorted(p.name for p in PLAYGROUND_DIR.iterdir() if p.is_file())
    assert {"index.html", "playground.js", "playground.css"} <= set(files), files
    for name in files:
        assert any(fnmatch(f"playground/{name}", pat) for pat in patterns), (name, patterns)
        text = (PLAYGROUND_DIR / name).read_text()
        assert not re.search(r"\w+://|(?:src|href)=\"//|url\(", text), f"{name} names a URL"


# ---------------------------------------------------------------------------
# Stream mode: the text-in WebSocket, with and without a token.


def _stream_reference(
    port: int, text: str, *, voice: str, seed: int, token: str | None = None
) -> tuple[int, list[str]]:
    """(PCM bytes, segment texts) of a WebSocket call read with aiohttp (bearer header)."""

    async def run() -> tuple[int, list[str]]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        url = f"http://127.0.0.1:{port}{ROUTE}"
        audio, segments = 0, []
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(url, headers=headers) as ws,
        ):
            config = {"type": "config", "response_format": "pcm", "voice": voice, "seed": seed}
            await ws.send_json(config)
            await ws.send_json({"type": "text", "text": text})
            await ws.send_json({"type": "end"})
            async for message in ws:
                if message.type is aiohttp.WSMsgType.BINARY:
                    audio += len(message.data)
                    continue
                event = json.loads(message.data)
                assert event["type"] != "error", event
                if event["type"] == "segment.start":
                    segments.append(event["text"])
        return audio, segments

    return asyncio.run(run())


def _requests_counted(port: int, api: str, status: str, token: str | None = None) -> float:
    """``omni_gateway_http_requests_total{api, status}`` of a gateway process (0 when absent)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(
            "GET", "/metrics", headers={"Authorization": f"Bearer {token}"} if token else {}
        )
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    line = re.search(
        rf'^omni_gateway_http_requests_total\{{api="{re.escape(api)}",status="{status}"\}} (\S+)$',
        text,
        re.MULTILINE,
    )
    return float(line.group(1)) if line else 0.0


def _select_mode(driver, mode: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element(By.ID, "mode")).select_by_value(mode)


def _check_stream(live: dict, port: int, token: str | None) -> None:
    """The page's stream-mode call got what the same call over aiohttp gets."""
    assert live["state"] == "done" and live["error"] is None and live["mode"] == "stream", live
    assert live["protocol"] == PROTOCOL, f"echoed {live['protocol']!r}, want {PROTOCOL!r}"
    audio, segments = _stream_reference(port, TEXT, voice=VOICE, seed=SEED, token=token)
    assert audio > 0 and len(segments) >= 2, (audio, segments)
    assert live["bytesReceived"] == audio, f"{live=} {audio=}"
    assert live["samplesReceived"] == audio // 2 and live["segments"] == len(segments), live
    assert live["scheduledSeconds"] == pytest.approx(audio / 2 / 24000, abs=1e-6), live
    assert live["transcript"] == " ".join(segments), (live["transcript"], segments)


@pytest.mark.e2e
def test_stream_mode_on_an_open_gateway(browser, stack: Stack) -> None:
    from selenium.webdriver.common.by import By

    _open(browser, stack.http_url)
    _select_mode(browser, "stream")
    assert browser.find_element(By.ID, "transcript-label").text == "Segments spoken"
    _fill(browser, TEXT, voice=VOICE, seed=str(SEED))
    live = _speak_and_wait(browser)
    _check_stream(live, stack.cfg.http_port, None)
    assert re.fullmatch(r"\d+ ms", browser.find_element(By.ID, "ttfp").text)
    # Nothing to mint without a token.
    assert _requests_counted(stack.cfg.http_port, "/v1/realtime/client_secrets", "200") == 0


@pytest.mark.e2e
def test_playground_behind_a_token(browser, token_stack: Stack, tmp_path: Path) -> None:
    """Speech over HTTP and text in over the WebSocket, the token typed once."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    port = token_stack.cfg.http_port
    mint_api, ws_api = "/v1/realtime/client_secrets", ROUTE
    _open(browser, token_stack.http_url)
    _select_mode(browser, "stream")
    token = browser.find_element(By.ID, "token")
    # A wrong token: the page cannot mint a key and shows the server's 401.
    token.send_keys("wrong" + Keys.TAB)
    _fill(browser, TEXT)
    live = _speak_and_wait(browser)
    assert live["state"] == "error" and live["samplesReceived"] == 0, live
    assert live["error"].startswith("HTTP 401: ") and "invalid_api_key" in live["error"], live
    assert _requests_counted(port, ws_api, "101", TOKEN) == 0

    token.clear()
    token.send_keys(TOKEN + Keys.TAB)  # reloads the models: the voices are listed now
    _wait(
        browser,
        lambda d: d.find_element(By.ID, "voice-select").is_displayed(),
        20,
        "the voices of the model list",
    )
    _fill(browser, TEXT, voice=VOICE, seed=str(SEED))
    minted = _requests_counted(port, mint_api, "200", TOKEN)
    live = _speak_and_wait(browser)
    shot = _artifact_dir(tmp_path) / "playground-stream-token.png"
    browser.save_screenshot(str(shot))
    print(f"playground stream screenshot: {shot}")
    _check_stream(live, port, TOKEN)
    # One key minted for the one WebSocket, which the gateway accepted.
    assert _requests_counted(port, mint_api, "200", TOKEN) == minted + 1
    assert _requests_counted(port, ws_api, "101", TOKEN) == 2  # the page's and the reference's

    _select_mode(browser, "speech")
    live = _speak_and_wait(browser)
    status, pcm = _post_speech(
        port,
        {"model": "omni-serving", "input": TEXT, "voice": VOICE, "response_format": "pcm",
         "stream": True, "seed": SEED},
        token=TOKEN,
    )  # fmt: skip
    assert status == 200 and live["state"] == "done" and live["error"] is None, live
    assert live["samplesReceived"] == len(pcm) // 2 > 0, f"{live=} {len(pcm)=}"


class _PageServer:
    """A blank page on its own origin (host:port), for the Origin checks."""

    def __init__(self, directory: Path, host: str) -> None:
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
        handler.log_message = lambda *args: None  # type: ignore[method-assign]
        self.server = http.server.ThreadingHTTPServer((host, 0), handler)
        self.origin = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


_OPEN_WEBSOCKET = """
const [url, protocols, done] = arguments;
const ws = new WebSocket(url, protocols);
ws.onopen = () => { const protocol = ws.protocol; ws.close(); done({opened: true, protocol}); };
ws.onclose = (event) => done({opened: false, code: event.code});
"""


@pytest.mark.e2e
def test_websocket_origin_in_a_browser(browser, sock_dir: Path, tmp_path: Path) -> None:
    """A listed origin's page opens the WebSocket with a minted key; another's is refused."""
    (tmp_path / "index.html").write_text("<!doctype html><title>elsewhere</title>")
    allowed, other = _PageServer(tmp_path, "127.0.0.1"), _PageServer(tmp_path, "127.0.0.2")
    try:
        with (
            FakeDecoder(sock_dir / "decoder.sock") as fake,
            GatewayThread(
                fake.target,
                sock_dir,
                http_host="127.0.0.1",
                http_port=0,
                auth_token=TOKEN,
                allowed_origins=(allowed.origin,),
            ) as gw,
        ):
            url = f"ws://127.0.0.1:{gw.http_port}{ROUTE}"
            key, _ = ClientKeys(TOKEN).mint(60)  # as the page's own server would mint it
            protocols = [PROTOCOL, KEY_PROTOCOL_PREFIX + key]
            browser.set_script_timeout(20)
            results, forbidden = {}, []
            for page in (allowed, other):
                browser.get(f"{page.origin}/")
                before = _forbidden_upgrades()
                results[page.origin] = browser.execute_async_script(_OPEN_WEBSOCKET, url, protocols)
                forbidden.append(_forbidden_upgrades() - before)
    finally:
        allowed.close()
        other.close()
    assert results[allowed.origin] == {"opened": True, "protocol": PROTOCOL}, results
    assert results[other.origin]["opened"] is False, results
    # The browser hides why; the gateway (in this process) counted a 403 for the other page only.
    assert forbidden == [0, 1], f"403s per page: {forbidden}"


def _forbidden_upgrades() -> float:
    """403 answers of the WebSocket route in this process's metrics (a `GatewayThread`)."""
    from prometheus_client import REGISTRY

    labels = {"api": ROUTE, "status": "403"}
    return REGISTRY.get_sample_value("omni_gateway_http_requests_total", labels) or 0.0


def _docs_javascript() -> str:
    """The one JavaScript block of docs/gateway.md (Browsers and WebSockets)."""
    text = (Path(__file__).parents[1] / "docs" / "gateway.md").read_text()
    blocks = re.findall(r"^```js\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1, f"want one js block in docs/gateway.md, found {len(blocks)}"
    return blocks[0]


@pytest.mark.e2e
def test_the_docs_javascript_works_as_written(browser, token_stack: Stack) -> None:
    _open(browser, token_stack.http_url)  # a page of the gateway's own origin
    script = (
        _docs_javascript()
        + """
const [gateway, token, text, done] = arguments;
mintKey(gateway, token)
  .then((key) => speakOverWebSocket(gateway, key, text))
  .then(
    (r) => done({samples: r.chunks.reduce((n, c) => n + c.length, 0), rate: r.rate,
                 seconds: r.seconds}),
    (err) => done({error: String(err)}),
  );
"""
    )
    browser.set_script_timeout(60)
    got = browser.execute_async_script(script, token_stack.http_url, TOKEN, TEXT)
    assert "error" not in got and got["rate"] == 24000, got
    assert got["samples"] > 0 and got["samples"] == pytest.approx(got["seconds"] * 24000, abs=1)
    wrong = browser.execute_async_script(script, token_stack.http_url, "wrong", TEXT)
    assert wrong == {"error": "Error: client_secrets: HTTP 401"}, wrong


# --------------------------------------------------------------- voice turn
VOICE_LIVE = (
    "const p = window.playground; return p && {state: p.state, error: p.error, mode: p.mode,"
    " recording: p.recording, voiceSeconds: p.voiceSeconds, sentAudio: p.sentAudio,"
    " responseId: p.responseId, responseStatus: p.responseStatus, transcript: p.transcript,"
    " bytesReceived: p.bytesReceived, samplesReceived: p.samplesReceived, protocol: p.protocol};"
)


def _tone_wav(path: Path, seconds: float, rate: int, hz: float = 220.0) -> Path:
    import wave

    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.sin(2 * np.pi * hz * t) * 0.4 * 32767).astype("<i2").tobytes())
    return path


@pytest.fixture(scope="module")
def mic_browser(tmp_path_factory):
    """Chromium whose microphone is a fake device playing a tone file (looped)."""
    _require_browser()
    mic = _tone_wav(tmp_path_factory.mktemp("mic") / "mic.wav", 2.0, 48000)
    yield from _chromium("--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
                         f"--use-file-for-fake-audio-capture={mic}")


def _voice_turn_matches_generate(driver, stack: Stack) -> dict:
    """Speak in voice mode; the answer the page played equals gRPC Generate of
    the audio it sent, with the response's seed (tests/realtime_client.py)."""
    import zlib

    from realtime_client import audio_part, generate

    driver.find_element("id", "speak").click()
    _wait(driver, lambda d: _live(d).get("state") in ("done", "error", "stopped"), 60, "the voice turn to end")
    live = driver.execute_script(VOICE_LIVE)
    assert live["state"] == "done" and live["error"] is None and live["mode"] == "voice", live
    assert live["responseStatus"] == "completed" and live["protocol"] == "realtime", live
    sent = base64.b64decode(live["sentAudio"])
    text, pcm = generate(stack.gateway_target, [("user", [audio_part(sent)])], zlib.crc32(live["responseId"].encode()),
                         voice=VOICE)
    assert text and live["transcript"] == text, (live["transcript"], text)
    assert live["bytesReceived"] == len(pcm) and live["samplesReceived"] == len(pcm) // 2, (live, len(pcm))
    return {**live, "sent": sent}


@pytest.mark.e2e
def test_voice_turn_from_the_microphone_and_from_a_file(mic_browser, omni_stack: Stack, tmp_path: Path) -> None:
    """Record (the fake microphone plays a tone), send, hear the answer; then
    the same with a WAV file picked (16 kHz: the page resamples it to 24 kHz)."""
    import numpy as np
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver = mic_browser
    _open(driver, omni_stack.http_url)
    Select(driver.find_element(By.ID, "mode")).select_by_value("voice")
    assert driver.find_element(By.ID, "voice-panel").is_displayed()
    assert not driver.find_element(By.ID, "text").is_displayed()
    Select(driver.find_element(By.ID, "voice-select")).select_by_value(VOICE)
    driver.find_element(By.ID, "record").click()
    _wait(driver, lambda d: d.execute_script(VOICE_LIVE)["voiceSeconds"] >= 1.2, 30, "1.2 s recorded")
    driver.find_element(By.ID, "record").click()
    _wait(driver, lambda d: not d.execute_script(VOICE_LIVE)["recording"], 10, "the recording to stop")
    assert driver.find_element(By.ID, "voice-status").text.startswith("recorded: ")
    recorded = _voice_turn_matches_generate(driver, omni_stack)
    samples = np.frombuffer(recorded["sent"], dtype="<i2").astype(np.float64) / 32768
    assert len(samples) >= int(1.2 * 24000), len(samples)
    assert np.sqrt(np.mean(samples ** 2)) > 0.1, "the microphone's tone did not reach the question"
    shot = _artifact_dir(tmp_path) / "playground-voice.png"
    driver.save_screenshot(str(shot))
    print(f"playground voice screenshot: {shot}")

    wav = _tone_wav(tmp_path / "question.wav", 0.8, 16000, hz=330.0)
    driver.find_element(By.ID, "voice-file").send_keys(str(wav))
    _wait(driver, lambda d: d.find_element(By.ID, "voice-status").text == "question.wav: 0.8 s", 10, "the file read")
    picked = _voice_turn_matches_generate(driver, omni_stack)
    assert len(picked["sent"]) // 2 == int(0.8 * 24000), len(picked["sent"])


@pytest.mark.e2e
@pytest.mark.vllm
def test_a_voice_registered_and_used_from_the_page(browser, tmp_path_factory, tts_checkpoints) -> None:
    """A voice-clone model (the tiny Qwen3-TTS Base on vLLM): the page offers its languages and the
    upload, registers a clip as a voice, lists it, and speaks with it the audio the API gives."""
    pytest.importorskip("vllm")
    import wave

    import numpy as np
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    clip = tmp_path_factory.mktemp("clip") / "clip.wav"
    t = np.arange(36000) / 24000
    with wave.open(str(clip), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(np.round(0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes())
    runtime = tmp_path_factory.mktemp("rt-tts")
    s = Stack(StackConfig(engine="vllm", model=str(tts_checkpoints["base"]), runtime_dir=str(runtime), port=0,
                          http_port=0, log_level="WARNING", voice_dir=str(runtime / "voices"),
                          decoder_metrics_port=-1, materializer_metrics_port=-1))
    s.start(timeout_s=300)
    try:
        _open(browser, s.http_url)
        assert browser.find_element(By.ID, "clone-panel").is_displayed()
        assert browser.find_element(By.ID, "language-field").is_displayed()
        assert not browser.find_element(By.ID, "instructions-field").is_displayed()  # a clone takes none
        browser.find_element(By.ID, "clone-name").send_keys("page-voice")
        browser.find_element(By.ID, "clone-file").send_keys(str(clip))
        browser.find_element(By.ID, "clone-register").click()
        _wait(browser, lambda d: "registered page-voice" in d.find_element(By.ID, "clone-status").text, 60,
              "the registration")
        assert Select(browser.find_element(By.ID, "voice-select")).first_selected_option.text == "page-voice"
        Select(browser.find_element(By.ID, "language")).select_by_value("english")
        _fill(browser, "Good morning.", seed="5")
        live = _speak_and_wait(browser)
        assert live["state"] == "done" and live["error"] is None, live
        status, pcm = _post_speech(s.cfg.http_port, {"model": "base", "input": "Good morning.", "voice": "page-voice",
                                                     "language": "english", "response_format": "pcm", "seed": 5})
        assert status == 200 and live["bytesReceived"] == len(pcm) > 0, (status, pcm[:200])
    finally:
        assert s.stop() == []
