"""`omni-serving up`: start materializer, decoder and gateway as processes.

- Sockets live in a private runtime directory (mode 0700).
- Each service runs in its own session (process group), so a terminal's
  Ctrl-C reaches only the launcher, and everything a service started (vLLM
  workers, pool workers, their children) can be found and stopped with it.
- Before starting, what dead stacks left on this host is swept, whatever
  their deployment name: arenas whose owner is gone (omni_common.shm_arena)
  and runtime directories whose launcher and services are gone (each holds a
  locked `owner` record).
- The launcher waits for each service's grpc health (generously: the vLLM
  engine creates its tiny models on first run), prints the endpoints, then
  supervises: a service that exits on its own is restarted with a doubling
  delay, and one that keeps failing stops the stack (`Stack.supervise`).
- On Ctrl-C/SIGTERM it stops the three in reverse order (gateway first)
  within one stop timeout, stops whatever they left behind, and checks that
  no shared-memory segment of the deployment is left. A killed launcher
  takes its services with it (parent-death signal).
- `service_commands` is the single description of what each service runs;
  docker/compose.yaml runs the same command lines (tests/test_compose.py
  checks that they agree).

Configuration: `StackConfig`; on the command line through `add_up_arguments`
/ `config_from_args`, where a `--config FILE` (TOML or YAML, same keys as
the long options) sits between the defaults and the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import fcntl
import itertools
import json
import os
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from omni_common.errors import UnavailableError
from omni_common.server import wait_for_health_sync

ENGINES = ("vllm", "fake", "reference")  # "reference": deprecated name of "fake"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# sun_path holds 108 bytes including the terminating NUL.
_MAX_UDS_PATH_BYTES = 107
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})
_STACKS = itertools.count(1)


class StackError(RuntimeError):
    """The stack could not be configured, started or stopped cleanly."""


class ConfigError(StackError):
    """A bad option value or config file; the message names the key."""


class StartAborted(StackError):
    """Stop was requested (Ctrl-C, SIGTERM) while the stack was starting."""


@dataclass
class StackConfig:
    """What `omni-serving up` runs. Ports set to 0 are picked free at start."""

    profile: str = "tts"
    engine: str = "vllm"
    materializer_impl: str = "reference"
    model: str = ""  # Qwen3-Omni checkpoint directory; empty = the decoder's default
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 8000
    metrics_host: str = "127.0.0.1"
    decoder_metrics_port: int = 0  # -1 = off; the CLI defaults to 9101
    materializer_metrics_port: int = 0  # -1 = off; the CLI defaults to 9102
    deployment: str = ""
    runtime_dir: str = ""
    sync: bool = False  # no materializer: payloads built in-process
    log_level: str = "INFO"
    startup_timeout: float = 300.0  # per service; vLLM's first run creates its models
    stop_timeout: float = 30.0  # the whole stack, then SIGKILL
    # Supervision: a service that exits on its own is restarted after a delay
    # that doubles from restart_backoff up to restart_backoff_max; one that
    # fails more than max_restarts times in a row (without staying up for
    # restart_reset seconds in between) stops the stack. 0 = no restarts.
    max_restarts: int = 5
    restart_backoff: float = 0.5
    restart_backoff_max: float = 10.0
    restart_reset: float = 30.0
    # Passed to the gateway as they are (empty = not passed).
    tls_cert: str = ""
    tls_key: str = ""
    auth_token_file: str = ""
    extra_decoder_args: list[str] = field(default_factory=list)
    # Decoder + materializer pairs behind the one gateway (see replica_layout).
    replicas: int = 1
    # Rolling restart: seconds a replaced materializer may take to exit after
    # its SIGTERM before it is killed.
    drain_timeout: float = 30.0

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine: {self.engine!r} is not one of {', '.join(ENGINES)}")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(
                f"log_level: {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}"
            )
        for key in ("port", "http_port"):
            value = getattr(self, key)
            if not 0 <= value <= 65535:
                raise ConfigError(f"{key}: {value} is not a port (0 = any free port)")
        for key in ("decoder_metrics_port", "materializer_metrics_port"):
            value = getattr(self, key)
            if not -1 <= value <= 65535:
                raise ConfigError(f"{key}: {value} is not a port (0 = any free port, -1 = off)")
        if self.replicas < 1:
            raise ConfigError(
                f"replicas: must be >= 1 (decoder + materializer pairs), got {self.replicas}"
            )
        for key in (
            "startup_timeout",
            "stop_timeout",
            "restart_backoff",
            "restart_reset",
            "drain_timeout",
        ):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}: must be > 0 seconds, got {getattr(self, key)}")
        if self.restart_backoff_max < self.restart_backoff:
            raise ConfigError(
                f"restart_backoff_max: {self.restart_backoff_max} is below "
                f"restart_backoff ({self.restart_backoff})"
            )
        if self.max_restarts < 0:
            raise ConfigError(
                f"max_restarts: must be >= 0 (0 = no restarts), got {self.max_restarts}"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key: give both or neither")
        for key in ("profile", "materializer_impl", "host", "metrics_host"):
            if not getattr(self, key):
                raise ConfigError(f"{key}: must not be empty")
        if self.replicas > 1:
            self._check_replica_ports()

    def _check_replica_ports(self) -> None:
        """With several replicas the fixed metrics ports are offset per replica:
        none may leave the port range or land on another fixed port."""
        used: dict[int, str] = {}
        for key in ("port", "http_port"):
            if getattr(self, key) > 0:
                used.setdefault(getattr(self, key), key)
        keys = ["decoder_metrics_port"] + ([] if self.sync else ["materializer_metrics_port"])
        for i in range(self.replicas):
            for key in keys:
                port = replica_port(getattr(self, key), i)
                if port <= 0:
                    continue
                what = f"{key} of replica {i} ({getattr(self, key)} + {REPLICA_PORT_STRIDE} x {i})"
                if port > 65535:
                    raise ConfigError(f"replicas: {what} = {port} is not a port; lower {key}")
                if port in used:
                    raise ConfigError(
                        f"replicas: {what} = {port} is also the port of {used[port]}; "
                        f"choose {key} so the replicas' ports do not collide"
                    )
                used[port] = what


# Replica i (of several) serves /metrics on the configured port + i x this.
REPLICA_PORT_STRIDE = 100


def replica_port(port: int, replica: int) -> int:
    """The metrics port of replica `replica`: 0 (any free port) and -1 (off) stay."""
    return port if port <= 0 else port + REPLICA_PORT_STRIDE * replica


def replica_suffix(cfg: StackConfig, replica: int) -> str:
    """The name suffix of replica `replica`: none with one replica, else "-r<i>"."""
    return "" if cfg.replicas == 1 else f"-r{replica}"


def replica_deployment(cfg: StackConfig, replica: int) -> str:
    """The deployment name of replica `replica`'s decoder and materializer
    (their arena is /dev/shm/omni-<this>-arena-*)."""
    return cfg.deployment + replica_suffix(cfg, replica)


# -- command-line options and config file -------------------------------------


@dataclass(frozen=True)
class UpOption:
    """One option of `omni-serving up`: flag --<key with dashes>, config key <key>."""

    key: str
    type: type
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None  # default: the key's last word, upper case

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


UP_OPTIONS: tuple[UpOption, ...] = (
    UpOption("profile", str, "deploy profile: tts, omni or a profile YAML path"),
    UpOption(
        "engine",
        str,
        "AR engine: vllm (a tiny checkpoint created on first run unless --model) "
        "or fake (a deterministic test double, not a model; starts in a second)",
        ENGINES,
    ),
    UpOption(
        "materializer_impl", str, "materializer implementation (python -m materializer_svc --list)"
    ),
    UpOption(
        "model",
        str,
        "Qwen3-Omni checkpoint directory, only read (vllm engine); "
        "empty = the tiny checkpoint in the decoder's model cache",
        metavar="DIR",
    ),
    UpOption("host", str, "gateway bind address (gRPC and HTTP)"),
    UpOption("port", int, "gateway gRPC port (0 = any free port)"),
    UpOption(
        "http_port",
        int,
        "gateway HTTP port: OpenAI-compatible speech and /metrics (0 = any free port)",
    ),
    UpOption("metrics_host", str, "bind address of the decoder's and materializer's /metrics"),
    UpOption("decoder_metrics_port", int, "decoder /metrics port (0 = any free port, -1 = off)"),
    UpOption(
        "materializer_metrics_port", int, "materializer /metrics port (0 = any free port, -1 = off)"
    ),
    UpOption(
        "deployment",
        str,
        "deployment name; shared memory is /dev/shm/omni-<deployment>-* "
        "(empty = unique per launch)",
    ),
    UpOption("runtime_dir", str, "socket directory, made private (0700) (empty = a new temp dir)"),
    UpOption("sync", bool, "no materializer: build payloads in the decode step"),
    UpOption(
        "replicas",
        int,
        "decoder + materializer pairs behind the one gateway; each has its own "
        f"deployment name (<deployment>-r<i>), sockets and metrics ports "
        f"(+{REPLICA_PORT_STRIDE} per replica)",
        metavar="N",
    ),
    UpOption("log_level", str, f"log level of the three services: {', '.join(LOG_LEVELS)}"),
    UpOption("startup_timeout", float, "seconds each service may take to become healthy"),
    UpOption(
        "stop_timeout",
        float,
        "seconds the stack may take to stop (gateway, decoder, "
        "materializer in turn) before what is left is killed",
    ),
    UpOption(
        "max_restarts",
        int,
        "restarts in a row of a service that keeps failing before `up` "
        "gives up and stops (0 = a crash stops the stack)",
        metavar="N",
    ),
    UpOption(
        "restart_backoff",
        float,
        "seconds before the first restart of a crashed service; doubles with each failure in a row",
        metavar="S",
    ),
    UpOption("restart_backoff_max", float, "longest delay before a restart", metavar="S"),
    UpOption(
        "restart_reset",
        float,
        "seconds a restarted service must stay up for its failures to be forgotten",
        metavar="S",
    ),
    UpOption(
        "drain_timeout",
        float,
        "rolling restart (SIGHUP, `omni-serving restart materializer`): seconds a replaced "
        "materializer may take to exit after its SIGTERM before it is killed",
        metavar="S",
    ),
    UpOption(
        "tls_cert",
        str,
        "gateway: TLS certificate (PEM), passed as --tls-cert; with --tls-key",
        metavar="FILE",
    ),
    UpOption("tls_key", str, "gateway: TLS private key (PEM), passed as --tls-key", metavar="FILE"),
    UpOption(
        "auth_token_file",
        str,
        "gateway: file holding the bearer token clients must send, passed as --auth-token-file",
        metavar="FILE",
    ),
)
_OPTIONS_BY_KEY = {opt.key: opt for opt in UP_OPTIONS}

# Old option names still accepted (command line and config file), with a warning.
DEPRECATED_KEYS: dict[str, str] = {"model_dir": "model"}

# Where the command line's defaults differ from StackConfig's (whose 0 picks a
# free port, which suits tests and embedding).
CLI_DEFAULTS: dict[str, Any] = {"decoder_metrics_port": 9101, "materializer_metrics_port": 9102}


def default_value(key: str) -> Any:
    if key in CLI_DEFAULTS:
        return CLI_DEFAULTS[key]
    return StackConfig.__dataclass_fields__[key].default


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    """The `up` options. Defaults are applied by config_from_args, so an option
    given on the command line can be told apart from one left out."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="TOML (.toml) or YAML (.yaml/.yml) file with the same keys as these options "
        "(materializer-impl or materializer_impl, ...); command-line options win",
    )
    for opt in UP_OPTIONS:
        default = default_value(opt.key)
        help_text = f"{opt.help} (default: {default!r})"
        if opt.type is bool:
            parser.add_argument(
                opt.flag,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            parser.add_argument(
                opt.flag,
                type=opt.type,
                choices=opt.choices,
                default=argparse.SUPPRESS,
                metavar=None
                if opt.choices
                else (opt.metavar or opt.key.upper().rsplit("_", 1)[-1]),
                help=help_text,
            )
    for old, new in DEPRECATED_KEYS.items():  # hidden from --help
        parser.add_argument(
            "--" + old.replace("_", "-"),
            dest=f"deprecated_{old}",
            type=_OPTIONS_BY_KEY[new].type,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )


def _deprecated(old: str, source: str | None = None) -> None:
    """Warn about a deprecated option: on the command line (source None) or in a config file."""
    new = DEPRECATED_KEYS[old]
    if source is None:
        what = f"--{old.replace('_', '-')} is deprecated; use --{new.replace('_', '-')}"
    else:
        what = (
            f"{source}: key {old.replace('_', '-')!r} is deprecated; use {new.replace('_', '-')!r}"
        )
    print(f"omni-serving up: warning: {what}", file=sys.stderr)


def _coerce(key: str, value: Any, source: str) -> Any:
    opt = _OPTIONS_BY_KEY[key]
    if opt.type is bool:
        ok = isinstance(value, bool)
    elif opt.type is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif opt.type is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
    if not ok:
        raise ConfigError(f"{source}: key {key!r} must be a {opt.type.__name__}, got {value!r}")
    if opt.choices and value not in opt.choices:
        raise ConfigError(
            f"{source}: key {key!r} must be one of {', '.join(opt.choices)}, got {value!r}"
        )
    return value


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a flat TOML or YAML mapping of up options; keys are normalized to
    StackConfig names (dashes become underscores). Unknown keys are errors."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from exc
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            raise ConfigError(
                f"config file {path}: unknown format {suffix!r}; use .toml, .yaml or .yml"
            )
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path}: not valid {suffix[1:].upper()}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path}: expected a mapping of options, got {type(data).__name__}"
        )
    values: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key in DEPRECATED_KEYS:
            _deprecated(key, f"config file {path}")
            key = DEPRECATED_KEYS[key]
            if key in data or key.replace("_", "-") in data:  # the new name wins
                continue
        if key not in _OPTIONS_BY_KEY:
            known = ", ".join(opt.key.replace("_", "-") for opt in UP_OPTIONS)
            raise ConfigError(f"config file {path}: unknown key {raw_key!r} (known keys: {known})")
        values[key] = _coerce(key, value, f"config file {path}")
    return values


def config_from_args(args: argparse.Namespace) -> StackConfig:
    """Defaults, then the --config file, then the options given on the command line."""
    values = {opt.key: default_value(opt.key) for opt in UP_OPTIONS}
    if getattr(args, "config", None):
        values.update(load_config_file(args.config))
    given = vars(args)
    for old, new in DEPRECATED_KEYS.items():
        if f"deprecated_{old}" in given:
            _deprecated(old)
            if new not in given:  # the new option wins
                values[new] = given[f"deprecated_{old}"]
    values.update({opt.key: given[opt.key] for opt in UP_OPTIONS if opt.key in given})
    cfg = StackConfig(**values)
    cfg.log_level = cfg.log_level.upper()
    cfg.validate()
    return cfg


# -- command lines ---------------------------------------------------------------


@dataclass
class ServiceProcess:
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


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (for `--port 0`): the OS picks, we release it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host.strip("[]"), 0))
        return int(sock.getsockname()[1])


def dial_host(host: str) -> str:
    """Where a client on this host reaches a server bound to `host`."""
    return "127.0.0.1" if host in _WILDCARD_HOSTS else host


def service_environment(cfg: StackConfig, name: str) -> dict[str, str]:
    """Variables the launcher sets for service `name` (docker/compose.yaml sets the same).

    OMNI_DEPLOYMENT is read by the decoder and the materializer (the flag
    wins); on all three it also marks the processes of one deployment.
    """
    return {"PYTHONUNBUFFERED": "1", "OMNI_DEPLOYMENT": cfg.deployment}


def _metrics_args(port: int, host: str) -> list[str]:
    return ["--metrics-port", str(port), "--metrics-host", host]


def _metrics_url(host: str, port: int, path: str = "/metrics") -> str:
    return f"http://{dial_host(host)}:{port}{path}" if port > 0 else ""


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
                *_metrics_args(mat_port, cfg.metrics_host),
            ],
            mat_sock,
            service_environment(cfg, "materializer"),
            _metrics_url(cfg.metrics_host, mat_port),
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
            *_metrics_args(dec_port, cfg.metrics_host),
        ]
        if not cfg.sync:
            decoder_args += ["--materializer", mat_sock]
        if cfg.model:
            decoder_args += ["--model", cfg.model]
        decoder = ServiceProcess(
            "decoder" + suffix,
            decoder_args + list(cfg.extra_decoder_args),
            dec_sock,
            service_environment(cfg, "decoder"),
            _metrics_url(cfg.metrics_host, dec_port),
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
    ):
        if value:
            gateway_args += [flag, value]
    gateway = ServiceProcess(
        "gateway",
        gateway_args,
        f"{dial_host(cfg.host)}:{cfg.port}",
        service_environment(cfg, "gateway"),
        _metrics_url(cfg.host, cfg.http_port),
        deployment=cfg.deployment,
    )
    return pairs + [gateway]


# -- processes ------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _load_libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()


def become_subreaper() -> bool:
    """Linux: orphaned descendants are re-parented to us instead of init, so
    nothing a service started can slip away unseen. Best effort."""
    try:
        return _LIBC is not None and _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except AttributeError:
        return False


def _die_with_launcher(launcher_pid: int) -> Callable[[], None] | None:
    """A `preexec_fn` (Linux): the service gets SIGTERM when the launcher dies,
    SIGKILL included, so a killed launcher leaves no stack running on its own.

    The kernel sends it when the *thread* that started the service ends: a
    Stack is driven from one long-lived thread (run_up: the main thread).
    """
    prctl = getattr(_LIBC, "prctl", None)
    if prctl is None:
        return None
    sigterm = int(signal.SIGTERM)

    def preexec() -> None:  # runs in the child between fork and exec: keep it minimal
        prctl(_PR_SET_PDEATHSIG, sigterm, 0, 0, 0)
        if os.getppid() != launcher_pid:  # the launcher died before prctl
            os.kill(os.getpid(), sigterm)

    return preexec


def describe_exit(code: int) -> str:
    """`exited with code 3`, `was killed by SIGKILL`."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def list_segments(prefix: str) -> list[str]:
    from omni_common import shm_arena  # imports torch: only when a stack runs

    return shm_arena.list_segments(prefix)


def sweep_stale(prefix: str, creating_grace_s: float | None = None) -> list[str]:
    from omni_common import shm_arena

    return shm_arena.sweep_stale(prefix, creating_grace_s)


def sweep_orphaned_segments() -> list[str]:
    """Arena segments of any deployment on this host whose owner is gone."""
    from omni_common import shm_arena

    return shm_arena.sweep_orphans()


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until the processes have exited (zombies count as gone); return the rest."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if _alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _alive(p)]
    return alive


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _members(groups: dict[int, float | None]) -> list[psutil.Process]:
    """Live processes in the given process groups. A group given with a time
    (its leader gone then) counts only processes that started before it."""
    members = []
    for p in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            pgid = os.getpgid(p.pid)
            if pgid not in groups or not _alive(p):
                continue
            gone = groups[pgid]
            if gone is None or p.create_time() <= gone:
                members.append(p)
    return members


def _tls_answers(host: str, port: int, timeout_s: float) -> str | None:
    """None when a TLS handshake with host:port succeeds, else what went wrong.

    The gateway's readiness check when it serves TLS: its certificate need not
    name this host, and its health service may want the token.
    """
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        with (
            socket.create_connection((host.strip("[]"), port), timeout_s) as raw,
            ctx.wrap_socket(raw, server_hostname=host.strip("[]")),
        ):
            return None
    except (OSError, ssl.SSLError) as exc:
        return f"no TLS handshake: {exc}"


# -- runtime directories -------------------------------------------------------------------

RUNTIME_DIR_PREFIX = "omni-serving-"
OWNER_FILE = "owner"  # in a runtime directory: who uses it; locked while they live
_OWNER_GRACE_S = 60.0  # an owner file without a record this old is debris


def runtime_parents() -> list[Path]:
    """Where `up` creates its runtime directories, first choice first (and sweeps them)."""
    parents = []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        parents.append(Path(xdg))
    tmp = Path(tempfile.gettempdir())
    if tmp not in parents:
        parents.append(tmp)
    return parents


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise ConfigError(
            f"runtime_dir: {path} belongs to uid {st.st_uid}, not to us ({os.getuid()})"
        )
    os.chmod(path, 0o700)


def _new_runtime_dir() -> Path:
    # mkdtemp: mode 0700
    return Path(tempfile.mkdtemp(prefix=RUNTIME_DIR_PREFIX, dir=runtime_parents()[0]))


def _read_record(fd: int) -> dict[str, Any] | None:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"null")
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else None


class RuntimeDirLock:
    """A launcher's claim on its runtime directory.

    `owner` in the directory records the launcher (pid, process start time,
    deployment, whether it created the directory) and is flock-ed for as long
    as the launcher *or any service it started* lives: the services inherit
    the locked descriptor. The kernel drops the lock when the last of them
    exits, however it exits, so a later `up` can tell a live directory from
    one left by a killed launcher (sweep_runtime_dirs).
    """

    def __init__(self, directory: Path, *, created: bool, deployment: str) -> None:
        self.path = directory / OWNER_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            deadline = time.monotonic() + 1.0  # a sweeper holds it for a moment at most
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        other = _read_record(fd) or {}
                        raise ConfigError(
                            f"runtime_dir: {directory} is in use by another `omni-serving up` "
                            f"(pid {other.get('pid', '?')}, "
                            f"deployment {other.get('deployment', '?')})"
                        ) from None
                    time.sleep(0.05)
            me = psutil.Process()
            record = {
                "pid": me.pid,
                "start_time": me.create_time(),
                "deployment": deployment,
                "created": created,
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def release(self, *, unlink: bool) -> None:
        if self.fd < 0:
            return
        if unlink:
            self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = -1


def _stale_runtime_dir(directory: Path) -> str | None:
    """Why `directory` (an `up` runtime directory) is debris, or None to leave it."""
    try:
        fd = os.open(directory / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # no record: an older launcher's, or one being set up now
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # its launcher or one of its services is alive
        record = _read_record(fd)
        if record is None:
            age = time.time() - os.fstat(fd).st_mtime
            return "unreadable owner record" if age > _OWNER_GRACE_S else None
        if not record.get("created"):
            return None  # a directory the user named: never removed
        return f"launcher pid {record['pid']} and its services are gone"
    finally:
        os.close(fd)


def sweep_runtime_dirs() -> list[str]:
    """Remove runtime directories (ours, `omni-serving-*` in runtime_parents())
    whose launcher and services are gone; return their paths."""
    removed = []
    for parent in runtime_parents():
        for directory in sorted(parent.glob(RUNTIME_DIR_PREFIX + "*")):
            try:
                st = os.lstat(directory)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            if _stale_runtime_dir(directory) is not None:
                shutil.rmtree(directory, ignore_errors=True)
                if not directory.exists():
                    removed.append(str(directory))
    return removed


# -- rolling restarts ----------------------------------------------------------------------

ROLLING_STATUS_FILE = "rolling-restart.json"  # in the runtime dir: the last rolling restart


@dataclass
class _Handover:
    """One materializer of a rolling restart: its replacement starting on the
    same socket path (phase "starting"), then the old one stopping ("draining").

    The replacement runs with --take-over: it binds a fresh socket and renames
    it over the path, so new connections reach it while the old process keeps
    the connections it accepted; at exit the old one removes the path only if
    it is still its own socket (materializer_svc/server.py).
    """

    svc: ServiceProcess
    old: subprocess.Popen
    new: subprocess.Popen
    started: float  # time.monotonic() of the replacement's start
    deadline: float  # of the current phase
    old_socket: tuple[int, int] | None  # (st_dev, st_ino) of the path before the replacement
    metrics_url: str
    argv: list[str]  # the replacement's command line without --take-over (its metrics port)
    phase: str = "starting"
    sigterm_at: float = 0.0
    killed: bool = False


def _socket_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError:
            return False
    return True


def _with_metrics_port(argv: list[str], port: int) -> list[str]:
    out = list(argv)
    i = out.index("--metrics-port")
    out[i + 1] = str(port)
    return out


# -- the stack -----------------------------------------------------------------------------


class Stack:
    """A running stack; use as a context manager or call start()/stop().

    After start(), supervise() (or poll() in a loop of the caller's own)
    restarts services that exit on their own; see StackConfig for the policy.
    Drive a Stack from one long-lived thread (see _die_with_launcher).
    """

    def __init__(
        self, cfg: StackConfig, *, subreaper: bool = False, log: Callable[[str], None] | None = None
    ) -> None:
        cfg = dataclasses.replace(cfg, extra_decoder_args=list(cfg.extra_decoder_args))
        cfg.validate()
        if not cfg.deployment:  # unique per stack: up<pid>, up<pid>-2, ...
            n = next(_STACKS)
            cfg.deployment = f"up{os.getpid()}" + (f"-{n}" if n > 1 else "")
        if cfg.port == 0:
            cfg.port = free_port(dial_host(cfg.host))
        if cfg.http_port == 0:
            cfg.http_port = free_port(dial_host(cfg.host))
        # (decoder, materializer) /metrics port of each replica; 0 picked free now
        metrics_ports = []
        for i in range(cfg.replicas):
            dec = replica_port(cfg.decoder_metrics_port, i)
            mat = replica_port(cfg.materializer_metrics_port, i)
            if dec == 0:
                dec = free_port(dial_host(cfg.metrics_host))
            if mat == 0 and not cfg.sync:
                mat = free_port(dial_host(cfg.metrics_host))
            metrics_ports.append((dec, mat))
        cfg.decoder_metrics_port, cfg.materializer_metrics_port = metrics_ports[0]
        self.cfg = cfg
        self.subreaper = subreaper
        self._log = log or _log_stderr
        self._lock: RuntimeDirLock | None = None
        self._own_runtime = not cfg.runtime_dir
        if cfg.runtime_dir:
            self.runtime = Path(cfg.runtime_dir).absolute()
            _private_dir(self.runtime)
        else:
            self.runtime = _new_runtime_dir()
        longest = max(
            len(os.fsencode(str(self.runtime / f"{role}{replica_suffix(cfg, i)}.sock")))
            for role in ("decoder", "materializer")
            for i in range(cfg.replicas)
        )
        if longest > _MAX_UDS_PATH_BYTES:
            self._remove_runtime()
            raise ConfigError(
                f"runtime_dir: {self.runtime} is too long for a Unix socket path "
                f"({longest} > {_MAX_UDS_PATH_BYTES} bytes)"
            )
        try:
            self._lock = RuntimeDirLock(
                self.runtime, created=self._own_runtime, deployment=cfg.deployment
            )
        except BaseException:
            if self._own_runtime:
                self._remove_runtime()
            raise
        self.services = service_commands(cfg, self.runtime, metrics_ports=metrics_ports)
        self.killed: list[str] = []  # processes that had to be stopped after their service exited
        self.swept: list[str] = []  # stale segments and runtime directories removed at start
        self._stopped = False
        # Rolling restarts (request_rolling_restart): at most one runs, one more may wait.
        self._roll_requested = False
        self._roll: dict[str, Any] | None = None  # the run in progress (its status record)
        self._roll_queue: list[ServiceProcess] = []
        self._handover: _Handover | None = None
        self._roll_count = 0
        self.last_rolling_restart: dict[str, Any] | None = None  # the last finished run

    # -- addresses
    @property
    def shm_prefix(self) -> str:
        """The arena prefix of the stack's one replica (replica 0 of several)."""
        return self.shm_prefixes[0]

    @property
    def shm_prefixes(self) -> list[str]:
        """The arena prefix of each replica: omni-<its deployment>."""
        return [f"omni-{replica_deployment(self.cfg, i)}" for i in range(self.cfg.replicas)]

    def segments(self) -> list[str]:
        """The arena segments of every replica present on this host."""
        return sorted(name for prefix in self.shm_prefixes for name in list_segments(prefix))

    def service(self, name: str) -> ServiceProcess | None:
        return next((s for s in self.services if s.name == name), None)

    def services_of(self, role: str) -> list[ServiceProcess]:
        """Every replica's service of `role` (materializer, decoder, gateway), in replica order."""
        return [s for s in self.services if s.role == role]

    @property
    def gateway_target(self) -> str:
        return self.services[-1].target

    @property
    def decoder_target(self) -> str:
        """The (first replica's) decoder."""
        return self.decoder_targets[0]

    @property
    def decoder_targets(self) -> list[str]:
        return [s.target for s in self.services_of("decoder")]

    @property
    def materializer_target(self) -> str | None:
        svc = self.service("materializer")
        return svc.target if svc else None

    @property
    def http_url(self) -> str:
        return f"http://{dial_host(self.cfg.host)}:{self.cfg.http_port}"

    def endpoints(self) -> list[tuple[str, str]]:
        """(label, address) of everything a user reaches, for printing."""
        rows = [
            ("gateway gRPC", self.gateway_target),
            ("gateway HTTP", f"{self.http_url}/v1/audio/speech"),
        ]
        rows += [
            (f"{s.name} metrics", s.metrics_url) for s in reversed(self.services) if s.metrics_url
        ]
        rows += [(s.name, s.target) for s in self.services if s.role != "gateway"]
        rows.append(("runtime dir", str(self.runtime)))
        return rows

    # -- lifecycle
    def start(self, timeout_s: float | None = None, abort: threading.Event | None = None) -> None:
        """Sweep what dead stacks left, then start the services in order, each
        once the previous one is healthy.

        Raises StackError when one exits or stays unhealthy past timeout_s
        (default cfg.startup_timeout), StartAborted when `abort` is set;
        either way everything started so far is stopped first.
        """
        timeout = self.cfg.startup_timeout if timeout_s is None else timeout_s
        segments = sweep_orphaned_segments()
        dirs = sweep_runtime_dirs()
        self.swept = segments + dirs
        if segments:
            self._log(
                f"removed {len(segments)} shared-memory segment(s) of dead processes: "
                f"{', '.join(segments)}"
            )
        if dirs:
            self._log(f"removed {len(dirs)} runtime dir(s) of dead launchers: {', '.join(dirs)}")
        tmp = self.runtime / "tmp"  # the services' temp files go away with the stack
        tmp.mkdir(mode=0o700, exist_ok=True)
        try:
            for svc in self.services:
                self._spawn(svc)
                self._wait_healthy(svc, timeout, abort)
                svc.state = "running"
                svc.healthy_at = time.monotonic()
        except BaseException:
            self.stop()
            raise

    def _popen(self, svc: ServiceProcess, argv: list[str]) -> subprocess.Popen:
        env = {**os.environ, **svc.env, "TMPDIR": str(self.runtime / "tmp")}
        return subprocess.Popen(
            argv,
            env=env,
            start_new_session=True,
            pass_fds=(self._lock.fd,) if self._lock is not None else (),
            preexec_fn=_die_with_launcher(os.getpid()),
        )

    def _spawn(self, svc: ServiceProcess) -> None:
        svc.proc = self._popen(svc, svc.argv)
        svc.metrics_url = svc.base_metrics_url
        svc.started_at = time.monotonic()
        svc.start_deadline = svc.started_at + self.cfg.startup_timeout
        svc.state = "starting"

    def _check_health(self, svc: ServiceProcess, timeout_s: float) -> str | None:
        """None when `svc` answers as ready within timeout_s, else the last problem seen."""
        if svc.role == "gateway" and self.cfg.tls_cert:
            return _tls_answers(dial_host(self.cfg.host), self.cfg.port, timeout_s)
        try:
            wait_for_health_sync(svc.target, timeout_s)
        except UnavailableError as exc:
            return str(exc)
        return None

    def _wait_healthy(
        self, svc: ServiceProcess, timeout_s: float, abort: threading.Event | None
    ) -> None:
        assert svc.proc is not None
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while True:
            if abort is not None and abort.is_set():
                raise StartAborted(f"stop requested while {svc.name} was starting")
            code = svc.proc.poll()
            if code is not None:
                raise StackError(
                    f"{svc.name} {describe_exit(code)} while starting "
                    f"(command: {' '.join(svc.argv)})"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StackError(
                    f"{svc.name} not healthy at {svc.target} after {timeout_s:g}s ({last})"
                )
            problem = self._check_health(svc, min(remaining, 1.0))
            if problem is None:
                return
            last = problem
            if svc.role == "gateway" and self.cfg.tls_cert:
                time.sleep(0.1)

    # -- supervision
    def supervise(self, stop: threading.Event, poll_s: float = 0.2) -> str | None:
        """Watch the services until `stop` is set, restarting those that exit on
        their own. Returns None once `stop` is set, or why it gave up (a service
        failed too often in a row, or restarts are off); the caller then stops
        the stack."""
        while not stop.wait(poll_s if self._handover is None else min(poll_s, 0.05)):
            problem = self.poll()
            if problem is not None:
                return problem
            self.reap_orphans()
        return None

    def poll(self) -> str | None:
        """One round of supervision: notice exits, restart after the backoff,
        mark restarted services running once healthy, advance a rolling
        restart. Returns why it gives up, or None."""
        self._advance_rolling_restart()
        for svc in self.services:
            problem = self._poll_service(svc)
            if problem is not None:
                return problem
        return None

    # -- rolling restart of the materializers
    def request_rolling_restart(self) -> None:
        """Ask for a rolling restart of every materializer (safe from a signal
        handler and other threads); supervise()/poll() carry it out. Asked
        while one runs, one more follows it."""
        self._roll_requested = True  # a plain store: no lock in a signal handler

    @property
    def rolling_restart_running(self) -> bool:
        return self._roll is not None

    def rolling_restart(self, timeout_s: float = 300.0, poll_s: float = 0.05) -> dict[str, Any]:
        """Run a rolling restart now, supervising meanwhile; return its record
        (`state`: done or failed, `steps`: what was logged). Call it from the
        thread that drives the stack."""
        self.request_rolling_restart()
        deadline = time.monotonic() + timeout_s
        while self._roll_requested or self._roll is not None:
            if time.monotonic() > deadline:
                raise StackError(f"rolling restart not done after {timeout_s:g}s")
            problem = self.poll()
            if problem is not None:
                raise StackError(problem)
            self.reap_orphans()
            time.sleep(poll_s)
        assert self.last_rolling_restart is not None
        return self.last_rolling_restart

    def _roll_log(self, message: str) -> None:
        self._log(f"rolling restart: {message}")
        if self._roll is not None:
            self._roll["steps"].append(message)
            self._write_roll_status()

    def _write_roll_status(self) -> None:
        record = self._roll or self.last_rolling_restart
        if record is None or self._stopped:
            return
        path = self.runtime / ROLLING_STATUS_FILE
        tmp = path.with_name(path.name + ".tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(record) + "\n")
            os.replace(tmp, path)

    def _advance_rolling_restart(self) -> None:
        if self._roll is None and self._roll_requested:
            self._roll_requested = False
            self._roll_count += 1
            self._roll = {
                "id": self._roll_count,
                "state": "running",
                "started": time.time(),
                "finished": None,
                "steps": [],
            }
            self._roll_queue = list(self.services_of("materializer"))
            if self._roll_queue:
                names = ", ".join(s.name for s in self._roll_queue)
                self._roll_log(f"restarting {names} one at a time")
            else:
                self._roll_log("nothing to restart: this stack runs no materializer (--sync)")
        if self._roll is None:
            return
        if self._handover is not None:
            self._step_handover(self._handover)
        while self._handover is None and self._roll_queue and self._roll is not None:
            self._begin_handover(self._roll_queue.pop(0))
        if self._handover is None and not self._roll_queue and self._roll is not None:
            self._finish_roll("done")

    def _finish_roll(self, state: str) -> None:
        assert self._roll is not None
        took = time.time() - self._roll["started"]
        self._roll_log(f"{state} in {took * 1e3:.0f} ms")
        self._roll.update(state=state, finished=time.time())
        self.last_rolling_restart, self._roll = self._roll, None
        self._roll_queue = []
        self._write_roll_status()

    def _begin_handover(self, svc: ServiceProcess) -> None:
        old = svc.proc
        if svc.state != "running" or old is None or old.poll() is not None:
            self._roll_log(f"{svc.name}: skipped, it is not running (state {svc.state})")
            return
        path = svc.uds_path
        assert path is not None, "materializers listen on Unix sockets"
        old_socket = _socket_identity(path)
        argv, metrics_url = svc.argv, svc.base_metrics_url
        port = int(svc.argv[svc.argv.index("--metrics-port") + 1])
        host = dial_host(self.cfg.metrics_host)
        if port > 0 and not _port_free(self.cfg.metrics_host, port):
            # The old one holds the configured port until it exits.
            port = free_port(host)
            argv = _with_metrics_port(svc.argv, port)
            metrics_url = _metrics_url(self.cfg.metrics_host, port)
        now = time.monotonic()
        try:
            new = self._popen(svc, [*argv, "--take-over"])
        except OSError as exc:
            self._roll_log(f"{svc.name}: could not start a replacement: {exc}")
            self._finish_roll("failed")
            return
        self._handover = _Handover(
            svc, old, new, now, now + self.cfg.startup_timeout, old_socket, metrics_url, argv
        )
        moved = "" if metrics_url == svc.metrics_url else f", metrics at {metrics_url}"
        self._roll_log(
            f"{svc.name}: started replacement pid {new.pid} on {svc.target}{moved}; "
            f"old pid {old.pid} keeps serving its streams"
        )

    def _step_handover(self, h: _Handover) -> None:
        svc, now = h.svc, time.monotonic()
        if h.phase == "starting":
            code = h.new.poll()
            if code is not None:
                h.svc.dead_groups[h.new.pid] = time.time()
                self._abort_handover(h, f"replacement pid {h.new.pid} {describe_exit(code)}")
                return
            if h.old.poll() is not None:  # the old one died meanwhile: adopt the replacement
                svc.dead_groups[h.old.pid] = time.time()
                for p in _members({h.old.pid: svc.dead_groups[h.old.pid]}):
                    with contextlib.suppress(psutil.Error):
                        p.terminate()
                svc.proc, svc.state = h.new, "starting"
                svc.started_at, svc.start_deadline = h.started, h.deadline
                svc.metrics_url, svc.argv = h.metrics_url, h.argv
                self._handover = None
                self._roll_log(
                    f"{svc.name}: old pid {h.old.pid} {describe_exit(h.old.returncode)} "
                    f"before its replacement was healthy; pid {h.new.pid} takes over"
                )
                return
            # The path names the replacement once it has renamed its socket over it.
            taken = _socket_identity(svc.uds_path or "") not in (None, h.old_socket)
            if taken and self._check_health(svc, 0.2) is None:
                healthy = time.monotonic()
                svc.proc, svc.state = h.new, "running"
                svc.started_at, svc.healthy_at = h.started, healthy
                svc.metrics_url, svc.argv = h.metrics_url, h.argv
                h.old.send_signal(signal.SIGTERM)
                h.phase, h.sigterm_at = "draining", time.monotonic()
                h.deadline = h.sigterm_at + self.cfg.drain_timeout
                self._roll_log(
                    f"{svc.name}: replacement pid {h.new.pid} healthy "
                    f"{(healthy - h.started) * 1e3:.0f} ms after its start; "
                    f"SIGTERM to old pid {h.old.pid}"
                )
                return
            if now > h.deadline:
                _signal_group(h.new.pid, signal.SIGKILL)
                h.new.wait()
                h.svc.dead_groups[h.new.pid] = time.time()
                self._abort_handover(
                    h,
                    f"replacement pid {h.new.pid} not healthy within "
                    f"{self.cfg.startup_timeout:g}s; killed",
                )
            return
        # draining: the old one finishes its steps and exits
        code = h.old.poll()
        if code is None:
            if now > h.deadline and not h.killed:
                h.killed = True
                self._roll_log(
                    f"{svc.name}: old pid {h.old.pid} did not exit within "
                    f"{self.cfg.drain_timeout:g}s of its SIGTERM; killing it"
                )
                _signal_group(h.old.pid, signal.SIGKILL)
            return
        took = (time.monotonic() - h.sigterm_at) * 1e3
        self._end_draining(h)
        how = "was killed" if h.killed else f"drained and {describe_exit(code)}"
        self._roll_log(f"{svc.name}: old pid {h.old.pid} {how} in {took:.0f} ms")

    def _end_draining(self, h: _Handover) -> None:
        """The old one has exited: its leftovers go, the socket path stays the replacement's."""
        self._handover = None
        h.svc.dead_groups[h.old.pid] = time.time()
        for p in _members({h.old.pid: h.svc.dead_groups[h.old.pid]}):
            with contextlib.suppress(psutil.Error):
                p.terminate()

    def _abort_handover(self, h: _Handover, why: str) -> None:
        """The replacement failed: the old one keeps serving."""
        self._handover = None
        if _socket_identity(h.svc.uds_path or "") != h.old_socket:
            # The path names the dead replacement: nothing new can reach the old
            # one. Stop it (it drains); supervision then starts a fresh one on the path.
            h.old.send_signal(signal.SIGTERM)
            h.svc.stop_expected = True
            self._roll_log(
                f"{h.svc.name}: {why}; {h.svc.target} no longer names old pid {h.old.pid}: "
                "SIGTERM to it, supervision starts a fresh one (the decoder builds in-process "
                "meanwhile)"
            )
            self._finish_roll("failed")
            return
        self._roll_log(f"{h.svc.name}: {why}; old pid {h.old.pid} keeps serving")
        self._finish_roll("failed")

    def _handover_extra(self) -> list[tuple[ServiceProcess, subprocess.Popen]]:
        """The process of a rolling restart that is not its service's `proc`:
        the replacement while it starts, the old one while it drains."""
        h = self._handover
        if h is None:
            return []
        return [(h.svc, h.new if h.phase == "starting" else h.old)]

    def _poll_service(self, svc: ServiceProcess) -> str | None:
        now = time.monotonic()
        if svc.state == "backoff":
            if now >= svc.next_start:
                self._restart(svc)
            return None
        if svc.state not in ("running", "starting") or svc.proc is None:
            return None
        code = svc.proc.poll()
        if svc.state == "running":
            if code is None:
                if svc.failures and now - svc.healthy_at >= self.cfg.restart_reset:
                    svc.failures = 0  # it has stayed up: its next crash starts a new count
                return None
            if svc.stop_expected:  # stopped by the launcher itself: start a fresh one now
                svc.stop_expected = False
                svc.dead_groups[svc.proc.pid] = time.time()
                svc.state, svc.next_start = "backoff", now
                self._log(f"{svc.name} (pid {svc.proc.pid}) stopped as asked; starting a fresh one")
                return None
            return self._crashed(svc, describe_exit(code), now)
        # starting (a restart): healthy yet?
        if code is not None:
            return self._crashed(svc, f"{describe_exit(code)} while starting", now)
        if self._check_health(svc, 0.2) is None:
            svc.state = "running"
            svc.healthy_at = time.monotonic()
            self._log(
                f"{svc.name} is serving again (pid {svc.proc.pid}, healthy "
                f"{svc.healthy_at - svc.started_at:.1f}s after its start)"
            )
            return None
        if now > svc.start_deadline:
            _signal_group(svc.proc.pid, signal.SIGKILL)  # not reaped yet: the group is its own
            svc.proc.wait()
            return self._crashed(svc, f"was not healthy within {self.cfg.startup_timeout:g}s", now)
        return None

    def _crashed(self, svc: ServiceProcess, what: str, now: float) -> str | None:
        """`svc` exited without being asked to: schedule its restart or give up."""
        assert svc.proc is not None
        cfg = self.cfg
        uptime = now - svc.started_at
        # What it started (pool workers, ...) goes too: asked now, killed at the restart.
        svc.dead_groups[svc.proc.pid] = time.time()
        for p in _members({svc.proc.pid: svc.dead_groups[svc.proc.pid]}):
            with contextlib.suppress(psutil.Error):
                p.terminate()
        if svc.state == "running" and now - svc.healthy_at >= cfg.restart_reset:
            svc.failures = 0
        svc.failures += 1
        if cfg.max_restarts == 0:
            svc.state = "failed"
            return f"{svc.name} {what} after {uptime:.1f}s (restarts are off: max-restarts 0)"
        if svc.failures > cfg.max_restarts:
            svc.state = "failed"
            return (
                f"{svc.name} {what} after {uptime:.1f}s; it failed {svc.failures} times in a row "
                f"(max-restarts {cfg.max_restarts}); giving up"
            )
        delay = min(cfg.restart_backoff * 2 ** (svc.failures - 1), cfg.restart_backoff_max)
        svc.state = "backoff"
        svc.next_start = now + delay
        self._log(
            f"{svc.name} {what} after {uptime:.1f}s; restarting it in {delay:g}s "
            f"(failure {svc.failures} in a row, at most {cfg.max_restarts})"
        )
        return None

    def _restart(self, svc: ServiceProcess) -> None:
        for p in _members(dict(svc.dead_groups)):  # leftovers of the dead one: no more waiting
            with contextlib.suppress(psutil.Error):
                p.kill()
        self.reap_orphans()
        if svc.role == "decoder":  # the dead decoder's arena, even a half-made one
            sweep_stale(f"omni-{svc.deployment}", creating_grace_s=0)
        svc.restarts += 1
        self._spawn(svc)
        self._log(
            f"restarting {svc.name} (pid {svc.proc.pid if svc.proc else '?'}, "
            f"restart {svc.restarts})"
        )

    # -- processes
    def exited(self) -> list[ServiceProcess]:
        """Services whose process has ended."""
        return [s for s in self.services if s.proc is not None and s.proc.poll() is not None]

    def descendants(self) -> list[psutil.Process]:
        """Every live process the services started, children of children included."""
        found: dict[int, psutil.Process] = {}
        roots: list[psutil.Process] = []
        for proc in self._leaders():
            with contextlib.suppress(psutil.Error):
                roots.append(psutil.Process(proc.pid))
        if self.subreaper:  # orphans re-parented to us
            leaders = {p.pid for p in self._leaders()}
            with contextlib.suppress(psutil.Error):
                roots += [p for p in psutil.Process().children() if p.pid not in leaders]
        for root in roots:
            with contextlib.suppress(psutil.Error):
                for p in [root, *root.children(recursive=True)]:
                    found[p.pid] = p
        return [p for p in found.values() if _alive(p)]

    def reap_orphans(self) -> None:
        """Collect exit statuses of re-parented orphans (only with subreaper)."""
        if not self.subreaper:
            return
        leaders = {p.pid for p in self._leaders()}
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process().children():
                if child.pid not in leaders:
                    with contextlib.suppress(ChildProcessError, OSError):
                        os.waitpid(child.pid, os.WNOHANG)

    def _leaders(self) -> list[subprocess.Popen]:
        """Every service process started (a rolling restart's extra one included)."""
        procs = [s.proc for s in self.services if s.proc is not None]
        return procs + [proc for _, proc in self._handover_extra()]

    def _groups(self) -> dict[int, float | None]:
        """Process groups of every service incarnation (each leads its own):
        {pgid: None while its leader is not reaped, else when it was seen gone}."""
        groups: dict[int, float | None] = {}
        for svc in self.services:
            if svc.proc is not None and svc.proc.returncode is not None:
                svc.dead_groups.setdefault(svc.proc.pid, time.time())
            groups.update(svc.dead_groups)
            if svc.proc is not None and svc.proc.returncode is None:
                groups[svc.proc.pid] = None
        for svc, proc in self._handover_extra():
            if proc.returncode is None:
                groups[proc.pid] = None
            else:
                groups.setdefault(proc.pid, svc.dead_groups.setdefault(proc.pid, time.time()))
        return groups

    def kill(self) -> None:
        """SIGKILL every service's process group now (a second Ctrl-C)."""
        groups = self._groups()
        for pgid, gone in groups.items():
            if gone is None:  # the leader is not reaped: the number is still its group's
                _signal_group(pgid, signal.SIGKILL)
        for p in _members({k: v for k, v in groups.items() if v is not None}):
            with contextlib.suppress(psutil.Error):
                p.kill()

    def stop(self, timeout_s: float | None = None) -> list[str]:
        """Stop gateway, decoder, materializer (in that order), then anything they
        left running, all within timeout_s (default cfg.stop_timeout) plus a
        moment to kill what is left. Returns the deployment's shared-memory
        segments still present."""
        if self._stopped:
            return self.segments()
        self._stopped = True
        timeout = self.cfg.stop_timeout if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        # Each service may use what the ones before it left, less a share kept
        # for each one after it (a decoder whose gateway is gone stops in well
        # under a second): a slow gateway cannot leave the others no time at all.
        share = min(2.0, timeout / 6)
        tracked = {p.pid: p for p in self.descendants()}
        extra = dict((id(svc), proc) for svc, proc in self._handover_extra())
        order: list[tuple[ServiceProcess, subprocess.Popen | None]] = []
        for svc in reversed(self.services):
            order.append((svc, svc.proc))
            if id(svc) in extra:  # a rolling restart's other process stops with it
                order.append((svc, extra[id(svc)]))
        for i, (svc, proc) in enumerate(order):
            svc.state = "stopped"
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            until = deadline - share * (len(order) - 1 - i)
            try:
                proc.wait(max(until - sent, 0.0))
            except subprocess.TimeoutExpired:
                self._log(
                    f"{svc.name} (pid {proc.pid}) did not stop within "
                    f"{time.monotonic() - sent:.1f}s of its SIGTERM; killing it"
                )
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        h, self._handover = self._handover, None
        if h is not None:
            for proc in (h.old, h.new):
                h.svc.dead_groups.setdefault(proc.pid, time.time())
        if self._roll is not None:
            self._roll["steps"].append("the stack stopped before it was done")
            self._roll.update(state="failed", finished=time.time())
            self.last_rolling_restart, self._roll = self._roll, None
        # What the services started and did not stop: children of children,
        # orphans re-parented to us, anything still in their process groups.
        tracked.update({p.pid: p for p in self.descendants()})
        tracked.update({p.pid: p for p in self._group_members()})
        # e.g. a forkserver noticing its parent left: a moment, within the deadline
        left = _wait_gone(list(tracked.values()), min(2.0, max(deadline - time.monotonic(), 0.2)))
        if left:
            self.killed = [f"{p.pid} ({_name(p)})" for p in left]
            for p in left:
                with contextlib.suppress(psutil.Error):
                    p.terminate()
            for p in _wait_gone(left, min(3.0, max(deadline - time.monotonic(), 0.2))):
                with contextlib.suppress(psutil.Error):
                    p.kill()
        self.kill()  # last resort: nothing should be left
        self.reap_orphans()
        # A killed decoder cannot unlink its arena; its flock is gone, so sweep
        # (a half-made one too: one killed while creating it left no header).
        for prefix in self.shm_prefixes:
            sweep_stale(prefix, creating_grace_s=0)
        self._remove_runtime()
        return self.segments()

    def _group_members(self) -> list[psutil.Process]:
        return _members(self._groups())

    def _remove_runtime(self) -> None:
        if self._own_runtime:
            shutil.rmtree(self.runtime, ignore_errors=True)
        else:
            shutil.rmtree(self.runtime / "tmp", ignore_errors=True)
            for name in (ROLLING_STATUS_FILE, ROLLING_STATUS_FILE + ".tmp"):
                with contextlib.suppress(OSError):
                    (self.runtime / name).unlink()
        if self._lock is not None:  # last: the directory is ours until it is gone
            self._lock.release(unlink=not self._own_runtime)

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _log_stderr(message: str) -> None:
    print(f"omni-serving up: {message}", file=sys.stderr, flush=True)


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "?"


def deployment_segments(deployment: str) -> list[str]:
    """Every /dev/shm entry of the deployment (arenas and anything else named for it)."""
    from omni_common.shm_arena import SHM_DIR

    return sorted(p.name for p in SHM_DIR.glob(f"omni-{deployment}-*"))


# -- `omni-serving up` --------------------------------------------------------------------


def run_up(cfg: StackConfig, out=None) -> int:
    """Start the stack, print its endpoints, supervise it until Ctrl-C/SIGTERM, stop it.

    SIGHUP asks for a rolling restart of the materializers (Stack.request_rolling_restart).

    Exit status: 0 after a stop asked by SIGTERM or Ctrl-C (restarts on the
    way included); 1 when a service failed to start, failed more often in a
    row than max_restarts allows, or something was left behind; 130 when
    Ctrl-C stopped it while starting (SIGTERM then: 0).
    """
    out = out or sys.stdout
    try:
        stack = Stack(cfg, subreaper=become_subreaper())
    except ConfigError as exc:
        print(f"omni-serving up: error: {exc}", file=sys.stderr)
        return 2
    cfg = stack.cfg
    stop_requested = threading.Event()
    signals_seen: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        signals_seen.append(signum)
        stop_requested.set()
        if len(signals_seen) > 1:  # asked twice: no more waiting
            stack.kill()

    def on_hangup(signum: int, frame: object) -> None:
        stack.request_rolling_restart()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, on_hangup)
    rc = 0
    try:
        print(
            f"starting omni-serving: deployment {cfg.deployment}, profile {cfg.profile}, "
            f"engine {cfg.engine}, materializer "
            f"{'none (sync)' if cfg.sync else cfg.materializer_impl}"
            f"{f', {cfg.replicas} replicas' if cfg.replicas > 1 else ''} ...",
            file=sys.stderr,
            flush=True,
        )
        try:
            stack.start(abort=stop_requested)
        except StartAborted:
            print("stopped while starting", file=sys.stderr)
            return 0 if signals_seen[:1] == [signal.SIGTERM] else 130
        except StackError as exc:
            print(f"omni-serving up: error: {exc}", file=sys.stderr)
            return 1
        width = max(len(label) for label, _ in stack.endpoints()) + 1
        lines = [f"omni-serving is up (deployment {cfg.deployment})"]
        lines += [f"  {label + ':':<{width}} {value}" for label, value in stack.endpoints()]
        lines.append(
            f'try: omni-serving speak "Hello there" -o hello.wav --target {stack.gateway_target}'
        )
        lines.append(
            "Ctrl-C stops all three."
            if cfg.replicas == 1
            else f"Ctrl-C stops all {len(stack.services)} services."
        )
        if not cfg.sync:
            lines.append(
                f"rolling restart of the materializer{'s' if cfg.replicas > 1 else ''}: "
                f"omni-serving restart materializer --runtime-dir {stack.runtime} "
                f"(or kill -HUP {os.getpid()})"
            )
        print("\n".join(lines), file=out, flush=True)
        problem = stack.supervise(stop_requested)
        if problem is not None:
            print(
                f"omni-serving up: error: {problem}; stopping the stack",
                file=sys.stderr,
                flush=True,
            )
            rc = 1
    finally:
        started = time.monotonic()
        left = stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stack.killed:
        print(
            f"warning: stopped processes left behind by the services: {', '.join(stack.killed)}",
            file=sys.stderr,
        )
    if left:
        print(f"warning: shared-memory segments left: {left}", file=sys.stderr)
        return 1
    print(f"stopped in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return rc


# -- `omni-serving restart materializer` ----------------------------------------------------


@dataclass
class RunningStack:
    """A live `omni-serving up`, as its runtime directory's owner record tells."""

    runtime: Path
    pid: int
    deployment: str


def _owner_of(directory: Path) -> RunningStack | None:
    """The live launcher recorded in `directory`/owner, or None."""
    try:
        fd = os.open(directory / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        record = _read_record(fd)
    finally:
        os.close(fd)
    if record is None:
        return None
    try:
        proc = psutil.Process(record["pid"])
        # The same process, not a later one that got its pid.
        if abs(proc.create_time() - float(record.get("start_time", 0))) > 0.5 or not _alive(proc):
            return None
    except (psutil.Error, TypeError, ValueError):
        return None
    return RunningStack(directory.absolute(), record["pid"], str(record.get("deployment", "")))


def find_running_stacks() -> list[RunningStack]:
    """The live `up` launchers whose runtime directory `up` created (omni-serving-* in
    runtime_parents()); a stack started with --runtime-dir is found by that directory."""
    found = []
    for parent in runtime_parents():
        for directory in sorted(parent.glob(RUNTIME_DIR_PREFIX + "*")):
            with contextlib.suppress(OSError):
                if directory.is_dir() and directory.stat().st_uid == os.getuid():
                    owner = _owner_of(directory)
                    if owner is not None:
                        found.append(owner)
    return found


def find_running_stack(deployment: str = "", runtime_dir: str = "") -> RunningStack:
    """The one live `up` named by deployment or runtime directory (or the only one)."""
    if runtime_dir:
        owner = _owner_of(Path(runtime_dir))
        if owner is None:
            raise StackError(
                f"--runtime-dir: no running `omni-serving up` owns {runtime_dir} "
                f"(no {OWNER_FILE} record of a live launcher there)"
            )
        if deployment and owner.deployment != deployment:
            raise StackError(
                f"--deployment: the stack in {runtime_dir} is deployment {owner.deployment!r}, "
                f"not {deployment!r}"
            )
        return owner
    stacks = find_running_stacks()
    if deployment:
        stacks = [s for s in stacks if s.deployment == deployment]
        if not stacks:
            raise StackError(
                f"--deployment: no running `omni-serving up` of deployment {deployment!r} "
                f"found in {', '.join(map(str, runtime_parents()))} (a stack started with "
                f"--runtime-dir is found with --runtime-dir)"
            )
    if not stacks:
        raise StackError("no running `omni-serving up` found; name one with --runtime-dir")
    if len(stacks) > 1:
        listed = ", ".join(f"{s.deployment} (pid {s.pid}, {s.runtime})" for s in stacks)
        raise StackError(f"several stacks run ({listed}); choose one with --deployment")
    return stacks[0]


def read_rolling_status(runtime: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((runtime / ROLLING_STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def run_restart_materializer(
    deployment: str = "", runtime_dir: str = "", timeout_s: float = 300.0, out=None
) -> int:
    """Ask a running `up` for a rolling restart of its materializers (SIGHUP),
    then follow it in the runtime directory's status record until it is done.

    Exit status: 0 done, 1 failed or not done within timeout_s, 2 no such stack.
    """
    out = out or sys.stdout
    try:
        stack = find_running_stack(deployment, runtime_dir)
    except StackError as exc:
        print(f"omni-serving restart: error: {exc}", file=sys.stderr)
        return 2
    before = read_rolling_status(stack.runtime)
    last_id = before["id"] if before and isinstance(before.get("id"), int) else 0
    os.kill(stack.pid, signal.SIGHUP)
    print(
        f"asked `omni-serving up` (pid {stack.pid}, deployment {stack.deployment}, "
        f"runtime dir {stack.runtime}) for a rolling restart of its materializers",
        file=out,
        flush=True,
    )
    if timeout_s <= 0:
        return 0
    deadline = time.monotonic() + timeout_s
    shown = 0
    while time.monotonic() < deadline:
        record = read_rolling_status(stack.runtime)
        if record is not None and isinstance(record.get("id"), int) and record["id"] > last_id:
            steps = record.get("steps") or []
            for step in steps[shown:]:
                print(f"  {step}", file=out, flush=True)
            shown = len(steps)
            if record.get("state") == "done":
                return 0
            if record.get("state") == "failed":
                print("omni-serving restart: the rolling restart failed", file=sys.stderr)
                return 1
        if _owner_of(stack.runtime) is None:
            print("omni-serving restart: error: the stack stopped meanwhile", file=sys.stderr)
            return 1
        time.sleep(0.1)
    print(
        f"omni-serving restart: not done after {timeout_s:g}s; `up`'s log has the rest",
        file=sys.stderr,
    )
    return 1
