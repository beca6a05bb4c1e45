"""Run a Python implementation for tests: as a real process, or in-process.

with MaterializerProcess("pool", deployment="t1", socket_dir=tmp, workers=2) as m:
    results = run_conformance(m.target, m.deployment)

with InProcessServer(MyServicer(config), "unix:///tmp/x/m.sock") as srv:
    results = run_conformance(srv.target, "t1")
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from omni_common.errors import UnavailableError
from omni_common.server import ServerConfig, build_server, wait_for_health_sync
from omni_serving.v1 import materializer_pb2_grpc


class MaterializerProcess:
    """`python -m materializer_svc --impl NAME` on a UDS in `socket_dir`."""

    def __init__(
        self,
        impl: str,
        *,
        deployment: str,
        socket_dir: str | Path,
        workers: int = 2,
        extra_args: Sequence[str] = (),
        log_level: str = "WARNING",
        start_timeout_s: float = 60.0,
    ) -> None:
        self.impl = impl
        self.deployment = deployment
        self.socket = Path(socket_dir) / f"{impl}.sock"
        self.target = f"unix://{self.socket}"
        self.args = [
            sys.executable, "-m", "materializer_svc",
            "--listen", self.target, "--impl", impl, "--deployment", deployment,
            "--workers", str(workers), "--log-level", log_level, *extra_args,
        ]  # fmt: skip
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(socket_dir) / f"{impl}.log"

    def start(self) -> MaterializerProcess:
        self._log = open(self.log_path, "wb")  # noqa: SIM115  closed in stop()
        self.proc = subprocess.Popen(
            self.args, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ)
        )
        started = False
        try:
            wait_for_health_sync(self.target, self.start_timeout_s)
            started = True
        except UnavailableError:
            self.stop()
            raise RuntimeError(f"{self.impl} did not start; log:\n{self.log()}") from None
        finally:
            if not started:
                self.stop()  # interrupted: leave no process behind
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM (graceful shutdown), then SIGKILL if it lingers; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> MaterializerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class InProcessServer:
    """A grpc.aio server for a servicer, on its own loop thread, on a UDS.

    The server is started and stopped by one task on its own loop (stopping
    it from another thread's coroutine can stall).
    """

    def __init__(self, servicer, address: str) -> None:
        self.servicer, self.address = servicer, address
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def serve() -> None:
            def register(server) -> None:
                materializer_pb2_grpc.add_MaterializerServiceServicer_to_server(
                    self.servicer, server
                )

            self.stop_event = asyncio.Event()
            server, self.target, _ = await build_server(
                ServerConfig(self.address, "m", grace_s=0), register
            )
            self.ready.set()
            await self.stop_event.wait()
            await server.stop(0)

        self.loop.run_until_complete(serve())
        self.loop.close()

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(10)
        assert not self.thread.is_alive(), "in-process server did not stop"
        self.servicer.close()
