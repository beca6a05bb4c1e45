"""materializer_svc entry point: `python -m materializer_svc --impl NAME`.

Stopping (SIGTERM or SIGINT) drains: health goes NOT_SERVING, the servicer's
`begin_drain` tells every open stream (StreamDraining to contract-2 senders)
and keeps answering them; the process exits once every stream ended or
`--drain-grace-s` passed. A second signal stops at once.

Handover on a Unix socket: a replacement started with `--take-over` on the
same path binds a fresh socket and renames it over the path, so new
connections reach it while the old process keeps the connections it
accepted. Every instance binds that way (a temporary name, then a rename),
and at exit removes the path only if it is still its own socket: stopping
the old process never removes its replacement's address.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import stat
from collections.abc import Callable

import grpc

from materializer_svc import metrics, registry
from materializer_svc.reference import DEFAULT_DRAIN_GRACE_S
from omni_common.errors import FailedPreconditionError
from omni_common.logging_setup import setup_logging
from omni_common.metrics import start_metrics_server
from omni_common.server import ServerConfig, _parse_address, _prepare_uds, build_server
from omni_serving.v1 import materializer_pb2, materializer_pb2_grpc

logger = logging.getLogger("materializer_svc")
SERVICE_NAME = materializer_pb2.DESCRIPTOR.services_by_name["MaterializerService"].full_name
# After the drain (or its grace period), how long the server's last RPCs may take.
_STOP_GRACE_S = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--listen",
        default=os.environ.get(
            "OMNI_MATERIALIZER_LISTEN", "unix:///tmp/omni-serving/materializer.sock"
        ),
    )
    p.add_argument(
        "--impl",
        default=os.environ.get("OMNI_MATERIALIZER_IMPL", "reference"),
        help="implementation from the registry (see --list)",
    )
    p.add_argument(
        "--deployment",
        default=os.environ.get("OMNI_DEPLOYMENT", "default"),
        help="deployment name; only segments omni-<deployment>-* are read",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=int(os.environ.get("OMNI_MATERIALIZER_WORKERS", "2")),
        help="worker processes (implementations that use a pool)",
    )
    p.add_argument(
        "--pipeline-depth",
        type=int,
        default=int(os.environ.get("OMNI_MATERIALIZER_PIPELINE_DEPTH", "0")),
        help="steps in flight per stream (pool); 0 = 2 x workers",
    )
    p.add_argument(
        "--start-method",
        choices=("forkserver", "spawn"),
        default=os.environ.get("OMNI_MATERIALIZER_START_METHOD", "forkserver"),
        help="how pool workers are started",
    )
    p.add_argument(
        "--readiness-timeout-ms",
        type=int,
        default=int(os.environ.get("OMNI_MATERIALIZER_READINESS_TIMEOUT_MS", "5000")),
        help="readiness wait for streams whose open message does not set one",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("OMNI_MATERIALIZER_METRICS_PORT", "-1")),
        help="serve Prometheus /metrics on this port (0 = any free port, -1 = off)",
    )
    p.add_argument("--metrics-host", default=os.environ.get("OMNI_METRICS_HOST", "127.0.0.1"))
    p.add_argument(
        "--drain-grace-s",
        type=float,
        default=float(
            os.environ.get("OMNI_MATERIALIZER_DRAIN_GRACE_S", str(DEFAULT_DRAIN_GRACE_S))
        ),
        help="on SIGTERM/SIGINT, how long open streams are still answered (StreamDraining.grace_ms)",
    )
    p.add_argument(
        "--take-over",
        action="store_true",
        default=os.environ.get("OMNI_MATERIALIZER_TAKE_OVER", "") not in ("", "0"),
        help="Unix socket only: start even if a materializer listens on the path; new "
        "connections come here (send the old one SIGTERM: it drains)",
    )
    p.add_argument("--list", action="store_true", help="list implementations and exit")
    p.add_argument("--log-level", default=os.environ.get("OMNI_LOG_LEVEL", "INFO"))


def _bind_path(path: str) -> str:
    """A temporary socket name next to `path` (the rename target)."""
    tmp = os.path.join(os.path.dirname(path), f".m{os.getpid()}.sock")
    return tmp if len(os.fsencode(tmp)) <= 107 else f"{path}.{os.getpid()}"


def _check_socket_path(path: str, take_over: bool) -> None:
    """Refuse to replace what is not ours to replace: a file that is not a
    socket, or (without `take_over`) a socket a live process listens on."""
    if take_over:
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise FailedPreconditionError(
                    f"{path}: exists and is not a socket; not replacing it"
                )
        return
    _prepare_uds(path)  # removes a stale socket, refuses a live one


async def serve(
    config: ServerConfig,
    register: Callable[[grpc.aio.Server], None],
    servicer: object,
    *,
    take_over: bool = False,
    drain_grace_s: float = DEFAULT_DRAIN_GRACE_S,
    on_shutdown: Callable[[], None] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then drain (see the module docstring)."""
    uds_path = _parse_address(config.address).uds_path
    identity: tuple[int, int] | None = None
    bind_config = config
    if uds_path is not None:
        _check_socket_path(uds_path, take_over)
        bind_config = ServerConfig(
            address=f"unix://{_bind_path(uds_path)}",
            service_name=config.service_name,
            reflection_service_names=config.reflection_service_names,
            grace_s=config.grace_s,
        )
    server, bound, health = await build_server(bind_config, register)
    try:
        if uds_path is not None:
            tmp = bound[len("unix://") :]
            st = os.lstat(tmp)
            os.rename(tmp, uds_path)  # atomic: the path always names a live socket
            identity = (st.st_dev, st.st_ino)
            logger.info("%s listening on unix://%s", config.service_name, uds_path)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        hurry = asyncio.Event()
        signals = (signal.SIGTERM, signal.SIGINT)
        got: list[str] = []

        def on_signal(signum: int) -> None:
            name = signal.Signals(signum).name
            if stop.is_set():
                logger.info("%s: got %s again, stopping now", config.service_name, name)
                hurry.set()
                return
            got.append(name)
            logger.info("%s: got %s, draining", config.service_name, name)
            stop.set()

        for sig in signals:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            await stop.wait()
            # 1) no new work: health NOT_SERVING (GetMaterializerInfo says draining)
            await health.enter_graceful_shutdown()
            begin = getattr(servicer, "begin_drain", None)
            drained = getattr(servicer, "drained", None)
            if begin is not None and drained is not None:
                # 2) tell the open streams, keep answering them until they end
                begin(got[0] if got else "stop", drain_grace_s)
                wait = asyncio.ensure_future(drained(drain_grace_s + _STOP_GRACE_S))
                hurried = asyncio.ensure_future(hurry.wait())
                await asyncio.wait({wait, hurried}, return_when=asyncio.FIRST_COMPLETED)
                for t in (wait, hurried):
                    t.cancel()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
        # 3) end what is left, then release the servicer's resources
        await server.stop(0 if hurry.is_set() else _STOP_GRACE_S)
        if on_shutdown is not None:
            on_shutdown()
    finally:
        if uds_path is not None and identity is not None:
            # 4) remove the socket file only if it is still ours (a
            # replacement may have taken the path over meanwhile)
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(uds_path)
                if (st.st_dev, st.st_ino) == identity:
                    os.unlink(uds_path)
        logger.info("%s stopped", config.service_name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="materializer_svc", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(registry.names()))
        return
    setup_logging(args.log_level, service="materializer")
    start_metrics_server(args.metrics_port, args.metrics_host)
    config = registry.MaterializerConfig(
        shm_prefix=f"omni-{args.deployment}",
        workers=args.workers,
        readiness_timeout_ms=args.readiness_timeout_ms,
        pipeline_depth=args.pipeline_depth,
        start_method=args.start_method,
    )
    servicer = registry.create(args.impl, config)
    if hasattr(servicer, "drain_grace_s"):
        servicer.drain_grace_s = args.drain_grace_s
    metrics.attach(servicer)

    def register(server: grpc.aio.Server) -> None:
        materializer_pb2_grpc.add_MaterializerServiceServicer_to_server(servicer, server)

    def close() -> None:
        closer = getattr(servicer, "close", None)
        if closer is not None:
            closer()  # idempotent: terminates pool workers, drops mappings

    try:
        asyncio.run(
            serve(
                ServerConfig(
                    address=args.listen,
                    service_name=SERVICE_NAME,
                    reflection_service_names=[SERVICE_NAME],
                ),
                register,
                servicer,
                take_over=args.take_over,
                drain_grace_s=args.drain_grace_s,
                on_shutdown=close,
            )
        )
    finally:
        close()  # also when the server never started (bind failure)
