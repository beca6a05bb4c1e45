"""The launcher restarts a decoder that reports itself not live (omni_stack.supervision).

- `liveness_status` reads the `omni_serving.liveness` entry of a real gRPC
  health server (SERVING, NOT_SERVING, no entry, nobody listening).
- `Supervisor.poll_service` on a real process standing in for a decoder
  (a sleeping Python process, started in a session of its own as the stack
  starts services), its liveness answers scripted (`ScriptedLiveness`, a
  test double): NOT_SERVING twice in a row kills it and restarts it as after
  a crash, the log naming why; an answer that does not come or a SERVING in
  between does not; other roles and `liveness_poll` 0 are never checked.
- No answer at all (a stopped or wedged decoder) for longer than
  `liveness_unanswered_s` kills and restarts it; any answer (even an unknown
  entry) restarts that clock; 0 turns the rule off. `unanswered_for` is
  checked with hand-given times (no clock).
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from omni_common.liveness import LIVENESS_SERVICE
from omni_stack.commands import ServiceProcess
from omni_stack.config import ConfigError, StackConfig
from omni_stack.supervision import (
    NOT_LIVE_CHECKS,
    Supervisor,
    count_not_live,
    liveness_status,
    unanswered_for,
)


def test_liveness_status_reads_the_entry_of_a_real_health_server(tmp_path):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    target = f"unix://{tmp_path}/h.sock"
    server.add_insecure_port(target)
    server.start()
    svc = ServiceProcess(name="decoder", argv=[], target=target)
    try:
        assert liveness_status(svc, 2.0) == "SERVICE_UNKNOWN", "an unknown entry is an answer (NOT_FOUND)"
        servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        assert liveness_status(svc, 2.0) == "SERVING"
        servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert liveness_status(svc, 2.0) == "NOT_SERVING"
    finally:
        server.stop(0)
    t0 = time.monotonic()
    assert liveness_status(svc, 0.2) == "", "nobody listening should read as no answer"
    assert time.monotonic() - t0 < 2, "a check outlasted its timeout"


def test_count_not_live():
    assert count_not_live("NOT_SERVING", 0) == 1
    assert count_not_live("NOT_SERVING", 1) == 2
    assert count_not_live("", 1) == 1, "no answer must neither count nor reset"
    assert count_not_live("SERVING", 1) == 0
    assert count_not_live("SERVICE_UNKNOWN", 1) == 0


class ScriptedLiveness:
    """A test double for the liveness check: answers from a script, in order."""

    def __init__(self, answers: list[str]) -> None:
        self.answers = list(answers)
        self.asked: list[int] = []  # pids checked

    def __call__(self, svc: ServiceProcess, timeout_s: float) -> str:
        assert svc.proc is not None
        self.asked.append(svc.proc.pid)
        return self.answers.pop(0) if self.answers else "SERVING"


def running(role: str) -> ServiceProcess:
    svc = ServiceProcess(name=role, argv=[sys.executable, "-c", "import time; time.sleep(120)"],
                         target="unix:///nonexistent/d.sock", role=role)
    spawn(svc)
    svc.state, svc.healthy_at = "running", time.monotonic()
    return svc


def spawn(svc: ServiceProcess) -> None:
    svc.proc = subprocess.Popen(svc.argv, start_new_session=True)
    svc.started_at = time.monotonic()
    svc.start_deadline = svc.started_at + 60
    svc.state = "starting"


def supervisor(check: ScriptedLiveness, log: list[str], **cfg) -> Supervisor:
    cfg.setdefault("liveness_unanswered_s", 60.0)
    return Supervisor(StackConfig(engine="fake", liveness_poll=0.05, restart_backoff=0.1, **cfg), log=log.append,
                      spawn=spawn, reap_orphans=lambda: None, check_liveness=check)


def rounds(sup: Supervisor, svc: ServiceProcess, n: int) -> None:
    for _ in range(n):
        assert sup.poll_service(svc) is None, "the supervisor gave up"
        time.sleep(0.06)


def test_a_decoder_not_live_twice_in_a_row_is_killed_and_restarted():
    check = ScriptedLiveness(["NOT_SERVING", "", "SERVING", "NOT_SERVING", "NOT_SERVING"])
    log: list[str] = []
    sup = supervisor(check, log)
    svc = running("decoder")
    first = svc.proc
    try:
        rounds(sup, svc, 4)
        assert svc.state == "running" and first.poll() is None, f"restarted early: {log}"
        rounds(sup, svc, 1)
        assert check.asked == [first.pid] * 5, f"checks: {check.asked}"
        assert first.poll() is not None, "the stuck decoder was not killed"
        assert svc.state == "backoff", f"state after the kill: {svc.state}"
        assert any("reports not live" in line and LIVENESS_SERVICE in line for line in log), log
        assert any("was stuck" in line and "restarting it in" in line for line in log), log
        time.sleep(0.15)
        sup.poll_service(svc)  # the backoff is over: a new process
        assert svc.proc is not first and svc.proc.poll() is None and svc.restarts == 1, f"{svc.state} {log}"
        assert svc.failures == 1, f"failures: {svc.failures}"
    finally:
        for p in (first, svc.proc):
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize(("role", "poll"), [("materializer", 0.05), ("decoder", 0.0), ("gateway", 0.0)])
def test_not_checked_other_roles_or_when_off(role, poll):
    check = ScriptedLiveness(["NOT_SERVING"] * (NOT_LIVE_CHECKS + 3))
    log: list[str] = []
    sup = supervisor(check, log)
    sup.cfg.liveness_poll = poll
    svc = running(role)
    try:
        rounds(sup, svc, NOT_LIVE_CHECKS + 2)
        assert check.asked == [], f"{role} with liveness_poll {poll} was checked"
        assert svc.state == "running" and svc.proc.poll() is None, log
    finally:
        svc.proc.kill()
        svc.proc.wait()


def test_liveness_poll_is_validated():
    with pytest.raises(ConfigError, match="liveness_poll"):
        StackConfig(engine="fake", liveness_poll=-1).validate()


def test_unanswered_for():
    assert unanswered_for(100.0, 159.0, 60.0) is None, "59 s of silence is within a 60 s limit"
    assert unanswered_for(100.0, 160.5, 60.0) == 60.5
    assert unanswered_for(100.0, 1000.0, 0.0) is None, "0 must turn the rule off"


def test_a_decoder_that_does_not_answer_for_the_limit_is_killed_and_restarted():
    # SERVICE_UNKNOWN and SERVING are answers: they restart the silence clock;
    # from then on nothing answers, and after ~0.4 s the decoder is killed.
    check = ScriptedLiveness(["", "", "SERVICE_UNKNOWN", "", "SERVING"] + [""] * 100)
    log: list[str] = []
    sup = supervisor(check, log, liveness_unanswered_s=0.4)
    svc = running("decoder")
    first = svc.proc
    try:
        rounds(sup, svc, 5)  # ~0.3 s, answered twice in between
        assert svc.state == "running" and first.poll() is None, f"restarted while it answered: {log}"
        deadline = time.monotonic() + 10
        while svc.state == "running":
            assert time.monotonic() < deadline, f"not restarted after 10 s of silence: {log}"
            rounds(sup, svc, 1)
        assert first.poll() is not None, "the silent decoder was not killed"
        assert svc.state == "backoff", f"state after the kill: {svc.state}"
        assert any("did not answer its " + LIVENESS_SERVICE in line and "killing it" in line
                   for line in log), log
        assert any("did not answer for" in line and "restarting it in" in line for line in log), log
        silent = float(next(line for line in log if "killing it" in line).split(" check for ")[1].split("s")[0])
        assert silent >= 0.4, f"killed after {silent}s of silence (logged to 0.1 s), limit 0.4s: {log}"
    finally:
        for p in (first, svc.proc):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_silence_is_not_counted_when_off():
    check = ScriptedLiveness([""] * 100)
    log: list[str] = []
    sup = supervisor(check, log, liveness_unanswered_s=0.0)
    svc = running("decoder")
    try:
        rounds(sup, svc, 10)
        assert len(check.asked) >= 5, f"checks: {check.asked}"
        assert svc.state == "running" and svc.proc.poll() is None, f"restarted with the rule off: {log}"
    finally:
        svc.proc.kill()
        svc.proc.wait()


@pytest.mark.parametrize(("value", "needle"), [(-1, "must be >= 0"), (0.05, "below two liveness checks")])
def test_liveness_unanswered_s_is_validated(value, needle):
    with pytest.raises(ConfigError, match=f"liveness_unanswered_s: .*{needle}"):
        StackConfig(engine="fake", liveness_poll=1.0, liveness_unanswered_s=value).validate()


def test_a_gateway_is_checked_unless_it_serves_tls():
    for tls, expect_checked in (("", True), ("cert.pem", False)):
        check = ScriptedLiveness(["NOT_SERVING"] * (NOT_LIVE_CHECKS + 3))
        log: list[str] = []
        sup = supervisor(check, log)
        sup.cfg.tls_cert = tls
        svc = running("gateway")
        first = svc.proc
        try:
            rounds(sup, svc, NOT_LIVE_CHECKS)
            if expect_checked:
                assert first.poll() is not None and svc.state == "backoff", f"not restarted: {log}"
                assert any("gateway" in line and "reports not live" in line for line in log), log
            else:
                assert check.asked == [] and first.poll() is None, f"a TLS gateway was checked: {log}"
        finally:
            for p in (first, svc.proc):
                if p.poll() is None:
                    p.kill()
                    p.wait()
