"""`omni-serving up`: start decoder, materializer and gateway as processes.

Sockets live in a private runtime directory (mode 0700). The launcher waits
for each service's grpc health, prints the endpoints, and on Ctrl-C/SIGTERM
stops the three in reverse order (gateway first), waits for them, and checks
that no shared-memory segment of the deployment is left.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from omni_common.server import wait_for_health_sync
from omni_common.shm_arena import list_segments, sweep_stale


@dataclass
class StackConfig:
    profile: str = "tts"
    engine: str = "reference"
    materializer_impl: str = "reference"
    model_dir: str = ""
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 8000
    deployment: str = ""
    runtime_dir: str = ""
    sync: bool = False  # no materializer: payloads built in-process
    log_level: str = "INFO"
    extra_decoder_args: list[str] = field(default_factory=list)


@dataclass
class ServiceProcess:
    name: str
    argv: list[str]
    target: str
    proc: subprocess.Popen | None = None


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (for `--port 0`): the OS picks, we release it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def service_commands(cfg: StackConfig, runtime: Path) -> list[ServiceProcess]:
    """The three services' command lines (what docker/compose.yaml runs too)."""
    py = sys.executable
    dec_sock = f"unix://{runtime}/decoder.sock"
    mat_sock = f"unix://{runtime}/materializer.sock"
    common = ["--deployment", cfg.deployment, "--log-level", cfg.log_level]
    materializer = ServiceProcess(
        "materializer",
        [py, "-m", "materializer_svc", "--listen", mat_sock, "--impl", cfg.materializer_impl, *common],
        mat_sock,
    )
    decoder_args = [py, "-m", "decoder_svc", "--listen", dec_sock, "--profile", cfg.profile, "--engine", cfg.engine, *common]
    if not cfg.sync:
        decoder_args += ["--materializer", mat_sock]
    if cfg.model_dir:
        decoder_args += ["--model-dir", cfg.model_dir]
    decoder = ServiceProcess("decoder", decoder_args + cfg.extra_decoder_args, dec_sock)
    gw_target = f"{cfg.host}:{cfg.port}"
    gateway = ServiceProcess(
        "gateway",
        [py, "-m", "gateway", "--listen", gw_target, "--decoder", dec_sock, "--http-port", str(cfg.http_port),
         "--log-level", cfg.log_level],
        f"127.0.0.1:{cfg.port}" if cfg.host in ("0.0.0.0", "::", "") else gw_target,
    )
    return ([] if cfg.sync else [materializer]) + [decoder, gateway]


class Stack:
    """A running stack; use as a context manager or call start()/stop()."""

    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        if not cfg.deployment:
            cfg.deployment = f"up{os.getpid()}"
        if cfg.port == 0:
            cfg.port = free_port()
        if cfg.http_port == 0:
            cfg.http_port = free_port()
        if cfg.runtime_dir:
            self.runtime = Path(cfg.runtime_dir)
            self.runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.runtime, 0o700)
            self._tmp = None
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="omni-serving-")
            self.runtime = Path(self._tmp.name)  # mkdtemp creates it 0700
        self.services = service_commands(cfg, self.runtime)

    @property
    def shm_prefix(self) -> str:
        return f"omni-{self.cfg.deployment}"

    @property
    def gateway_target(self) -> str:
        return self.services[-1].target

    @property
    def decoder_target(self) -> str:
        return next(s.target for s in self.services if s.name == "decoder")

    @property
    def materializer_target(self) -> str | None:
        return next((s.target for s in self.services if s.name == "materializer"), None)

    def start(self, timeout_s: float = 120.0) -> None:
        sweep_stale(self.shm_prefix)
        try:
            for svc in self.services:
                svc.proc = subprocess.Popen(svc.argv, start_new_session=True)
                wait_for_health_sync(svc.target, timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 30.0) -> list[str]:
        """Stop gateway, decoder, materializer (in that order). Returns leftover segments."""
        for svc in reversed(self.services):
            if svc.proc is not None and svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGTERM)
                try:
                    svc.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    svc.proc.kill()
                    svc.proc.wait()
        # A killed decoder cannot unlink its arena; its flock is gone, so sweep.
        sweep_stale(self.shm_prefix)
        if self._tmp is not None:
            self._tmp.cleanup()
        return list_segments(self.shm_prefix)

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_up(cfg: StackConfig) -> int:
    stack = Stack(cfg)
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"starting omni-serving (profile {cfg.profile}, engine {cfg.engine}) ...", file=sys.stderr)
    stack.start()
    print(f"gateway gRPC: {stack.gateway_target}")
    print(f"gateway HTTP: http://{cfg.host}:{cfg.http_port}/v1/audio/speech")
    print(f"runtime dir:  {stack.runtime}")
    print(f'try: omni-serving speak "Hello there" -o hello.wav --target {stack.gateway_target}', flush=True)
    try:
        while not stop:
            for svc in stack.services:
                if svc.proc is not None and svc.proc.poll() is not None:
                    print(f"{svc.name} exited with code {svc.proc.returncode}; stopping", file=sys.stderr)
                    stop = True
            time.sleep(0.2)
    finally:
        left = stack.stop()
    if left:
        print(f"warning: shared-memory segments left: {left}", file=sys.stderr)
        return 1
    print("stopped", file=sys.stderr)
    return 0
