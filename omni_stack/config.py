"""What `omni-serving up` runs: `StackConfig`, its options, config files and their coercion.

- `StackConfig` holds every setting of a stack and checks them
  (`validate`: each error is a `ConfigError` naming the key).
- `UP_OPTIONS` is the single list of `up` options: flag `--<key with
  dashes>`, config-file key `<key>`; `add_up_arguments` adds them to a parser
  and `config_from_args` applies, in order, the defaults (`CLI_DEFAULTS` where
  the command line's differ from `StackConfig`'s), a `--config FILE` (TOML or
  YAML, `load_config_file`) and the options given on the command line.
- Replica naming: replica i of several runs deployment `<deployment>-r<i>`
  and serves /metrics on the configured port + `REPLICA_PORT_STRIDE` x i.

Invariants: a value from a config file is coerced to its option's type or
refused (never guessed); an unknown key is an error; deprecated keys
(`DEPRECATED_KEYS`) are accepted with a warning and lose to their new name.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from omni_stack.errors import ConfigError

ENGINES = ("vllm", "fake", "reference")  # "reference": deprecated name of "fake"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass
class StackConfig:
    """What `omni-serving up` runs. Ports set to 0 are picked free at start."""

    profile: str = "auto"
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
    # Liveness: every liveness_poll seconds the launcher checks each serving
    # decoder's and gateway's `omni_serving.liveness` health entry; NOT_SERVING twice in a
    # row restarts it as after a crash. 0 = off. A decoder that does not answer
    # that check at all (stopped, wedged event loop) for liveness_unanswered_s
    # seconds is restarted too; long, so that a slow answer under load does
    # not restart a healthy one. 0 = off.
    liveness_poll: float = 3.0
    liveness_unanswered_s: float = 60.0
    # Passed to the gateway as they are (empty = not passed).
    tls_cert: str = ""
    tls_key: str = ""
    auth_token_file: str = ""
    allowed_origins: str = ""  # comma-separated origins; passed as --allowed-origins
    max_text_chars: int = 0  # passed as --max-text-chars (0 = not passed: the gateway's default)
    voice_dir: str = ""  # the decoder's --voice-dir ("" = not passed: its default)
    extra_decoder_args: list[str] = field(default_factory=list)
    # AR stages' engine settings over the profile's: "[STAGE.]KEY=VALUE" items,
    # comma-separated, each passed to the decoder as --engine-set
    engine_set: str = ""
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
        if self.liveness_poll < 0:
            raise ConfigError(f"liveness_poll: must be >= 0 seconds (0 = off), got {self.liveness_poll}")
        if self.max_text_chars < 0:
            raise ConfigError(f"max_text_chars: must be >= 0 characters (0 = the gateway's default), "
                              f"got {self.max_text_chars}")
        if self.liveness_unanswered_s < 0:
            raise ConfigError(
                f"liveness_unanswered_s: must be >= 0 seconds (0 = off), got {self.liveness_unanswered_s}"
            )
        if 0 < self.liveness_unanswered_s < 2 * self.liveness_poll:
            raise ConfigError(
                f"liveness_unanswered_s: {self.liveness_unanswered_s:g} is below two liveness checks "
                f"(2 x liveness_poll = {2 * self.liveness_poll:g}); 0 = off"
            )
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
        self.engine_set_items()

    def engine_set_items(self) -> list[str]:
        """`engine_set`'s items, checked (key names and form; values are
        checked by the decoder, against its profile's stages)."""
        from decoder_svc.engine_settings import parse_overrides
        from omni_common.errors import InvalidArgumentError

        items = [item.strip() for item in self.engine_set.split(",") if item.strip()]
        try:
            parse_overrides(items, "engine_set")
        except InvalidArgumentError as exc:
            raise ConfigError(str(exc)) from exc
        return items

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
    UpOption("profile", str, "deploy profile: omni (speech and chat), tts (speech only), a profile YAML path, "
                             "or auto (default: the model's own, omni for Qwen3-Omni, tts for Qwen3-TTS)"),
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
        "liveness_poll",
        float,
        "seconds between checks of each decoder's and gateway's (without TLS) omni_serving.liveness health entry; "
        "NOT_SERVING twice in a row restarts it as after a crash (0 = off)",
        metavar="S",
    ),
    UpOption(
        "liveness_unanswered_s",
        float,
        "seconds a serving decoder or gateway may leave its liveness check unanswered (stopped, wedged) "
        "before it is killed and restarted as after a crash; long, so that a slow answer under "
        "load does not restart a healthy one (0 = off)",
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
    UpOption(
        "engine_set",
        str,
        "AR stages' engine settings over the profile's: [STAGE.]KEY=VALUE items, comma-separated "
        "(e.g. talker.kv_cache_memory=2GiB,dtype=float32), passed to the decoder as --engine-set "
        "(docs/profiles.md, \"Engine settings\")",
        metavar="ITEMS",
    ),
    UpOption(
        "allowed_origins",
        str,
        "gateway: origins besides its own whose pages may open its WebSockets "
        "(scheme://host[:port], comma-separated, or *), passed as --allowed-origins",
        metavar="ORIGINS",
    ),
    UpOption(
        "max_text_chars",
        int,
        "gateway: the longest text, prompt or input accepted, in characters, passed as --max-text-chars "
        "(0: the gateway's default, 4096; raise it for long prompts)",
        metavar="N",
    ),
    UpOption(
        "voice_dir",
        str,
        "decoder: the voice registry's directory (a voice-clone model's registered voices), passed as "
        "--voice-dir (default: voices/ in the model cache; docs/voices.md)",
        metavar="DIR",
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
