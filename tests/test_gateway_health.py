"""The gateway's health tells the truth about its decoder, and it recovers fast.

* In-process: a gateway whose decoder is absent reports NOT_SERVING (gRPC
  health and HTTP /health), and SERVING once a decoder appears.
* Real processes (e2e): a fake-engine decoder and a gateway, each its own
  process. The decoder is SIGKILLed and restarted; the gateway's health
  goes NOT_SERVING, then SERVING again, and it serves Speak again, each
  within the bounds below. The measured delays are printed (``-s``).
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from fakes import FakeDecoder, GatewayThread
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omni_common import shm_arena
from omni_common.server import wait_for_health_sync
from omni_serving.v1 import gateway_pb2, gateway_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
FLIP_BOUND_S = 2.0
"""Health must follow the decoder, both ways, within this (in-process fakes)."""
RECOVER_BOUND_S = 15.0
"""With real processes on a loaded machine a new decoder's first Speak can take
seconds; the reconnect policy itself is checked without a clock
(test_the_decoder_channel_reconnects_fast), so this only bounds "it recovers
by itself" (gRPC's default backoff would grow to 120 s)."""
REPO = Path(__file__).resolve().parents[1]


def status(channel: grpc.Channel) -> int | None:
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
    except grpc.RpcError:
        return None


def http_health(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def wait_until(predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.02) -> float:
    """Seconds until `predicate` held (polled every `step_s`); fails after `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s}s")
        time.sleep(step_s)
    return time.monotonic() - start


def test_the_decoder_channel_reconnects_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's decoder channel retries 100 ms after a failure and at most
    every second (gRPC's defaults: 1 s, growing to 120 s), whatever else it sets."""
    import gateway.decoder_client as dc

    seen: dict[str, object] = {}

    def capture_channel(target: str, options: list[tuple[str, object]]) -> object:
        seen.update(options)
        return object()  # never dialled

    monkeypatch.setattr(dc.grpc.aio, "insecure_channel", capture_channel)
    monkeypatch.setattr(dc.decoder_pb2_grpc, "DecoderServiceStub", lambda channel: None)
    monkeypatch.setattr(dc.health_pb2_grpc, "HealthStub", lambda channel: None)
    dc.DecoderClient("unix:///nowhere.sock", options=[("grpc.lb_policy_name", "pick_first")])
    assert seen["grpc.initial_reconnect_backoff_ms"] == 100
    assert seen["grpc.max_reconnect_backoff_ms"] == 1000
    assert seen["grpc.lb_policy_name"] == "pick_first"


def test_health_follows_an_absent_then_present_decoder(sock_dir: Path) -> None:
    target = FakeDecoder.absent_target(sock_dir)
    with GatewayThread(target, sock_dir, http_host="127.0.0.1", http_port=0) as gw:
        # Right from the start: the first check ran before start_gateway returned.
        assert status(gw.channel) == NOT_SERVING
        assert http_health(gw.http_port) == 503
        with FakeDecoder(sock_dir / "no-decoder.sock"):
            up = wait_until(lambda: status(gw.channel) == SERVING, FLIP_BOUND_S)
            assert http_health(gw.http_port) == 200
            stub = gateway_pb2_grpc.OmniGatewayServiceStub(gw.channel)
            chunks = list(stub.Speak(gateway_pb2.SpeakRequest(text="hi"), timeout=10))
            assert chunks[-1].final
        down = wait_until(lambda: status(gw.channel) == NOT_SERVING, FLIP_BOUND_S)
        assert http_health(gw.http_port) == 503
    print(f"\nin-process: SERVING after {up:.3f}s, NOT_SERVING after {down:.3f}s")


# ---------------------------------------------------------------------------
# Real processes.


class Proc:
    """A service process in its own session, stopped by its pid at the end."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(
            argv, env={**os.environ, **env}, cwd=REPO, start_new_session=True
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


def speak_ok(stub: gateway_pb2_grpc.OmniGatewayServiceStub) -> bool:
    try:
        chunks = list(stub.Speak(gateway_pb2.SpeakRequest(text="back again"), timeout=5))
    except grpc.RpcError:
        return False
    return bool(chunks) and chunks[-1].final and any(c.audio for c in chunks)


@pytest.mark.e2e
def test_decoder_restart_flips_health_and_gateway_recovers(sock_dir: Path) -> None:
    deployment = f"gwhealth{os.getpid()}"
    prefix = f"omni-{deployment}"
    decoder_target = f"unix://{sock_dir / 'decoder.sock'}"
    gateway_target = f"unix://{sock_dir / 'gateway.sock'}"
    env = {"PYTHONUNBUFFERED": "1", "TMPDIR": str(sock_dir)}
    decoder_argv = [
        sys.executable, "-m", "decoder_svc", "--listen", decoder_target, "--engine", "fake",
        "--profile", "tts", "--deployment", deployment, "--log-level", "WARNING",
    ]  # fmt: skip
    gateway_argv = [
        sys.executable, "-m", "gateway", "--listen", gateway_target, "--decoder", decoder_target,
        "--http-port", "0", "--log-level", "WARNING",
    ]  # fmt: skip
    decoder = Proc(decoder_argv, env)
    gateway = None
    try:
        wait_for_health_sync(decoder_target, 120)
        gateway = Proc(gateway_argv, env)
        wait_for_health_sync(gateway_target, 60)
        with grpc.insecure_channel(gateway_target) as channel:
            stub = gateway_pb2_grpc.OmniGatewayServiceStub(channel)
            assert speak_ok(stub)

            # 1) The decoder dies: NOT_SERVING.
            decoder.kill()
            down = wait_until(lambda: status(channel) == NOT_SERVING, RECOVER_BOUND_S)
            refused = stub.Speak(gateway_pb2.SpeakRequest(text="hi"), timeout=5)
            with pytest.raises(grpc.RpcError) as info:
                list(refused)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
            assert "decoder.sock" not in info.value.details()
            time.sleep(3)  # down long enough for default reconnect backoff to grow
            assert status(channel) == NOT_SERVING

            # 2) A new decoder: SERVING and serving again, measured from its own SERVING.
            shm_arena.sweep_stale(prefix)  # what the launcher does before a restart
            decoder = Proc(decoder_argv, env)
            wait_for_health_sync(decoder_target, 120)
            decoder_up = time.monotonic()
            up = wait_until(lambda: status(channel) == SERVING, RECOVER_BOUND_S)
            wait_until(lambda: speak_ok(stub), RECOVER_BOUND_S, step_s=0.05)
            serving = time.monotonic() - decoder_up
        print(
            f"\nprocesses: NOT_SERVING {down:.3f}s after SIGKILL; SERVING {up:.3f}s and "
            f"Speak OK {serving:.3f}s after the new decoder's health said SERVING"
        )
    finally:
        if gateway is not None:
            gateway.stop()
            assert gateway.proc.returncode == 0, "gateway did not stop cleanly"
        decoder.stop()
        shm_arena.sweep_stale(prefix)
