"""The gateway's event loop under a liveness watchdog (gateway.liveness).

- Unit (a real asyncio loop and health servicer, no server): a coroutine
  blocks the loop with client streams in flight; the watchdog (its own
  thread) judges it stuck, then not live past the grace, logs where the
  loop's thread is, and the health entries ("" and the liveness entry) go
  NOT_SERVING once the loop runs again, then SERVING at the next look. An
  idle loop (nothing in flight) is never stuck.
- A real gateway process in front of a fake decoder (a test double, in this
  process): a Speak carrying the marker of the test hook
  ``OMNI_DEBUG_GATEWAY_STALL`` blocks the gateway's event loop for 4 s;
  its health checks go unanswered meanwhile, its log names the stuck loop
  and where it is stuck, and afterwards it is ready and live again and
  serves a Speak (the blocked one finishes too).
- The options: validated, the option named.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from fakes import FakeDecoder
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.__main__ import parse_args
from gateway.liveness import STALL_ENV, LoopLiveness
from omni_common.liveness import LIVENESS_SERVICE, StallLimits
from omni_common.server import HealthServicer, wait_for_health_sync
from omni_serving.v1 import gateway_pb2, gateway_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
NAMES = ("", "omni_serving.v1.OmniGatewayService")


class RecordingHealth(HealthServicer):
    """The real health servicer, recording every status it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[tuple[str, str]] = []

    async def set(self, service, status) -> None:
        self.history.append((service, health_pb2.HealthCheckResponse.ServingStatus.Name(status)))
        await super().set(service, status)


def test_a_blocked_event_loop_is_stuck_then_not_live_and_recovers(caplog):
    caplog.set_level(logging.WARNING, logger="gateway.liveness")
    in_flight = [0]

    async def scenario() -> tuple[RecordingHealth, list]:
        live = LoopLiveness(lambda: in_flight[0], StallLimits(floor_s=0.3, grace_s=0.6), NAMES,
                            tick_s=0.02, interval_s=0.05)
        changes: list = []
        forward = live.watchdog.on_change
        assert forward is not None

        def record(ready, is_live, stuck):
            changes.append((ready, is_live, [s.name for s in stuck]))
            forward(ready, is_live, stuck)

        live.watchdog.on_change = record
        health = RecordingHealth()
        await live.health.started(None, health)
        await live.health.set_dependency(True)  # a decoder is there
        await live.start()
        try:
            await asyncio.sleep(0.8)  # idle: nothing in flight
            assert changes == [], f"an idle loop was judged: {changes}"
            in_flight[0] = 1
            await asyncio.sleep(0.3)  # busy and running: not stuck
            assert changes == [], f"a running loop was judged: {changes}"
            time.sleep(1.5)  # blocks the loop (the stall)
            assert (False, False, ["gateway:event_loop"]) in changes, f"changes during the block: {changes}"
            deadline = time.monotonic() + 10
            while not changes or changes[-1][:2] != (True, True):
                assert time.monotonic() < deadline, f"not ready again after the block: {changes}"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)  # the health update queued by the last change
        finally:
            await live.stop()
        return health, changes

    health, changes = asyncio.run(scenario())
    assert changes[0][0] is False, f"first change: {changes}"
    for entry in (*NAMES, LIVENESS_SERVICE):
        seen = [status for name, status in health.history if name == entry]
        assert "NOT_SERVING" in seen and seen[-1] == "SERVING", f"{entry!r}: {seen}"
    stacks = [r.getMessage() for r in caplog.records if "its thread is at" in r.getMessage()]
    assert len(stacks) == 1 and "time.sleep(1.5)" in stacks[0], f"stack logged: {stacks}"


def test_the_liveness_options_are_validated_naming_the_option(capsys):
    base = ["--listen", "unix:///tmp/x.sock", "--decoder", "unix:///tmp/d.sock"]
    config = parse_args([*base, "--stall-after-s", "2", "--liveness-grace-s", "5"])
    assert (config.stall_after_s, config.liveness_grace_s) == (2.0, 5.0), config
    for argv, needle in ((["--stall-after-s", "0"], "--stall-after-s"),
                         (["--stall-after-s", "10", "--liveness-grace-s", "5"], "--liveness-grace-s")):
        with pytest.raises(SystemExit):
            parse_args([*base, *argv])
        err = capsys.readouterr().err
        assert needle in err, f"{argv}: {err}"


def _health(channel: grpc.Channel, service: str, timeout_s: float = 1.0) -> str | None:
    try:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError:
        return None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


@pytest.mark.e2e
def test_a_real_gateway_whose_loop_is_blocked_reports_it_and_recovers(sock_dir: Path, tmp_path: Path):
    target = f"unix://{sock_dir / 'gateway.sock'}"
    log_path = tmp_path / "gateway.log"
    with FakeDecoder(sock_dir / "decoder.sock") as decoder, open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--listen", target, "--decoder", decoder.target,
             "--log-level", "WARNING", "--stall-after-s", "0.5", "--liveness-grace-s", "1"],
            env={**os.environ, STALL_ENV: "wedge-now:4", "PYTHONUNBUFFERED": "1"},
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            wait_for_health_sync(target, 60)
            with grpc.insecure_channel(target) as channel:
                assert _health(channel, LIVENESS_SERVICE) == "SERVING", "the liveness entry is not SERVING"
                stub = gateway_pb2_grpc.OmniGatewayServiceStub(channel)
                outcome: list[object] = []

                def blocked_speak() -> None:
                    try:
                        outcome.append(list(stub.Speak(gateway_pb2.SpeakRequest(text="wedge-now please"),
                                                       timeout=60)))
                    except grpc.RpcError as exc:
                        outcome.append(exc)

                speaker = threading.Thread(target=blocked_speak)
                speaker.start()
                text = lambda: log_path.read_text(errors="replace")  # noqa: E731
                deadline = time.monotonic() + 30
                while "blocking the event loop" not in text():
                    assert time.monotonic() < deadline, f"the stall hook never ran:\n{text()[-3000:]}"
                    time.sleep(0.05)
                assert _health(channel, "", timeout_s=0.5) is None, "a blocked loop answered a health check"
                deadline = time.monotonic() + 30
                while "moves again" not in text():
                    assert time.monotonic() < deadline, f"the loop never moved again:\n{text()[-3000:]}"
                    time.sleep(0.05)
                out = text()
                assert "not ready: gateway:event_loop made no progress" in out, out[-3000:]
                assert "its thread is at" in out and "debug_stall" in out, out[-3000:]
                assert "reporting not live" in out, out[-3000:]
                deadline = time.monotonic() + 10
                while (_health(channel, ""), _health(channel, LIVENESS_SERVICE)) != ("SERVING", "SERVING"):
                    assert time.monotonic() < deadline, "not ready and live again after the stall"
                    time.sleep(0.05)
                speaker.join(60)
                assert outcome and isinstance(outcome[0], list) and outcome[0][-1].final, (
                    f"the blocked Speak: {outcome}")
                chunks = list(stub.Speak(gateway_pb2.SpeakRequest(text="after the stall"), timeout=10))
                assert chunks and chunks[-1].final, "no Speak served after the stall"
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
