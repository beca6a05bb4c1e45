"""docker/compose.yaml runs what `omni-serving up` runs, and survives restarts.

Each service's command and environment in the compose file are compared with
`omni_stack.commands.service_commands` for the configuration the file stands
for: the `up` defaults, deployment "omni", sockets in /run/omni-serving, and
every port bound on all interfaces inside its container. Around that: restart
policies, the IPC holder that keeps decoder and materializer in one namespace
across restarts, ports published on the host's loopback, and a Dockerfile that
builds without Docker Hub. The files are checked as parsed here (YAML,
`${VAR:-default}` resolved to its default) and, when a compose binary is
installed, as `docker-compose config` renders them. tests/test_compose_engine.py
runs them under a real Docker engine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from decoder_svc.profile import load_profile
from omni_stack.commands import service_commands, service_environment
from omni_stack.config import StackConfig, default_value

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker" / "compose.yaml"
COMPOSE_GPU = ROOT / "docker" / "compose.gpu.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
RUNTIME = "/run/omni-serving"
SERVICES = ("materializer", "decoder", "gateway")
HOLDER = "ipc"  # holds the IPC namespace decoder and materializer share
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def expected_config() -> StackConfig:
    """The launcher configuration docker/compose.yaml describes."""
    return StackConfig(
        profile=default_value("profile"),
        engine=default_value("engine"),
        materializer_impl=default_value("materializer_impl"),
        log_level=default_value("log_level"),
        host="0.0.0.0",
        port=default_value("port"),
        http_port=default_value("http_port"),
        metrics_host="0.0.0.0",
        decoder_metrics_port=default_value("decoder_metrics_port"),
        materializer_metrics_port=default_value("materializer_metrics_port"),
        deployment="omni",
    )


def _resolve(value):
    """`${VAR:-default}` -> default, recursively (what compose does with VAR unset)."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [_resolve(v) for v in value]
    if isinstance(value, dict):
        return {k: _resolve(v) for k, v in value.items()}
    return value


def _compose_binary() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, check=False)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def _compose_env() -> dict[str, str]:
    """The environment without variables the compose files interpolate."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "COMPOSE_"))}


def _run_compose_config(*files: Path, env: dict[str, str] | None = None) -> str:
    binary = _compose_binary()
    if binary is None:
        pytest.skip("no docker-compose binary (CI installs Debian's docker-compose; see .ci/run)")
    args = [*binary]
    for f in files:
        args += ["-f", str(f)]
    proc = subprocess.run([*args, "config"], capture_output=True, text=True,
                          env={**_compose_env(), **(env or {})}, cwd=ROOT, timeout=120, check=False)
    assert proc.returncode == 0, f"{' '.join(args)} config failed:\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module", params=["parsed", "docker-compose config"])
def services(request) -> dict:
    if request.param == "parsed":
        return _resolve(yaml.safe_load(COMPOSE.read_text()))["services"]
    return yaml.safe_load(_run_compose_config(COMPOSE))["services"]


def _split(argv: list[str]) -> tuple[str, dict[str, str]]:
    """(module, {flag: value}) of `python -m MODULE --flag value ...` (flags with values only)."""
    assert argv[:2] == ["python", "-m"], f"expected `python -m MODULE ...`, got {argv[:3]}"
    module, rest = argv[2], [str(a) for a in argv[3:]]
    assert len(rest) % 2 == 0 and all(a.startswith("--") for a in rest[::2]), f"{module}: not --flag value pairs: {rest}"
    flags = dict(zip(rest[::2], rest[1::2], strict=True))
    assert len(flags) == len(rest) // 2, f"{module}: a flag is given twice: {rest}"
    return module, flags


def _launcher() -> dict[str, tuple[str, dict[str, str], dict[str, str]]]:
    cfg = expected_config()
    out = {}
    for svc in service_commands(cfg, RUNTIME, python="python"):
        module, flags = _split(svc.argv)
        out[svc.name] = (module, flags, service_environment(cfg, svc.name))
    return out


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def test_compose_has_the_three_services_and_the_ipc_holder(services):
    assert set(services) == {*SERVICES, HOLDER}
    images = {services[name]["image"] for name in services}
    assert len(images) == 1, f"every service should run one image, got {images}"
    builds = {yaml.safe_dump(services[name].get("build"), sort_keys=True) for name in services}
    assert len(builds) == 1, "every service should build the image the same way"


@pytest.mark.parametrize("name", [*SERVICES, HOLDER])
def test_every_service_is_restarted_after_a_crash(services, name):
    # unless-stopped: a crash (non-zero exit, a signal) restarts the container;
    # `docker compose stop` is a manual stop and is respected.
    policy = services[name].get("restart")
    assert policy == "unless-stopped", f"{name}: restart {policy!r}"
    assert services[name].get("init") is True, f"{name}: no init to forward signals, reap children"


@pytest.mark.parametrize("name", SERVICES)
def test_service_command_matches_launcher(services, name):
    want_module, want_flags, _ = _launcher()[name]
    module, flags = _split(services[name]["command"])
    assert module == want_module
    assert flags == want_flags, (
        f"{name}: compose and launcher disagree\n"
        f"  only in compose:  {sorted(set(flags.items()) - set(want_flags.items()))}\n"
        f"  only in launcher: {sorted(set(want_flags.items()) - set(flags.items()))}"
    )


def test_services_are_wired_together(services):
    cmds = {name: _split(services[name]["command"])[1] for name in SERVICES}
    cfg = expected_config()
    assert cmds["decoder"]["--materializer"] == cmds["materializer"]["--listen"]
    assert cmds["gateway"]["--decoder"] == cmds["decoder"]["--listen"]
    assert cmds["decoder"]["--deployment"] == cmds["materializer"]["--deployment"] == cfg.deployment
    assert cmds["decoder"]["--profile"] == cfg.profile and cmds["decoder"]["--engine"] == cfg.engine
    assert cmds["materializer"]["--impl"] == cfg.materializer_impl
    for name, port in (("decoder", cfg.decoder_metrics_port), ("materializer", cfg.materializer_metrics_port)):
        assert cmds[name]["--metrics-port"] == str(port)
        assert cmds[name]["--metrics-host"] == "0.0.0.0", f"{name} /metrics must be reachable from other containers"
        assert str(port) in [str(p) for p in services[name].get("expose", [])], f"{name}: metrics port not exposed"


@pytest.mark.parametrize("name", SERVICES)
def test_service_environment_matches_launcher(services, name):
    _, _, want = _launcher()[name]
    env = _env(services[name])
    missing = {k: v for k, v in want.items() if env.get(k) != v}
    assert not missing, f"{name}: compose environment lacks or differs on {missing} (has {env})"


def test_decoder_and_materializer_share_the_holders_ipc_and_shm(services):
    # Both join the holder: a restart of either rejoins the same namespace,
    # where the other still is (joining the decoder's own namespace left the
    # materializer behind in the old one after a decoder restart).
    holder, dec, mat = services[HOLDER], services["decoder"], services["materializer"]
    assert holder["ipc"] == "shareable"
    for name, svc in (("decoder", dec), ("materializer", mat)):
        assert svc["ipc"] == f"service:{HOLDER}", f"{name}: ipc {svc['ipc']!r}"
        assert "shm_size" not in svc, f"{name}: uses the holder's /dev/shm, its own size is unused"
        condition = svc["depends_on"][HOLDER]["condition"]
        assert condition == "service_started", f"{name}: {svc['depends_on']}"
    # The holder runs nothing that could crash: a pause, no module of ours, no ports.
    command = holder["command"]
    assert command[:2] == ["python", "-c"] and "pause()" in command[2], f"holder command {command}"
    assert "ports" not in holder and "healthcheck" not in holder
    # The arena is a sparse file: a /dev/shm smaller than it fails with SIGBUS
    # on a later write, not at creation. Room for two per AR stage of the omni
    # profile (one arena per stage process; restart overlap).
    from decoder_svc.server import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args([])
    arena = defaults.arena_slots * defaults.arena_slot_bytes
    size = _bytes(holder["shm_size"])
    stages = len(load_profile("omni").ar_stages)
    assert size >= 2 * stages * arena, f"shm_size {holder['shm_size']} < 2 x {stages} x arena ({arena} bytes)"


def _bytes(size) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(size).strip().lower())
    assert m, f"unreadable size {size!r}"
    return int(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2)]


def _volumes(service: dict) -> dict[str, str]:
    """{target: source} of a service's volumes (short or long syntax)."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            out[v["target"]] = v["source"]
        else:
            source, target = v.split(":")[:2]
            out[target] = source
    return out


def test_sockets_and_models_on_named_volumes(services):
    for name in SERVICES:
        assert _volumes(services[name]).get(RUNTIME) == "sockets", f"{name}: sockets volume not at {RUNTIME}"
    model_dir = _env(services["decoder"]).get("OMNI_SERVING_MODEL_DIR")
    assert model_dir, "decoder: OMNI_SERVING_MODEL_DIR not set"
    assert _volumes(services["decoder"]).get(model_dir) == "models"


def test_healthchecks_probe_each_service(services):
    launcher = {svc.name: svc.target for svc in service_commands(expected_config(), RUNTIME, python="python")}
    for name in SERVICES:
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "omni_cli.probe"], f"{name}: healthcheck {test}"
        assert test[4] == launcher[name], f"{name}: healthcheck probes {test[4]}, the service is at {launcher[name]}"


def _published(port) -> tuple[str, str, str]:
    """(host ip, host port, container port) of a `ports` entry, short or long syntax."""
    if isinstance(port, dict):
        return str(port.get("host_ip", "")), str(port.get("published", "")), str(port["target"])
    parts = str(port).removesuffix("/tcp").split(":")
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    return "", parts[0] if len(parts) == 2 else "", parts[-1]


def test_gateway_publishes_ports_on_loopback_and_waits_for_healthy_backends(services):
    gw = services["gateway"]
    cfg = expected_config()
    published = {_published(p)[2]: _published(p) for p in gw["ports"]}
    assert {str(cfg.port), str(cfg.http_port)} <= set(published)
    for target, (host_ip, host_port, _) in published.items():
        assert host_ip == "127.0.0.1", f"port {target} published on {host_ip or 'every interface'}"
        assert host_port == target
    for dep in ("decoder", "materializer"):
        assert gw["depends_on"][dep]["condition"] == "service_healthy"
    for name in (*SERVICES, HOLDER):
        if name != "gateway":
            assert "ports" not in services[name], f"{name} publishes ports"


def test_published_address_and_ports_are_chosen_by_variables():
    env = {"OMNI_PUBLISH_HOST": "0.0.0.0", "OMNI_GRPC_PORT": "6051", "OMNI_HTTP_PORT": "6080"}
    rendered = yaml.safe_load(_run_compose_config(COMPOSE, env=env))["services"]["gateway"]
    published = {_published(p)[2]: _published(p)[:2] for p in rendered["ports"]}
    assert published == {"50051": ("0.0.0.0", "6051"), "8000": ("0.0.0.0", "6080")}, published


def test_dockerfile_builds_without_docker_hub():
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines()]
    # A `# syntax=` line makes BuildKit pull a frontend image; the builder's own suffices.
    assert not any(line.lower().startswith("# syntax=") for line in lines)
    code = [line for line in lines if line and not line.startswith("#")]
    froms = [line for line in code if line.upper().startswith("FROM ")]
    assert froms == ["FROM ${BASE_IMAGE}"], f"the base image must be a build argument: {froms}"
    first_arg = next(line for line in code if line.upper().startswith("ARG BASE_IMAGE"))
    assert code.index(first_arg) < code.index(froms[0]), "ARG BASE_IMAGE must come before FROM"
    assert first_arg == "ARG BASE_IMAGE=python:3.11-slim", f"default base image: {first_arg}"


def test_probe_reports_a_real_servers_health(tmp_path, capsys):
    # The healthchecks above run this module: it must say SERVING (exit 0)
    # only while the server is SERVING, and fail (exit 1) otherwise.
    import omni_cli.probe as probe
    from omni_common.server import ServerConfig, build_server

    async def scenario() -> tuple[int, int, int]:
        server, bound, health = await build_server(
            ServerConfig(address=f"unix://{tmp_path}/probe.sock", service_name="omni.test.Probe"),
            lambda server: None,
        )
        try:
            serving = await asyncio.to_thread(probe.main, [bound])
            await health.enter_graceful_shutdown()
            draining = await asyncio.to_thread(probe.main, [bound])
        finally:
            await server.stop(0)
        gone = await asyncio.to_thread(probe.main, [bound, "--timeout", "1"])
        return serving, draining, gone

    codes = asyncio.run(scenario())
    out = capsys.readouterr()
    assert codes == (0, 1, 1), f"{codes=} {out}"
    assert ": SERVING" in out.out and ": NOT_SERVING" in out.out, out


def test_gpu_override():
    gpu = _resolve(yaml.safe_load(COMPOSE_GPU.read_text()))["services"]
    assert set(gpu) == {*SERVICES, HOLDER}, "every service (the holder too) runs the cuda image"
    devices = gpu["decoder"]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) for d in devices)
    for name, svc in gpu.items():
        assert svc["build"]["args"]["EXTRAS"] == "cuda", f"{name}: GPU image must use the cuda extra"
    images = {svc["image"] for svc in gpu.values()}
    cpu_image = _resolve(yaml.safe_load(COMPOSE.read_text()))["x-service"]["image"]
    assert len(images) == 1 and images != {cpu_image}, f"{images=} {cpu_image=}"


def test_docker_compose_config_validates_gpu_variant():
    rendered = yaml.safe_load(_run_compose_config(COMPOSE, COMPOSE_GPU))["services"]
    assert rendered["decoder"]["deploy"]["resources"]["reservations"]["devices"]
    assert rendered[HOLDER]["ipc"] == "shareable"
    assert rendered["decoder"]["ipc"] == rendered["materializer"]["ipc"] == f"service:{HOLDER}"
