"""The gateway spreads requests over several decoder replicas (gateway.replicas).

* Real processes: two fake-engine decoders (``python -m decoder_svc --engine
  fake``), each its own process, on 127.0.0.1:P and 127.0.0.2:P (two
  loopback addresses and one port, as the addresses of one DNS name look),
  shared by the module; a ``python -m gateway`` process per test in front of
  them. Round-robin and least-outstanding spreading, counted by each
  decoder's own ``finished_requests`` and by the gateway's per-decoder
  metrics; a decoder SIGKILLed while streams run on both, then restarted on
  its address.
* In-process gateway (`GatewayThread`, the real gateway on a background
  loop) for what needs its internals: DNS targets through an injected
  resolver (``fake_resolver``) and through the real ``getaddrinfo``; all
  decoders down; a start retried on another replica; no retry once output
  was sent; Abort reaching the replica the request is on; replicas that
  disagree. There the decoders are `FakeDecoder` servers (a real grpc.aio
  server, test double) or the module's decoder processes.
* ``--decoder`` parsing: lists, repeats, and bad values refused naming the option.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from fakes import FakeDecoder, FakeDecoderConfig, GatewayThread
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from decoder_svc.testing.fake_engine import FAKE_SLOW_MARKER
from gateway.engine import GatewayEngine
from gateway.replicas import (
    BALANCE_LEAST_OUTSTANDING,
    ReplicaPool,
    parse_decoder_targets,
    replica_label,
)
from gateway.validation import SpeechRequest
from omni_common import shm_arena
from omni_common.errors import InvalidArgumentError
from omni_common.server import wait_for_health_sync
from omni_serving.v1 import common_pb2, decoder_pb2, decoder_pb2_grpc, gateway_pb2, gateway_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LONG_TEXT = FAKE_SLOW_MARKER + "a long request that keeps its decoder busy " * 90
LONG_AUDIO_S = 300.0  # the deployment's maximum: 3,750 frames
"""A long request is held in flight for about 19 s, read or not (the fake
talker's steps slowed to FAKE_SLOW_STEP_S): at full speed the fake spoke it,
and the transports buffered its audio, in 0.3 s."""


def long_request(request_id: str) -> gateway_pb2.SpeakRequest:
    sampling = common_pb2.SamplingParams(max_audio_seconds=LONG_AUDIO_S)
    return gateway_pb2.SpeakRequest(request_id=request_id, text=LONG_TEXT, sampling_params=sampling)


def wait_until(predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.02) -> float:
    """Seconds until `predicate` held; fails after `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s}s")
        time.sleep(step_s)
    return time.monotonic() - start


def free_port_on_both_loopbacks() -> int:
    """A TCP port free on 127.0.0.1 and on 127.0.0.2."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.2", port))
                except OSError:
                    continue
        return port
    raise AssertionError("no port free on both loopback addresses")


def health_status(channel: grpc.Channel) -> int | None:
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
    except grpc.RpcError:
        return None


def speak(stub: gateway_pb2_grpc.OmniGatewayServiceStub, text: str, **fields: object) -> bool:
    chunks = list(stub.Speak(gateway_pb2.SpeakRequest(text=text, **fields), timeout=20))
    return bool(chunks) and chunks[-1].final and any(c.audio for c in chunks)


# ---------------------------------------------------------------------------
# Processes.


class Proc:
    """A service process in its own session, stopped by its pid."""

    def __init__(self, argv: list[str], env: dict[str, str], *, stdout: int | None = None):
        self.proc = subprocess.Popen(
            argv, env={**os.environ, **env}, cwd=REPO, start_new_session=True, stdout=stdout
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


class DecoderPair:
    """Two fake-engine decoder processes on 127.0.0.1:P and 127.0.0.2:P."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port_on_both_loopbacks()
        self.targets = [f"127.0.0.1:{self.port}", f"127.0.0.2:{self.port}"]
        self.deployments = [f"gwrep{os.getpid()}a", f"gwrep{os.getpid()}b"]
        self.env = {"PYTHONUNBUFFERED": "1", "TMPDIR": str(directory)}
        self.procs: list[Proc | None] = [None, None]
        for index in range(2):
            self.procs[index] = Proc(self.argv(index), self.env)
        for target in self.targets:
            wait_for_health_sync(target, 120)

    def argv(self, index: int) -> list[str]:
        return [
            sys.executable, "-m", "decoder_svc", "--listen", self.targets[index],
            "--engine", "fake", "--profile", "tts", "--deployment", self.deployments[index],
            "--metrics-port", "-1", "--log-level", "WARNING",
        ]  # fmt: skip

    def revive(self) -> None:
        """Restart a decoder an earlier test left dead (a test that failed half-way)."""
        for index, proc in enumerate(self.procs):
            if proc is None or proc.proc.poll() is not None:
                self.restart(index)

    def kill(self, index: int) -> None:
        proc = self.procs[index]
        assert proc is not None
        proc.kill()

    def restart(self, index: int) -> None:
        """A new process on the same address (the arena swept first, as the launcher does)."""
        shm_arena.sweep_stale(f"omni-{self.deployments[index]}")
        self.procs[index] = Proc(self.argv(index), self.env)
        wait_for_health_sync(self.targets[index], 120)

    def finished(self) -> list[int]:
        """Each decoder's own count of finished requests (GetDecoderInfo)."""
        return [self.finished_on(index) for index in range(2)]

    def finished_on(self, index: int) -> int:
        with grpc.insecure_channel(self.targets[index]) as channel:
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)
            info = stub.GetDecoderInfo(decoder_pb2.GetDecoderInfoRequest(), timeout=5)
            return info.finished_requests

    def close(self) -> None:
        for proc in self.procs:
            if proc is not None:
                proc.stop()
        for deployment in self.deployments:
            shm_arena.sweep_stale(f"omni-{deployment}")


@pytest.fixture(scope="module")
def decoder_pair() -> Iterator[DecoderPair]:
    directory = Path(tempfile.mkdtemp(prefix="omni-rep-", dir="/tmp"))
    decoders = DecoderPair(directory)
    try:
        yield decoders
    finally:
        decoders.close()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def pair(decoder_pair: DecoderPair) -> DecoderPair:
    """The module's two decoder processes, both running."""
    decoder_pair.revive()
    return decoder_pair


class GatewayProc:
    """``python -m gateway`` with HTTP (for /metrics), listening on a Unix socket."""

    def __init__(self, decoder_args: list[str], directory: Path) -> None:
        self.target = f"unix://{directory / 'gateway.sock'}"
        argv = [
            sys.executable, "-m", "gateway", "--listen", self.target, *decoder_args,
            "--http-port", "0", "--log-level", "WARNING",
        ]  # fmt: skip
        self.proc = Proc(argv, {"PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE)
        line = self._first_line(60)
        assert "HTTP on port " in line, line
        self.http_port = int(line.rsplit("HTTP on port ", 1)[1].split()[0])
        self.channel = grpc.insecure_channel(self.target)
        self.stub = gateway_pb2_grpc.OmniGatewayServiceStub(self.channel)

    def _first_line(self, timeout_s: float) -> str:
        stdout = self.proc.proc.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], timeout_s)
        assert ready, "the gateway did not report that it listens"
        return stdout.readline().decode()

    def metric(self, name: str, label: str = "decoder") -> dict[str, float]:
        """One metric from /metrics by one label: {label's value: value} (per decoder by default)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=5)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    out[sample.labels[label]] = sample.value
        return out

    def close(self) -> None:
        self.channel.close()
        assert self.proc.stop() == 0, "gateway did not stop cleanly"

    def __enter__(self) -> GatewayProc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def both_up(gw: GatewayProc, a: str, b: str) -> None:
    """Wait for the gateway's first health check of each decoder: it serves
    once one is up, and a request sent before the other's check passed can
    only go to the first (what is spread is then not the policy's choice)."""
    wait_until(lambda: gw.metric("omni_gateway_decoder_up") == {a: 1.0, b: 1.0}, 30, 0.02)


# ---------------------------------------------------------------------------
# (a), (b): spreading.


@pytest.mark.e2e
def test_round_robin_spreads_requests_over_two_decoder_processes(
    pair: DecoderPair, sock_dir: Path
) -> None:
    a, b = pair.targets
    before = pair.finished()
    with GatewayProc(["--decoder", f"{a},{b}"], sock_dir) as gw:
        assert health_status(gw.channel) == SERVING
        both_up(gw, a, b)
        for i in range(8):
            assert speak(gw.stub, f"request number {i}")
        after = pair.finished()
        assert [x - y for x, y in zip(after, before, strict=True)] == [4, 4]
        assert gw.metric("omni_gateway_decoder_requests_total") == {a: 4.0, b: 4.0}
        assert gw.metric("omni_gateway_decoder_up") == {a: 1.0, b: 1.0}
        assert gw.metric("omni_gateway_decoder_in_flight") == {a: 0.0, b: 0.0}
        # The decoders' own figures, polled every second, labelled by decoder.
        want = {a: float(after[0]), b: float(after[1])}
        wait_until(lambda: gw.metric("omni_gateway_decoder_finished_requests") == want, 5, 0.1)
        assert gw.metric("omni_gateway_decoder_active_requests") == {a: 0.0, b: 0.0}
        assert set(gw.metric("omni_gateway_decoder_fallback_steps")) == {a, b}


@pytest.mark.e2e
def test_least_outstanding_sends_new_requests_to_the_idle_decoder(
    pair: DecoderPair, sock_dir: Path
) -> None:
    a, b = pair.targets
    args = ["--decoder", a, "--decoder", b, "--decoder-balance", BALANCE_LEAST_OUTSTANDING]
    with GatewayProc(args, sock_dir) as gw:
        both_up(gw, a, b)
        long = gw.stub.Speak(long_request("long"))
        try:
            next(long)  # running, and held open (not read further)
            in_flight = gw.metric("omni_gateway_decoder_in_flight")
            busy = next(label for label, value in in_flight.items() if value == 1.0)
            idle = b if busy == a else a
            for i in range(4):
                assert speak(gw.stub, f"short {i}")
            # Round-robin would have sent two of the four to the busy decoder.
            assert gw.metric("omni_gateway_decoder_requests_total") == {busy: 1.0, idle: 4.0}
            assert gw.metric("omni_gateway_decoder_in_flight") == {busy: 1.0, idle: 0.0}
        finally:
            long.cancel()
        # The long request's client cancelled it: counted CANCELLED, not as an error
        # (a cancel while the gateway's write waits: tests/test_gateway_service.py).
        wait_until(
            lambda: (
                gw.metric("omni_gateway_requests_total", "code") == {"OK": 4.0, "CANCELLED": 1.0}
            ),
            5,
        )


# ---------------------------------------------------------------------------
# (c): a decoder dies while streams run on both, then comes back.


def _drain(stream: grpc.Future, results: dict[str, object], key: str) -> None:
    try:
        for _ in stream:
            pass
        results[key] = ("OK", time.monotonic())
    except grpc.RpcError as exc:
        results[key] = (exc.code(), time.monotonic())


@pytest.mark.e2e
def test_sigkill_one_decoder_fails_its_streams_fast_and_the_other_takes_over(
    pair: DecoderPair, sock_dir: Path
) -> None:
    a, b = pair.targets
    with GatewayProc(["--decoder", f"{a},{b}"], sock_dir) as gw:
        both_up(gw, a, b)
        streams = {f"long{i}": gw.stub.Speak(long_request(f"long{i}")) for i in range(4)}
        for stream in streams.values():
            next(stream)  # all four running
        assert gw.metric("omni_gateway_decoder_in_flight") == {a: 2.0, b: 2.0}
        results: dict[str, object] = {}
        readers = [
            threading.Thread(target=_drain, args=(stream, results, key), daemon=True)
            for key, stream in streams.items()
        ]
        for reader in readers:
            reader.start()
        try:
            killed_at = time.monotonic()
            pair.kill(1)
            # The killed decoder's two streams end UNAVAILABLE within a couple of
            # seconds; the two on the other decoder keep running.
            wait_until(lambda: len(results) >= 2, 2.0)
            time.sleep(0.2)
            ended = dict(results)
            assert len(ended) == 2, ended
            for code, _ in ended.values():  # type: ignore[misc]
                assert code == grpc.StatusCode.UNAVAILABLE
            max_s = max(at for _, at in ended.values()) - killed_at  # type: ignore[misc]
            assert max_s < 2.0
        finally:
            for stream in streams.values():
                stream.cancel()
            for reader in readers:
                reader.join(10)
        # New requests: every one succeeds, on the surviving decoder (a start that
        # lands on the dead one before its check notices is retried).
        before_a = pair.finished_on(0)
        errors = 0
        for i in range(8):
            try:
                assert speak(gw.stub, f"after the kill {i}")
            except grpc.RpcError:
                errors += 1
        assert errors == 0
        assert pair.finished_on(0) - before_a == 8
        assert gw.metric("omni_gateway_decoder_up") == {a: 1.0, b: 0.0}
        assert health_status(gw.channel) == SERVING

        # The decoder is back on its address: it gets new traffic again.
        pair.restart(1)
        back = wait_until(lambda: gw.metric("omni_gateway_decoder_up") == {a: 1.0, b: 1.0}, 2.0)
        for i in range(6):
            assert speak(gw.stub, f"after the restart {i}")
        assert pair.finished_on(1) == 3  # a new process: its count starts at 0
        print(
            f"\nkilled decoder's streams ended UNAVAILABLE within {max_s:.2f}s; the restarted "
            f"one was up at the gateway {back:.2f}s after it reported SERVING"
        )


# ---------------------------------------------------------------------------
# (d): --decoder syntax.


def test_decoder_option_takes_lists_and_repeats() -> None:
    from gateway.__main__ import parse_args

    config = parse_args(
        [
            "--listen", "127.0.0.1:0",
            "--decoder", "unix:///tmp/a.sock,127.0.0.1:5001",
            "--decoder", " dns:///decoders.example:5002 ",
            "--decoder", "decoder-1.example:5003",
            "--decoder-balance", "least-outstanding",
            "--decoder-resolve-interval-s", "2.5",
        ]
    )  # fmt: skip
    targets = config.decoder_targets
    assert [t.spec for t in targets] == [
        "unix:///tmp/a.sock",
        "127.0.0.1:5001",
        "dns:///decoders.example:5002",
        "decoder-1.example:5003",
    ]
    assert [t.dial for t in targets[:2]] == ["unix:///tmp/a.sock", "127.0.0.1:5001"]
    assert [(t.resolved, t.host, t.port) for t in targets[2:]] == [
        (True, "decoders.example", 5002),
        (True, "decoder-1.example", 5003),
    ]
    assert config.decoder_balance == "least-outstanding"
    assert config.decoder_resolve_interval_s == 2.5
    # A single target is what it always was (localhost dials 127.0.0.1).
    single = parse_args(["--listen", "127.0.0.1:0", "--decoder", "localhost:5001"])
    assert [(t.dial, t.resolved) for t in single.decoder_targets] == [("127.0.0.1:5001", False)]
    assert parse_args(["--listen", "127.0.0.1:0", "--decoder", "a:1"]).decoder_balance == (
        "round-robin"
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("unix:///a.sock,,unix:///b.sock", "entry 2 is empty"),
        ("unix:///a.sock,", "entry 2 is empty"),
        ("", "entry 1 is empty"),
        ("http://decoder:5001", "unknown scheme 'http'"),
        ("grpc://decoder:5001", "unknown scheme 'grpc'"),
        ("decoder", "expected a port"),
        ("decoder:port", "expected a port"),
        ("decoder:0", "port must be 1-65535"),
        ("decoder:70000", "port must be 1-65535"),
        ("::1:5001", "IPv6 address goes in brackets"),
        ("[fe:zz]:5001", "not an IPv6 address"),
        ("bad/host:5001", "not a host name"),
        ("dns://8.8.8.8/decoders:5001", "a DNS server in the target is not supported"),
        ("dns:///:5001", "needs a name"),
        ("unix://relative.sock", "absolute path"),
        ("127.0.0.1:5001,127.0.0.1:5001", "is given twice"),
    ],
)
def test_bad_decoder_values_are_refused_naming_the_option(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.__main__ import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--listen", "127.0.0.1:0", "--decoder", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error: --decoder: " in err and message in err, err
    # The config (the Python API) refuses it too, naming the field.
    with pytest.raises(InvalidArgumentError, match=r"^decoder: "):
        parse_decoder_targets(value)


def test_bad_balance_and_resolve_interval_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.__main__ import parse_args

    base = ["--listen", "127.0.0.1:0", "--decoder", "a:1"]
    with pytest.raises(SystemExit):
        parse_args([*base, "--decoder-balance", "random"])
    assert "--decoder-balance" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([*base, "--decoder-resolve-interval-s", "0"])
    assert "--decoder-resolve-interval-s must be > 0" in capsys.readouterr().err


def test_metric_labels_are_addresses() -> None:
    assert replica_label("ipv4:10.0.0.7:5001") == "10.0.0.7:5001"
    assert replica_label("ipv6:[fd00::7]:5001") == "[fd00::7]:5001"
    assert replica_label("unix:///run/omni/decoder.sock") == "unix:///run/omni/decoder.sock"
    assert replica_label("unix:///x\n\x1b[2Jy.sock") == "unix:///x??[2Jy.sock"
    assert len(replica_label("unix:///" + "d" * 1000)) == 200


# ---------------------------------------------------------------------------
# (e): DNS targets.


def labels(gw: GatewayThread) -> list[str]:
    return [r.label for r in gw.gateway.engine.pool.replicas]


@pytest.mark.e2e
def test_dns_target_follows_its_addresses_with_a_fake_resolver(
    pair: DecoderPair, sock_dir: Path
) -> None:
    port = pair.port
    one, two = pair.targets
    addresses = ["127.0.0.1"]
    failing = threading.Event()
    asked: list[tuple[str, int]] = []

    async def fake_resolver(host: str, p: int) -> list[str]:
        asked.append((host, p))
        if failing.is_set():
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return list(addresses)

    with GatewayThread(
        f"dns:///decoders.test:{port}",
        sock_dir,
        decoder_resolver=fake_resolver,
        decoder_resolve_interval_s=0.1,
    ) as gw:
        assert asked[0] == ("decoders.test", port)
        assert labels(gw) == [one]
        assert health_status(gw.channel) == SERVING
        # A second address appears (a replica scaled up): it joins the pool.
        addresses.append("127.0.0.2")
        wait_until(lambda: labels(gw) == [one, two], 2.0)
        pool = gw.gateway.engine.pool
        started = [r.started for r in pool.replicas]
        for i in range(4):
            assert speak(gw.stub, f"dns {i}")
        assert [r.started - s for r, s in zip(pool.replicas, started, strict=True)] == [2, 2]
        # The lookup fails for a while: the known addresses stay.
        failing.set()
        calls = len(asked)
        wait_until(lambda: len(asked) >= calls + 3, 2.0)
        assert labels(gw) == [one, two]
        # The first address disappears (a replica scaled down): it leaves the pool.
        addresses.remove("127.0.0.1")
        failing.clear()
        wait_until(lambda: labels(gw) == [two], 2.0)
        assert REGISTRY.get_sample_value("omni_gateway_decoder_up", {"decoder": one}) is None
        assert REGISTRY.get_sample_value("omni_gateway_decoder_up", {"decoder": two}) == 1.0
        for i in range(3):
            assert speak(gw.stub, f"after scale-down {i}")
        assert pool.replicas[0].started - started[1] == 5


@pytest.mark.e2e
def test_plain_name_target_is_resolved_with_a_fake_resolver(
    pair: DecoderPair, sock_dir: Path
) -> None:
    async def fake_resolver(host: str, port: int) -> list[str]:
        assert host == "decoders.test"
        return ["127.0.0.2", "127.0.0.1"]

    target = f"decoders.test:{pair.port}"
    with GatewayThread(target, sock_dir, decoder_resolver=fake_resolver) as gw:
        assert labels(gw) == [pair.targets[1], pair.targets[0]]
        assert speak(gw.stub, "resolved by name")


@pytest.mark.e2e
def test_dns_target_uses_every_getaddrinfo_address(pair: DecoderPair, sock_dir: Path) -> None:
    port = pair.port
    want = []
    for family, _, _, _, sockaddr in socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM):
        ip = sockaddr[0]
        label = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if label not in want:
            want.append(label)
    with GatewayThread(f"dns:///localhost:{port}", sock_dir) as gw:
        assert labels(gw) == want  # 127.0.0.1, and [::1] where localhost has it
        if f"127.0.0.1:{port}" in want:  # the module's decoder listens there
            assert health_status(gw.channel) == SERVING
            assert speak(gw.stub, "found by getaddrinfo")


# ---------------------------------------------------------------------------
# (f) and failure handling in-process.


def test_all_decoders_down_is_unavailable_at_once(sock_dir: Path) -> None:
    targets = [f"unix://{sock_dir / 'down-1.sock'}", f"unix://{sock_dir / 'down-2.sock'}"]
    with GatewayThread(targets, sock_dir, http_host="127.0.0.1", http_port=0) as gw:
        assert health_status(gw.channel) == NOT_SERVING
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            speak(gw.stub, "anyone?")
        elapsed = time.monotonic() - start
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == "no healthy decoder, 2 configured"
        assert elapsed < 0.5, elapsed
        request = gateway_pb2.OmniGatewayServiceGenerateRequest(prompt="anyone?")
        with pytest.raises(grpc.RpcError) as info:
            list(gw.stub.Generate(request, timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        conn = http.client.HTTPConnection("127.0.0.1", gw.http_port, timeout=5)
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            body = json.loads(response.read())
        finally:
            conn.close()
        assert response.status == 503
        assert body["decoders"] == {"healthy": 0, "configured": 2}
        # One comes up: served again, health SERVING.
        with FakeDecoder(sock_dir / "down-2.sock"):
            wait_until(lambda: health_status(gw.channel) == SERVING, 2.0)
            assert speak(gw.stub, "there you are")


def test_a_request_that_cannot_start_is_retried_once_on_another_replica(sock_dir: Path) -> None:
    absent = f"unix://{sock_dir / 'absent.sock'}"
    with FakeDecoder(sock_dir / "present.sock") as fake:

        async def run() -> tuple[list[int], float | None, bool]:
            # Not started: no check has run yet, so both replicas look usable
            # and round-robin sends the first request to the absent one.
            pool = ReplicaPool([absent, fake.target])
            engine = GatewayEngine(pool)
            try:
                request = SpeechRequest(request_id="moved", text="hi")
                async with contextlib.aclosing(engine.speak(request)) as chunks:
                    final = [chunk.final async for chunk in chunks][-1]
                retries = REGISTRY.get_sample_value(
                    "omni_gateway_decoder_retries_total", {"decoder": absent}
                )
                return [r.started for r in pool.replicas], retries, final
            finally:
                await engine.close()

        started, retries, final = asyncio.run(run())
    assert final
    assert started == [1, 1]
    assert retries == 1.0
    assert [r.request_id for r in fake.state.requests] == ["moved"]
    assert REGISTRY.get_sample_value("omni_gateway_decoder_up", {"decoder": absent}) is None


def test_a_stream_that_breaks_after_output_is_not_retried(sock_dir: Path) -> None:
    config = FakeDecoderConfig(num_chunks=10, fail_after=2, fail_code=grpc.StatusCode.UNAVAILABLE)
    with (
        FakeDecoder(sock_dir / "one.sock", config) as first,
        FakeDecoder(sock_dir / "two.sock", config) as second,
        GatewayThread([first.target, second.target], sock_dir) as gw,
    ):
        received = []
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            for chunk in gw.stub.Speak(gateway_pb2.SpeakRequest(request_id="b", text="hi")):
                received.append(chunk.sequence_number)
        assert time.monotonic() - start < 2.0
        assert received == [0, 1]
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "fake decoder failure" in info.value.details()
        assert len(first.state.requests) + len(second.state.requests) == 1


def test_abort_goes_to_the_replica_the_request_is_on(sock_dir: Path) -> None:
    config = FakeDecoderConfig(num_chunks=200, delay_s=0.02)
    with (
        FakeDecoder(sock_dir / "one.sock", config) as first,
        FakeDecoder(sock_dir / "two.sock", config) as second,
        GatewayThread([first.target, second.target], sock_dir) as gw,
    ):
        for request_id in ("x", "y"):  # round-robin: one on each
            stream = gw.stub.Speak(gateway_pb2.SpeakRequest(request_id=request_id, text="hi"))
            next(stream)
            on, other = (
                (first, second)
                if request_id in {r.request_id for r in first.state.requests}
                else (second, first)
            )
            assert gw.gateway.engine.pool.replica_of(request_id).label == replica_label(on.target)
            stream.cancel()
            assert on.wait_for(lambda rid=request_id, d=on: rid in d.state.aborts)
            assert request_id not in other.state.aborts
        assert {r.request_id for r in first.state.requests} != {
            r.request_id for r in second.state.requests
        }


def test_replicas_that_disagree_are_logged(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.replicas")
    with (
        FakeDecoder(sock_dir / "one.sock") as first,
        FakeDecoder(sock_dir / "two.sock", FakeDecoderConfig(voices=("carol",))) as second,
        GatewayThread([first.target, second.target], sock_dir) as gw,
    ):
        wait_until(lambda: "disagree" in caplog.text, 3.0)
        assert "carol" in caplog.text and "alice" in caplog.text
        assert health_status(gw.channel) == SERVING
