"""The services' command lines and environment: what `up` runs, and how.

- `service_commands` is the single description of what each service runs,
  in start order (per replica its materializer and decoder, then the
  gateway); docker/compose.yaml and deploy/k8s run the same command lines
  (tests/test_compose.py and tests/test_k8s_manifests.py check that they
  agree).
- `service_environment`: the variables set for a service on top of the
  launcher's (compose and Kubernetes set the same).
- `ServiceProcess`: one service's command line, address and metrics URL,
  and the supervision state of its current process (omni_stack.supervision).

Invariants: a gRPC target is what a client on this host dials
(omni_common.net.dial_host); a metrics URL keeps `localhost` as a name
(omni_common.net.url_host).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from omni_common.net import dial_host, url_host
from omni_stack.config import StackConfig, replica_deployment, replica_port, replica_suffix


@dataclass
class ServiceProcess:
    """One service of the stack: its command line and addresses, and the
    supervision state of its current process."""

    name: str
    argv: list[str]
    target: str  # what a client on this host dials for grpc health
    env: dict[str, str] = field(default_factory=dict)  # set on top of the launcher's environment
    metrics_url: str = ""
    proc: subprocess.Popen | None = None
    # Supervision (Stack.poll): starting | running | backoff | failed | stopped
    state: str = "stopped"
    stop_expected: bool = False  # the launcher stopped it: its exit is not a crash
    failures: int = 0  # exits in a row, without staying up for restart_reset in between
    restarts: int = 0
    started_at: float = 0.0  # time.monotonic() of the current process's start
    healthy_at: float = 0.0  # ... and of its first healthy answer
    start_deadline: float = 0.0
    next_start: float = 0.0  # end of the backoff
    next_liveness: float = 0.0  # when the launcher next checks its liveness entry (decoders)
    not_live: int = 0  # NOT_SERVING answers of its liveness entry in a row
    answered_at: float = 0.0  # time.monotonic() of its liveness entry's last answer
    # Process groups of earlier incarnations: {pgid: time.time() when its leader
    # was seen gone}. Only processes older than that are its members: once the
    # group is empty the number may be reused by an unrelated process.
    dead_groups: dict[int, float] = field(default_factory=dict)
    role: str = ""  # materializer | decoder | gateway (default: the name)
    replica: int = 0  # which decoder + materializer pair (the gateway: 0)
    deployment: str = ""  # its --deployment (decoder, materializer)
    base_metrics_url: str = ""  # metrics_url of the command line (a rolling restart may move it)

    def __post_init__(self) -> None:
        self.role = self.role or self.name
        self.base_metrics_url = self.base_metrics_url or self.metrics_url

    @property
    def uds_path(self) -> str | None:
        """The socket file of a unix:// target."""
        return self.target[len("unix://") :] if self.target.startswith("unix://") else None


def service_environment(cfg: StackConfig, name: str) -> dict[str, str]:
    """Variables the launcher sets for service `name` (docker/compose.yaml sets the same).

    OMNI_DEPLOYMENT is read by the decoder and the materializer (the flag
    wins); on all three it also marks the processes of one deployment.
    """
    return {"PYTHONUNBUFFERED": "1", "OMNI_DEPLOYMENT": cfg.deployment}


def metrics_args(port: int, host: str) -> list[str]:
    return ["--metrics-port", str(port), "--metrics-host", host]


def metrics_url(host: str, port: int, path: str = "/metrics") -> str:
    """The URL of a /metrics server bound to host:port ("" when off or not yet picked)."""
    return f"http://{url_host(host)}:{port}{path}" if port > 0 else ""


def service_commands(
    cfg: StackConfig,
    runtime: Path | str,
    python: str | None = None,
    metrics_ports: list[tuple[int, int]] | None = None,
) -> list[ServiceProcess]:
    """The services' command lines in start order: per replica its
    materializer and decoder, then the gateway.

    One replica (the default): materializer, decoder, gateway, as
    docker/compose.yaml runs them, with `python` for sys.executable and its
    runtime directory for `runtime`. Replica i of several is named
    `decoder-r<i>` / `materializer-r<i>`, runs deployment `<deployment>-r<i>`
    on sockets `decoder-r<i>.sock` / `materializer-r<i>.sock`; the gateway
    gets one --decoder per replica. `metrics_ports`: (decoder, materializer)
    /metrics port per replica (default: the configured ones, offset by
    replica_port).
    """
    py = python or sys.executable
    if metrics_ports is None:
        metrics_ports = [
            (
                replica_port(cfg.decoder_metrics_port, i),
                replica_port(cfg.materializer_metrics_port, i),
            )
            for i in range(cfg.replicas)
        ]
    pairs: list[ServiceProcess] = []
    decoder_socks: list[str] = []
    for i in range(cfg.replicas):
        suffix = replica_suffix(cfg, i)
        deployment = replica_deployment(cfg, i)
        dec_port, mat_port = metrics_ports[i]
        dec_sock = f"unix://{runtime}/decoder{suffix}.sock"
        mat_sock = f"unix://{runtime}/materializer{suffix}.sock"
        decoder_socks.append(dec_sock)
        common = ["--deployment", deployment, "--log-level", cfg.log_level]
        materializer = ServiceProcess(
            "materializer" + suffix,
            [
                py,
                "-m",
                "materializer_svc",
                "--listen",
                mat_sock,
                "--impl",
                cfg.materializer_impl,
                *common,
                *metrics_args(mat_port, cfg.metrics_host),
            ],
            mat_sock,
            service_environment(cfg, "materializer"),
            metrics_url(cfg.metrics_host, mat_port),
            role="materializer",
            replica=i,
            deployment=deployment,
        )
        decoder_args = [
            py,
            "-m",
            "decoder_svc",
            "--listen",
            dec_sock,
            "--profile",
            cfg.profile,
            "--engine",
            cfg.engine,
            *common,
            *metrics_args(dec_port, cfg.metrics_host),
        ]
        if not cfg.sync:
            decoder_args += ["--materializer", mat_sock]
        if cfg.model:
            decoder_args += ["--model", cfg.model]
        if cfg.voice_dir:
            decoder_args += ["--voice-dir", cfg.voice_dir]
        for item in cfg.engine_set_items():
            decoder_args += ["--engine-set", item]
        decoder = ServiceProcess(
            "decoder" + suffix,
            decoder_args + list(cfg.extra_decoder_args),
            dec_sock,
            service_environment(cfg, "decoder"),
            metrics_url(cfg.metrics_host, dec_port),
            role="decoder",
            replica=i,
            deployment=deployment,
        )
        pairs += ([] if cfg.sync else [materializer]) + [decoder]
    gateway_args = [py, "-m", "gateway", "--listen", f"{cfg.host}:{cfg.port}"]
    for sock in decoder_socks:
        gateway_args += ["--decoder", sock]
    gateway_args += ["--http-port", str(cfg.http_port), "--log-level", cfg.log_level]
    for flag, value in (
        ("--tls-cert", cfg.tls_cert),
        ("--tls-key", cfg.tls_key),
        ("--auth-token-file", cfg.auth_token_file),
        ("--allowed-origins", cfg.allowed_origins),
    ):
        if value:
            gateway_args += [flag, value]
    if cfg.max_text_chars:
        gateway_args += ["--max-text-chars", str(cfg.max_text_chars)]
    gateway = ServiceProcess(
        "gateway",
        gateway_args,
        f"{dial_host(cfg.host)}:{cfg.port}",
        service_environment(cfg, "gateway"),
        metrics_url(cfg.host, cfg.http_port),
        deployment=cfg.deployment,
    )
    return pairs + [gateway]
