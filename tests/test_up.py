"""`omni-serving up` as a user runs it.

The end-to-end tests start the CLI as a subprocess (free ports), speak
through the gateway, scrape every metrics endpoint, stop it with SIGTERM or a
terminal's Ctrl-C and check that no process of the deployment (children of
children included) and no shared-memory segment of it is left. The other tests
cover option handling: config files, precedence, errors.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omni_cli.main import main as cli_main
from omni_common.shm_arena import sweep_stale
from omni_stack.commands import service_commands
from omni_stack.config import (
    StackConfig,
    add_up_arguments,
    config_from_args,
    default_value,
    load_config_file,
)
from omni_stack.errors import ConfigError
from tests.speech_helpers import check_chunks, speak_chunks

SHM = Path("/dev/shm")
_ENDPOINT = re.compile(r"^\s+(.+?):\s+(\S+)$")

# {endpoint label: [(sample name, "nonzero" | "present")]}
SERIES = {
    "decoder metrics": [
        ("omni_decoder_step_gap_seconds_count", "nonzero"),
        ("omni_decoder_steps_total", "nonzero"),
        ("omni_decoder_arena_slots_in_use", "present"),
        ("omni_decoder_materializer_lag_steps", "present"),
    ],
    "materializer metrics": [
        ("omni_materializer_steps_total", "nonzero"),
        ("omni_materializer_build_seconds_count", "nonzero"),
    ],
    "gateway metrics": [
        ("omni_gateway_ttfp_seconds_count", "nonzero"),
        ("omni_gateway_active_streams", "present"),
    ],
}


# -- a running `omni-serving up` -------------------------------------------------------


class Up:
    """`python -m omni_cli.main up ...` in its own session, like a terminal's foreground job."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.deployment = f"uptest{os.getpid()}x{time.monotonic_ns() % 10**6}"
        self.out_path, self.err_path = tmp_path / "up.out", tmp_path / "up.err"
        argv = [
            sys.executable, "-m", "omni_cli.main", "up",
            "--deployment", self.deployment,
            "--port", "0", "--http-port", "0",
            "--decoder-metrics-port", "0", "--materializer-metrics-port", "0",
            "--log-level", "WARNING",
            *args,
        ]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=tmp_path,
                env={**os.environ, **(env or {})}, start_new_session=True,
            )
        self.endpoints: dict[str, str] = {}

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def errors(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = self.output()
            if any(line.startswith("try: ") for line in out.splitlines()):
                self.endpoints = dict(m.groups() for line in out.splitlines() if (m := _ENDPOINT.match(line)))
                return self.endpoints
            if self.proc.poll() is not None:
                pytest.fail(f"`omni-serving up` exited with {self.proc.returncode} while starting:\n{self.errors()[-4000:]}")
            time.sleep(0.2)
        self.cleanup()
        pytest.fail(f"`omni-serving up` not ready after {timeout_s}s:\n{self.errors()[-4000:]}")

    def tree(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def stop(self, how: str = "SIGTERM", timeout_s: float = 90.0) -> int:
        if how == "SIGTERM":
            self.proc.send_signal(signal.SIGTERM)
        else:  # Ctrl-C in a terminal: SIGINT to the foreground process group
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.cleanup()
            pytest.fail(f"`omni-serving up` did not stop within {timeout_s}s after {how}:\n{self.errors()[-4000:]}")

    def cleanup(self) -> None:
        """After a failed test: stop the stack as well as possible, leave nothing."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        left = self.deployment_processes()
        for p in left:
            p.kill()
        psutil.wait_procs(left, timeout=10)
        sweep_stale(f"omni-{self.deployment}")  # a killed decoder's arena

    def deployment_processes(self) -> list[psutil.Process]:
        """Live processes that carry this deployment's marker in their environment."""
        found = []
        for p in psutil.process_iter():
            try:
                if p.environ().get("OMNI_DEPLOYMENT") == self.deployment and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except psutil.Error:
                continue
        return found

    def segments(self) -> list[str]:
        return sorted(p.name for p in SHM.glob(f"omni-{self.deployment}-*"))


@pytest.fixture
def up_factory(tmp_path):
    started: list[Up] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Up:
        up = Up(tmp_path, *args, env=env)
        started.append(up)
        return up

    yield start
    for up in started:  # a failed test must not leave a stack behind
        up.cleanup()


# -- checks --------------------------------------------------------------------------------


def _samples(url: str) -> dict[str, float]:
    """{sample name: sum over its label sets} of a Prometheus text endpoint."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def check_metrics(endpoints: dict[str, str], labels: list[str], timeout_s: float = 15.0) -> None:
    """Every named series is served; counters have counted (polled: the last
    steps may be answered just after the client's stream ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        problems = []
        for label in labels:
            assert label in endpoints, f"`up` printed no {label!r} endpoint: {endpoints}"
            samples = _samples(endpoints[label])
            for name, want in SERIES[label]:
                if name not in samples:
                    problems.append(f"{label}: {name} missing")
                elif want == "nonzero" and samples[name] <= 0:
                    problems.append(f"{label}: {name} = {samples[name]}")
        if not problems:
            return
        if time.monotonic() > deadline:
            pytest.fail("metrics not as expected:\n  " + "\n  ".join(problems))
        time.sleep(0.5)


def check_running(up: Up) -> list[psutil.Process]:
    runtime = Path(up.endpoints["runtime dir"])
    assert runtime.stat().st_mode & 0o777 == 0o700, f"runtime dir mode {oct(runtime.stat().st_mode)}"
    assert up.endpoints["decoder"] == f"unix://{runtime}/decoder.sock"
    tree = up.tree()
    assert len(tree) >= 3, f"expected the three services under `up`, got {[p.cmdline()[:3] for p in tree]}"
    marked = {p.pid for p in up.deployment_processes()}
    assert {p.pid for p in tree} <= marked | {p.pid for p in tree if not _alive(p)}
    return tree


def check_stopped(up: Up, tree: list[psutil.Process], rc: int) -> None:
    assert rc == 0, f"`omni-serving up` exited with {rc}:\n{up.errors()[-4000:]}"
    assert "stopped" in up.errors()
    left = [p for p in tree if _alive(p)]
    assert not left, f"processes left: {[(p.pid, p.cmdline()) for p in left]}"
    marked = up.deployment_processes()
    assert not marked, f"processes of deployment {up.deployment} left: {[(p.pid, p.cmdline()) for p in marked]}"
    assert up.segments() == [], f"shared-memory segments left: {up.segments()}"
    named = sorted(p.name for p in SHM.iterdir() if up.deployment in p.name)
    assert named == [], f"/dev/shm entries naming deployment {up.deployment} left: {named}"
    assert not Path(up.endpoints["runtime dir"]).exists(), "runtime dir left"


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def speak_and_check(up: Up, text: str = "Hello there", seed: int = 7) -> None:
    pcm = check_chunks(speak_chunks(up.endpoints["gateway gRPC"], text, seed))
    assert len(pcm) > 0, "no audio"


# -- end to end ------------------------------------------------------------------------------


@pytest.mark.e2e
def test_up_reference_speaks_serves_metrics_and_stops_clean(up_factory, tmp_path):
    # The engine comes from a config file; the command line's --deployment
    # wins over the file's.
    config = tmp_path / "stack.toml"
    config.write_text('engine = "fake"\nmaterializer-impl = "reference"\ndeployment = "from-file"\n')
    up = up_factory("--config", str(config))
    endpoints = up.wait_ready(120)
    assert "omni-serving speak" in up.output()
    assert f"(deployment {up.deployment})" in up.output()
    tree = check_running(up)

    speak_and_check(up)
    assert up.segments(), "the decoder's arena should exist while running"
    check_metrics(endpoints, list(SERIES))

    rc = up.stop("SIGTERM")
    check_stopped(up, tree, rc)


@pytest.mark.e2e
def test_up_ctrl_c_stops_all_children(up_factory):
    # The pool materializer starts a forkserver and worker processes: children
    # of children, which must go too.
    up = up_factory("--engine", "fake", "--materializer-impl", "pool")
    up.wait_ready(120)
    tree = check_running(up)
    speak_and_check(up)
    assert len(tree) > 3, "the pool materializer should have started worker processes"
    rc = up.stop("Ctrl-C")
    check_stopped(up, tree, rc)


@pytest.mark.e2e
def test_up_reports_a_service_that_fails_to_start(up_factory):
    up = up_factory("--engine", "fake", "--materializer-impl", "no-such-impl")
    rc = up.proc.wait(120)
    assert rc == 1
    assert "materializer exited" in up.errors(), up.errors()[-2000:]
    assert not up.deployment_processes()
    assert up.segments() == []


@pytest.mark.e2e
@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the cpu or cuda extra)")
def test_up_vllm_default_engine(up_factory, tmp_path):
    # Default engine, no --model: the decoder creates its tiny models on first run.
    models = tmp_path / "models"
    up = up_factory(env={"OMNI_SERVING_MODEL_DIR": str(models)})
    endpoints = up.wait_ready(600)
    assert "engine vllm" in up.errors()
    from decoder_svc.qwen3_omni.cache import TINY_DIR_NAME

    assert (models / TINY_DIR_NAME / "config.json").is_file(), "the decoder should have created the tiny checkpoint"
    tree = check_running(up)
    # the talker's engine runs in a process of its own, beside the decoder
    stages = [p for p in tree if _alive(p) and "decoder stage talker" in " ".join(p.cmdline())]
    assert len(stages) == 1, [p.cmdline()[:4] for p in tree]

    speak_and_check(up)
    check_metrics(endpoints, list(SERIES))

    rc = up.stop("SIGTERM")
    check_stopped(up, tree, rc)


# -- options and config files -------------------------------------------------------------------


def _parse(*argv: str) -> StackConfig:
    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_defaults():
    cfg = _parse()
    assert (cfg.profile, cfg.engine, cfg.materializer_impl) == ("auto", "vllm", "reference")
    assert (cfg.host, cfg.port, cfg.http_port) == ("127.0.0.1", 50051, 8000)
    assert (cfg.decoder_metrics_port, cfg.materializer_metrics_port) == (9101, 9102)
    assert cfg.startup_timeout >= 120, "vLLM's first run creates models: startup needs time"


@pytest.mark.parametrize("suffix", [".toml", ".yaml", ".yml"])
def test_config_file_and_command_line_precedence(tmp_path, suffix):
    path = tmp_path / f"stack{suffix}"
    if suffix == ".toml":
        path.write_text('profile = "omni"\nengine = "fake"\nhttp-port = 9000\nsync = true\nstartup_timeout = 60\n')
    else:
        path.write_text("profile: omni\nengine: fake\nhttp-port: 9000\nsync: true\nstartup_timeout: 60\n")
    cfg = _parse("--config", str(path), "--http-port", "9001", "--no-sync")
    assert cfg.profile == "omni" and cfg.engine == "fake" and cfg.startup_timeout == 60.0
    assert cfg.http_port == 9001, "the command line wins over the file"
    assert cfg.sync is False
    assert cfg.port == default_value("port"), "keys absent from both keep their default"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('engine = "fake"\nmaterialiser-impl = "pool"\n', "'materialiser-impl'"),
        ('port = "50051"\n', "'port'"),
        ('engine = "tensorrt"\n', "'engine'"),
        ("engine = \n", "not valid TOML"),
    ],
)
def test_config_file_errors_name_the_key(tmp_path, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config_file(path)


def test_cli_reports_config_errors(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("decoder-metrics-prot: 9000\n")
    assert cli_main(["up", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'decoder-metrics-prot'" in err and str(path) in err


def test_cli_rejects_bad_values(capsys):
    assert cli_main(["up", "--port", "70000"]) == 2
    assert "port" in capsys.readouterr().err


def test_service_commands_pass_metrics_flags_and_sockets(tmp_path):
    cfg = StackConfig(deployment="d1", decoder_metrics_port=9201, materializer_metrics_port=9202,
                      metrics_host="0.0.0.0", engine="fake", model="/m")
    svcs = {s.name: s for s in service_commands(cfg, tmp_path)}
    assert list(svcs) == ["materializer", "decoder", "gateway"]

    def flags(name: str) -> dict[str, str]:
        argv = svcs[name].argv
        return dict(zip(argv[3::2], argv[4::2], strict=True))

    mat, dec, gw = flags("materializer"), flags("decoder"), flags("gateway")
    assert (mat["--metrics-port"], mat["--metrics-host"]) == ("9202", "0.0.0.0")
    assert (dec["--metrics-port"], dec["--metrics-host"]) == ("9201", "0.0.0.0")
    assert dec["--materializer"] == mat["--listen"] == f"unix://{tmp_path}/materializer.sock"
    assert gw["--decoder"] == dec["--listen"]
    assert dec["--model"] == "/m" and dec["--engine"] == "fake"
    assert all(s.env["OMNI_DEPLOYMENT"] == "d1" for s in svcs.values())
    sync = service_commands(StackConfig(deployment="d1", sync=True), tmp_path)
    assert [s.name for s in sync] == ["decoder", "gateway"]
    assert "--materializer" not in sync[0].argv


def test_configuration_doc_lists_every_option():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    commands = {
        "up": [sys.executable, "-m", "omni_cli.main", "up", "--help"],
        "decoder": [sys.executable, "-m", "decoder_svc", "--help"],
        "materializer": [sys.executable, "-m", "materializer_svc", "--help"],
        "gateway": [sys.executable, "-m", "gateway", "--help"],
    }
    missing = {}
    for name, argv in commands.items():
        help_text = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120,
                                   env={**os.environ, "COLUMNS": "200"}).stdout
        flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", help_text)) - {"--help"}
        assert flags, f"no options found in {name} --help"
        undocumented = sorted(f for f in flags if f"`{f}" not in doc)
        if undocumented:
            missing[name] = undocumented
    assert not missing, f"options missing from docs/configuration.md: {missing}"


def test_gateway_security_options_pass_through(tmp_path):
    cfg = _parse("--tls-cert", "/etc/omni/cert.pem", "--tls-key", "/etc/omni/key.pem",
                 "--auth-token-file", "/etc/omni/token",
                 "--allowed-origins", "https://app.example,http://localhost:3000", "--max-text-chars", "20000")
    gateway = service_commands(dataclasses.replace(cfg, deployment="d1"), tmp_path)[-1]
    flags = dict(zip(gateway.argv[3::2], gateway.argv[4::2], strict=True))
    assert flags["--tls-cert"] == "/etc/omni/cert.pem" and flags["--tls-key"] == "/etc/omni/key.pem"
    assert flags["--auth-token-file"] == "/etc/omni/token"
    assert flags["--allowed-origins"] == "https://app.example,http://localhost:3000"
    assert flags["--max-text-chars"] == "20000"
    plain = service_commands(StackConfig(deployment="d1"), tmp_path)[-1].argv
    passed = {"--tls-cert", "--tls-key", "--auth-token-file", "--allowed-origins", "--max-text-chars"} & set(plain)
    assert not passed, f"empty options are not passed, got {passed}"
    with pytest.raises(ConfigError, match="tls_cert and tls_key"):
        _parse("--tls-cert", "/etc/omni/cert.pem")
    with pytest.raises(ConfigError, match="max_text_chars"):
        _parse("--max-text-chars", "-1")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--max-restarts", "-1"], "max_restarts"),
        (["--restart-backoff", "0"], "restart_backoff"),
        (["--restart-backoff", "2", "--restart-backoff-max", "1"], "restart_backoff_max"),
        (["--restart-reset", "0"], "restart_reset"),
    ],
)
def test_restart_options_are_checked(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        _parse(*argv)
    ok = _parse("--max-restarts", "2", "--restart-backoff", "0.25", "--restart-backoff-max", "4")
    assert (ok.max_restarts, ok.restart_backoff, ok.restart_backoff_max) == (2, 0.25, 4.0)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make a certificate")
def test_tls_readiness_check_needs_a_tls_handshake(tmp_path):
    import socket
    import ssl
    import threading

    from omni_stack.health import tls_answers

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=omni.example", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    with socket.create_server(("127.0.0.1", 0)) as plain, \
            socket.create_server(("127.0.0.1", 0)) as tls:

        def serve(sock: socket.socket, wrap: bool) -> None:
            conn, _ = sock.accept()
            with conn:
                if wrap:
                    with contextlib.suppress(OSError), ctx.wrap_socket(conn, server_side=True) as s:
                        s.recv(1)
                else:
                    conn.recv(1)

        threads = [threading.Thread(target=serve, args=(sock, wrap), daemon=True)
                   for sock, wrap in ((tls, True), (plain, False))]
        for t in threads:
            t.start()
        assert tls_answers("127.0.0.1", tls.getsockname()[1], 5.0) is None
        problem = tls_answers("127.0.0.1", plain.getsockname()[1], 1.0)
        assert problem is not None and "no TLS handshake" in problem
        for t in threads:
            t.join(5)
