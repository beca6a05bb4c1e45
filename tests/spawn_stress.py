"""The launcher side of tests/test_spawn.py: start and restart services while gRPC is busy.

Run as its own process (a fork that hangs holds the interpreter lock, so
only another process can notice and end it):

    python -m tests.spawn_stress run --restarts 300 --service-restarts 3
    python -m tests.spawn_stress serve --listen unix:///path/health.sock

`run` is a launcher: a real `omni_stack.stack.Stack` whose services are two
tiny ones, so hundreds of starts fit in a CI budget:

- `health`: `serve` below, a real gRPC server built with the services'
  bootstrap (omni_common.server; setup_logging arms its parent-death
  signal). A thread of the launcher polls its health without a pause over
  one live channel, and a new channel now and then (what
  wait_for_health_sync does); it is SIGKILLed `--service-restarts` times and
  supervision restarts it, polling its health until it is SERVING again.
- `blink`: a Python process that exits with 3 as soon as it starts;
  supervision restarts it `--restarts` times.

Every start goes through the Stack's spawn path. The launcher counts the
fork handlers glibc ran in it (a handler registered with __register_atfork,
which fork() runs and vfork() does not), and writes one JSON object to
`--out`: restarts done, health checks answered, fork handlers run, the
health service's pid. faulthandler dumps every thread's stack and exits if
it is not done within `--bound-s` (or crashes). The counting handler runs
Python inside fork(): a launcher that forks may hang there instead of
finishing with a count; the test fails either way.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import signal
import sys
import threading
import time
from pathlib import Path

SERVICE_NAME = "omni_serving.test.SpawnStress"
BLINK = [sys.executable, "-S", "-c", "raise SystemExit(3)"]


def serve(listen: str) -> None:
    from omni_common.logging_setup import setup_logging
    from omni_common.server import ServerConfig, run_server

    setup_logging("WARNING", service="spawn-stress")
    run_server(ServerConfig(address=listen, service_name=SERVICE_NAME, grace_s=0), lambda s: None)


class ForkCounter:
    """Counts glibc's fork handlers run in this process (fork() runs them, vfork() does not)."""

    def __init__(self) -> None:
        self.count = 0
        self._callback = ctypes.CFUNCTYPE(None)(self._prepare)  # kept alive with self
        register = getattr(ctypes.CDLL(None), "__register_atfork")  # not name-mangled
        if register(self._callback, None, None, None) != 0:
            raise OSError("__register_atfork failed")

    def _prepare(self) -> None:
        self.count += 1


class Poller(threading.Thread):
    """Health checks of `target` back to back over one live channel (a fresh one every 50)."""

    def __init__(self, target: str) -> None:
        super().__init__(daemon=True, name="health-poller")
        self.target = target
        self.stop = threading.Event()
        self.ok = 0
        self.failed = 0
        self.ok_since_mark = 0

    def run(self) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        while not self.stop.is_set():
            with grpc.insecure_channel(self.target) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for _ in range(50):
                    if self.stop.is_set():
                        return
                    try:
                        reply = stub.Check(request, timeout=1.0)
                    except grpc.RpcError:
                        self.failed += 1
                        time.sleep(0.01)
                        continue
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        self.ok += 1
                        self.ok_since_mark += 1


def run(restarts: int, service_restarts: int, bound_s: float) -> dict:
    faulthandler.enable()  # a crash shows every thread too
    faulthandler.dump_traceback_later(bound_s, exit=True)
    forks = ForkCounter()
    from omni_stack.commands import ServiceProcess
    from omni_stack.config import StackConfig
    from omni_stack.stack import Stack

    logs: list[str] = []
    cfg = StackConfig(
        engine="fake",
        sync=True,
        port=0,
        http_port=0,
        decoder_metrics_port=-1,
        max_restarts=10 * restarts + 10,
        restart_backoff=0.001,
        restart_backoff_max=0.001,
        restart_reset=3600.0,
        startup_timeout=120.0,
        stop_timeout=10.0,
    )
    stack = Stack(cfg, log=logs.append)
    target = f"unix://{stack.runtime}/health.sock"
    health = ServiceProcess(
        "health", [sys.executable, "-m", "tests.spawn_stress", "serve", "--listen", target], target
    )
    blink = ServiceProcess("blink", BLINK, f"unix://{stack.runtime}/blink.sock")
    stack.services = [health]
    started = time.monotonic()
    poller = Poller(target)
    try:
        stack.start()
        poller.start()
        blink.state, blink.next_start = "backoff", 0.0
        stack.services.append(blink)
        # the health service is killed at evenly spaced points of the run
        kill_at = sorted(
            {restarts * (k + 1) // (service_restarts + 1) for k in range(service_restarts)}
        )
        while blink.restarts < restarts:
            if kill_at and blink.restarts >= kill_at[0]:
                kill_at.pop(0)
                _restart_health(stack, health)
            want = blink.restarts + 1
            while blink.restarts < want:  # supervision restarts it after the backoff
                _poll(stack)
            assert blink.proc is not None
            blink.proc.wait(30)
            _poll(stack)  # it crashed: backoff
        poller.ok_since_mark = 0
        deadline = time.monotonic() + 30
        while poller.ok_since_mark < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        took = time.monotonic() - started
    finally:
        poller.stop.set()
        left = stack.stop()
        poller.join(5)
    faulthandler.cancel_dump_traceback_later()
    return {
        "restarts": blink.restarts,
        "health_restarts": health.restarts,
        "checks_ok": poller.ok,
        "checks_failed": poller.failed,
        "checks_ok_at_end": poller.ok_since_mark,
        "fork_handlers_run": forks.count,
        "health_pid": health.proc.pid if health.proc else 0,
        "segments_left": left,
        "seconds": round(took, 1),
        "log_lines": len(logs),
    }


def _poll(stack) -> None:
    problem = stack.poll()
    if problem is not None:
        raise RuntimeError(problem)
    time.sleep(0.001)


def _restart_health(stack, health) -> None:
    """SIGKILL the health service; supervision restarts it and polls it until SERVING."""
    assert health.proc is not None
    health.proc.send_signal(signal.SIGKILL)
    before = health.restarts
    deadline = time.monotonic() + 120
    while not (health.restarts > before and health.state == "running"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the health service was not serving again: state {health.state}")
        _poll(stack)
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.spawn_stress")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--restarts", type=int, default=300)
    r.add_argument("--service-restarts", type=int, default=3)
    r.add_argument("--bound-s", type=float, default=240.0)
    r.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("serve")
    s.add_argument("--listen", required=True)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.listen)
        return 0
    summary = run(args.restarts, args.service_restarts, args.bound_s)
    args.out.write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
