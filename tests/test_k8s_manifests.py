"""deploy/k8s runs what `omni-serving up` runs, as valid Kubernetes objects.

The kustomizations (deploy/k8s and deploy/k8s/overlays/gpu) are rendered by a
small renderer here that knows only the kustomization features they use (it
refuses any other), and, where a `kustomize` or `kubectl` binary is installed,
compared with what `kustomize build` renders. Every rendered object, and the
examples, are validated offline in strict mode (unknown fields rejected)
against the Kubernetes API schemas bundled with kubernetes-validate, for the
oldest Kubernetes the manifests support (1.29: sidecar containers on by
default) and the newest the validator knows.

Then the objects are held to the project, as tests/test_compose.py holds
docker/compose.yaml: each container's command line, after the kubelet's
$(VAR) expansion from the ConfigMap, is what `service_commands` builds for the
configuration the manifests stand for (the `up` defaults, deployment "omni",
sockets in /run/omni-serving, the checkpoint at /checkpoint), except the two
addresses that differ by design: the decoder listens on TCP and the gateway
dials the decoders' headless Service. Probes, Services and the network policy
point at the ports the services listen on; decoder and materializer share
/dev/shm and the socket directory; the checkpoint is mounted read-only.
test_checks_catch_broken_manifests shows each of those checks failing on a
manifest broken on purpose. test_manifest_command_lines_serve_speech (e2e)
runs the three command lines as processes, probes them as the kubelet would,
and serves a Speak through them.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import kubernetes_validate  # the dev extra (scripts/install.sh)
import pytest
import yaml

from decoder_svc.profile import load_profile
from omni_common.liveness import LIVENESS_SERVICE
from omni_common.net import free_port
from omni_stack.commands import service_commands, service_environment
from omni_stack.config import StackConfig, default_value

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = {"base": K8S, "gpu": K8S / "overlays" / "gpu"}
EXAMPLES = sorted((K8S / "examples").glob("*.yaml"))
COMPOSE = ROOT / "docker" / "compose.yaml"
COMPOSE_GPU = ROOT / "docker" / "compose.gpu.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"

# 1.29: the oldest with sidecar containers (restartPolicy Always on an init
# container) on by default; 1.37: the newest schemas kubernetes-validate 1.37 bundles.
KUBERNETES_VERSIONS = ("1.29", "1.37")

NAMESPACE = "omni-serving"
RUNTIME = "/run/omni-serving"
CHECKPOINT = "/checkpoint"
DECODER_PORT = 50052
DECODER = ("Deployment", "omni-decoder")
GATEWAY = ("Deployment", "omni-gateway")
DECODER_SERVICE = ("Service", "omni-decoder")  # headless
GATEWAY_SERVICES = (("Service", "omni-gateway"), ("Service", "omni-gateway-headless"))
CONFIGMAP = ("ConfigMap", "omni-serving")
CHECKPOINT_CLAIM = ("PersistentVolumeClaim", "omni-checkpoint")
PDB = ("PodDisruptionBudget", "omni-decoder")
NETWORK_POLICY = ("NetworkPolicy", "omni-decoder")
EXPECTED_OBJECTS = {
    ("Namespace", NAMESPACE),
    CONFIGMAP,
    CHECKPOINT_CLAIM,
    DECODER,
    DECODER_SERVICE,
    PDB,
    NETWORK_POLICY,
    GATEWAY,
    *GATEWAY_SERVICES,
}
GPU = "nvidia.com/gpu"
_CLUSTER_SCOPED = {"Namespace", "PersistentVolume"}


def expected_config() -> StackConfig:
    """The launcher configuration deploy/k8s describes."""
    return StackConfig(
        profile=default_value("profile"),
        engine=default_value("engine"),
        materializer_impl=default_value("materializer_impl"),
        log_level=default_value("log_level"),
        model=CHECKPOINT,
        host="0.0.0.0",
        port=default_value("port"),
        http_port=default_value("http_port"),
        metrics_host="0.0.0.0",
        decoder_metrics_port=default_value("decoder_metrics_port"),
        materializer_metrics_port=default_value("materializer_metrics_port"),
        deployment="omni",
    )


# -- rendering: the subset of kustomize the kustomizations use ------------------------

_KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources", "images", "patches"}
# Strategic merge: lists of these fields merge item by item on the key; any other
# list in a patch replaces the list it patches (as for fields without a patch strategy).
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}


def _strategic_merge(base, patch, field: str | None = None):
    if isinstance(patch, dict):
        directives = [k for k in patch if str(k).startswith("$")]
        assert not directives, f"patch directive {directives} not supported by this renderer"
        out = copy.deepcopy(base) if isinstance(base, dict) else {}
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = _strategic_merge(out.get(key), value, key)
        return out
    if isinstance(patch, list) and field in _MERGE_KEYS and isinstance(base, list):
        key = _MERGE_KEYS[field]
        out = copy.deepcopy(base)
        for item in patch:
            at = [i for i, have in enumerate(out) if have.get(key) == item.get(key)]
            if at:
                out[at[0]] = _strategic_merge(out[at[0]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _pod_containers(obj: dict) -> list[dict]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _split_image(image: str) -> tuple[str, str]:
    name, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:
        return image, ""
    return name, tag


def render(directory: Path) -> list[dict]:
    """What `kustomize build directory` renders, for the features used in deploy/k8s."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - _KUSTOMIZATION_KEYS
    assert not unknown, (
        f"{directory}: kustomization fields {sorted(unknown)} are not handled by the "
        "renderer in tests/test_k8s_manifests.py; teach it them (and compare with kustomize)"
    )
    objects: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch_ref in kustomization.get("patches", []):
        assert set(patch_ref) == {"path"}, f"only file patches are handled: {patch_ref}"
        for patch in yaml.safe_load_all((directory / patch_ref["path"]).read_text()):
            key = (patch["kind"], patch["metadata"]["name"])
            at = [i for i, obj in enumerate(objects) if _key(obj) == key]
            assert len(at) == 1, f"patch {patch_ref['path']}: {key} matches {len(at)} objects"
            objects[at[0]] = _strategic_merge(objects[at[0]], patch)
    for image in kustomization.get("images", []):
        assert set(image) <= {"name", "newName", "newTag"}, f"image transform {image}"
        for obj in objects:
            for container in _pod_containers(obj):
                name, tag = _split_image(container["image"])
                if name == image["name"]:
                    name = image.get("newName", name)
                    tag = image.get("newTag", tag)
                    container["image"] = f"{name}:{tag}" if tag else name
    if "namespace" in kustomization:
        for obj in objects:
            if obj["kind"] not in _CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = kustomization["namespace"]
    return objects


def _kustomize_binary() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def _key(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def _index(objects: list[dict]) -> dict[tuple[str, str], dict]:
    out = {}
    for obj in objects:
        assert _key(obj) not in out, f"{_key(obj)} defined twice"
        out[_key(obj)] = obj
    return out


@pytest.fixture(scope="module", params=sorted(KUSTOMIZATIONS))
def variant(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def objects(variant) -> dict[tuple[str, str], dict]:
    return _index(render(KUSTOMIZATIONS[variant]))


# -- reading the objects as the kubelet would ------------------------------------------

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: defined variables replaced, $$ -> $, others left."""

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR_REF.sub(one, value)


def _pod_spec(objects, key) -> dict:
    return objects[key]["spec"]["template"]["spec"]


def _container(objects, key, name) -> dict:
    found = [c for c in _pod_containers(objects[key]) if c["name"] == name]
    assert len(found) == 1, f"{key}: {len(found)} containers named {name!r}"
    return found[0]


def _env(objects, key, container: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert set(source) <= {"configMapRef", "prefix"}, f"{container['name']}: envFrom {source}"
        ref = ("ConfigMap", source["configMapRef"]["name"])
        assert ref in objects, f"{container['name']}: envFrom names {ref}, which is not deployed"
        for name, value in objects[ref]["data"].items():
            env[source.get("prefix", "") + name] = str(value)
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(str(var["value"]), env)
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[var["name"]] = objects[key]["metadata"]["namespace"]
        else:
            raise AssertionError(f"{container['name']}: env {var} not understood by this test")
    return env


def _argv(objects, key, name) -> list[str]:
    """The container's command line after $(VAR) expansion; every reference must resolve."""
    container = _container(objects, key, name)
    assert "args" not in container, f"{name}: the whole command line belongs in `command`"
    env = _env(objects, key, container)
    argv = [_expand(str(a), env) for a in container["command"]]
    unresolved = [a for a in argv if "$(" in a]
    assert not unresolved, f"{name}: unresolved references {unresolved} (not in its environment)"
    return argv


def _split(argv: list[str]) -> tuple[str, dict[str, str]]:
    """(module, {flag: value}) of `python -m MODULE --flag value ...` (flags with values only)."""
    assert argv[:2] == ["python", "-m"], f"expected `python -m MODULE ...`, got {argv[:3]}"
    module, rest = argv[2], argv[3:]
    assert len(rest) % 2 == 0 and all(a.startswith("--") for a in rest[::2]), f"{module}: {rest}"
    flags = dict(zip(rest[::2], rest[1::2], strict=True))
    assert len(flags) == len(rest) // 2, f"{module}: a flag is given twice: {rest}"
    return module, flags


def _flags(objects, service: str) -> dict[str, str]:
    key = GATEWAY if service == "gateway" else DECODER
    return _split(_argv(objects, key, service))[1]


def _port(address: str) -> int:
    host, sep, port = address.rpartition(":")
    assert sep and host and port.isdigit(), f"not host:port: {address}"
    return int(port)


def _uds_path(target: str) -> PurePosixPath:
    assert target.startswith("unix:///"), f"not a unix:///abs/path socket: {target}"
    return PurePosixPath(target.removeprefix("unix://"))


def _mounts(container: dict) -> dict[str, dict]:
    """{mountPath: volumeMount}"""
    return {m["mountPath"]: m for m in container.get("volumeMounts", [])}


def _volume(objects, key, name: str) -> dict:
    found = [v for v in _pod_spec(objects, key).get("volumes", []) if v["name"] == name]
    assert len(found) == 1, f"{key}: {len(found)} volumes named {name!r}"
    return found[0]


def _mount_of(container: dict, path: PurePosixPath) -> dict:
    """The volumeMount that holds `path` in the container (the deepest one)."""
    holders = [
        m
        for p, m in _mounts(container).items()
        if path == PurePosixPath(p) or PurePosixPath(p) in path.parents
    ]
    assert holders, f"{container['name']}: no volume mounted at or above {path}"
    return max(holders, key=lambda m: len(m["mountPath"]))


def _bytes(quantity) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(quantity))
    assert m, f"unreadable quantity {quantity!r}"
    scale = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    scale |= {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return int(m.group(1)) * scale[m.group(2)]


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"selector {selector}: matchLabels only"
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def _pod_labels(objects, key) -> dict[str, str]:
    return objects[key]["spec"]["template"]["metadata"]["labels"]


# -- the checks (each also run on broken manifests below) ------------------------------


def check_objects(objects) -> None:
    assert set(objects) == EXPECTED_OBJECTS, (
        f"only rendered: {sorted(set(objects) - EXPECTED_OBJECTS)}; "
        f"missing: {sorted(EXPECTED_OBJECTS - set(objects))}"
    )
    namespaces = {
        obj["metadata"].get("namespace")
        for k, obj in objects.items()
        if k[0] not in _CLUSTER_SCOPED
    }
    assert namespaces == {NAMESPACE}, f"objects in namespaces {namespaces}"


def _launcher() -> dict[str, tuple[str, dict[str, str]]]:
    return {
        svc.name: _split(svc.argv)
        for svc in service_commands(expected_config(), RUNTIME, python="python")
    }


def _expected_command(service: str) -> tuple[str, dict[str, str]]:
    """The launcher's command line, with the two addresses that differ by design."""
    module, flags = _launcher()[service]
    if service == "decoder":
        flags["--listen"] = f"0.0.0.0:{DECODER_PORT}"  # gateways in other Pods dial it
    if service == "gateway":
        flags["--decoder"] = (
            f"dns:///{DECODER_SERVICE[1]}.{NAMESPACE}.svc.cluster.local:{DECODER_PORT}"
        )
    return module, flags


def check_command(objects, service: str) -> None:
    want_module, want = _expected_command(service)
    key = GATEWAY if service == "gateway" else DECODER
    module, flags = _split(_argv(objects, key, service))
    assert module == want_module, f"{service}: runs {module}, the launcher runs {want_module}"
    assert flags == want, (
        f"{service}: manifest and launcher disagree\n"
        f"  only in the manifest: {sorted(set(flags.items()) - set(want.items()))}\n"
        f"  only in the launcher: {sorted(set(want.items()) - set(flags.items()))}"
    )


def check_environment(objects, service: str) -> None:
    key = GATEWAY if service == "gateway" else DECODER
    env = _env(objects, key, _container(objects, key, service))
    want = service_environment(expected_config(), service)
    differ = {k: (env.get(k), v) for k, v in want.items() if env.get(k) != v}
    assert not differ, f"{service}: environment (has, launcher sets): {differ}"


def _arena_bytes(env: dict[str, str]) -> int:
    from decoder_svc.server import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args([])
    slots = int(env.get("OMNI_ARENA_SLOTS", defaults.arena_slots))
    slot_bytes = int(env.get("OMNI_ARENA_SLOT_BYTES", defaults.arena_slot_bytes))
    return slots * slot_bytes


def check_shared_memory_and_sockets(objects) -> None:
    spec = _pod_spec(objects, DECODER)
    assert not spec.get("hostIPC"), "decoder Pods must not share the node's IPC namespace"
    dec = _container(objects, DECODER, "decoder")
    mat = _container(objects, DECODER, "materializer")
    # The materializer is a sidecar: started before the decoder, stopped after it.
    assert mat in spec.get("initContainers", []) and mat.get("restartPolicy") == "Always", (
        "materializer: expected a sidecar (init container with restartPolicy Always)"
    )
    # One memory-backed /dev/shm for both, room for two arenas per AR stage of
    # the omni profile (one per stage process; restart overlap) + 16 MiB.
    shm = {
        name: _mounts(c).get("/dev/shm", {}).get("name")
        for name, c in (("decoder", dec), ("materializer", mat))
    }
    assert shm["decoder"] and shm["decoder"] == shm["materializer"], f"/dev/shm volumes {shm}"
    empty_dir = _volume(objects, DECODER, shm["decoder"]).get("emptyDir")
    assert empty_dir and empty_dir.get("medium") == "Memory", f"/dev/shm volume: {empty_dir}"
    arena = _arena_bytes(_env(objects, DECODER, dec))
    size = _bytes(empty_dir.get("sizeLimit", "0"))
    stages = len(load_profile("omni").ar_stages)
    assert size >= 2 * stages * arena + 16 * 2**20, (
        f"/dev/shm sizeLimit {empty_dir.get('sizeLimit')} < 2 x {stages} x arena ({arena} bytes) + 16 MiB"
    )
    # The decoder dials the materializer's socket, in one emptyDir mounted in both.
    dec_flags, mat_flags = _flags(objects, "decoder"), _flags(objects, "materializer")
    assert dec_flags["--materializer"] == mat_flags["--listen"], (
        dec_flags["--materializer"],
        mat_flags["--listen"],
    )
    socket = _uds_path(mat_flags["--listen"])
    held = {name: _mount_of(c, socket) for name, c in (("decoder", dec), ("materializer", mat))}
    assert held["decoder"]["name"] == held["materializer"]["name"], (
        f"socket {socket} on different volumes: {held}"
    )
    assert held["decoder"]["mountPath"] == held["materializer"]["mountPath"]
    assert "emptyDir" in _volume(objects, DECODER, held["decoder"]["name"]), (
        "sockets: expected an emptyDir"
    )
    assert not held["materializer"].get("readOnly") and not held["decoder"].get("readOnly")
    # Same deployment name on both sides: the materializer only maps omni-<deployment>-* segments.
    assert dec_flags["--deployment"] == mat_flags["--deployment"]


def check_probes(objects) -> None:
    dec = _container(objects, DECODER, "decoder")
    dec_port = _port(_flags(objects, "decoder")["--listen"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert dec.get(probe, {}).get("grpc", {}).get("port") == dec_port, (
            f"decoder {probe}: {dec.get(probe)} (listens on {dec_port})"
        )
    # readiness (and startup) on the overall entry; liveness on the liveness entry
    for probe in ("startupProbe", "readinessProbe"):
        assert dec[probe]["grpc"].get("service", "") == "", f"decoder {probe}: {dec[probe]}"
    assert dec["livenessProbe"]["grpc"].get("service") == LIVENESS_SERVICE, (
        f"decoder livenessProbe: {dec['livenessProbe']} (want service {LIVENESS_SERVICE!r})"
    )
    startup = dec["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, (
        f"decoder startupProbe allows only {startup['periodSeconds'] * startup['failureThreshold']}s "
        "for a model load"
    )
    assert dec_port in [p["containerPort"] for p in dec["ports"]], (
        f"decoder: port {dec_port} not declared"
    )
    mat = _container(objects, DECODER, "materializer")
    probe_cmd = ["python", "-m", "omni_cli.probe", _flags(objects, "materializer")["--listen"]]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert mat.get(probe, {}).get("exec", {}).get("command") == probe_cmd, (
            f"materializer {probe}: {mat.get(probe)}"
        )
    gw = _container(objects, GATEWAY, "gateway")
    gw_flags = _flags(objects, "gateway")
    gw_port = _port(gw_flags["--listen"])
    # Readiness follows the decoders and the event loop (the overall entry);
    # liveness the liveness entry (the event loop only, never the decoders).
    assert gw.get("readinessProbe", {}).get("grpc", {}).get("port") == gw_port, (
        f"gateway readiness: {gw.get('readinessProbe')}"
    )
    assert gw.get("readinessProbe", {}).get("grpc", {}).get("service", "") == "", (
        f"gateway readiness: {gw.get('readinessProbe')} (want the overall entry)"
    )
    gw_live = gw.get("livenessProbe", {}).get("grpc", {})
    assert gw_live.get("port") == gw_port and gw_live.get("service") == LIVENESS_SERVICE, (
        f"gateway liveness: {gw.get('livenessProbe')} (want grpc {gw_port}, service {LIVENESS_SERVICE!r})"
    )
    declared = sorted(p["containerPort"] for p in gw["ports"])
    assert declared == sorted([gw_port, int(gw_flags["--http-port"])]), f"gateway ports {declared}"


def check_decoder_service(objects) -> None:
    svc = objects[DECODER_SERVICE]["spec"]
    assert svc.get("clusterIP") == "None", "the decoder Service must be headless (every Pod in DNS)"
    assert not svc.get("publishNotReadyAddresses"), "not-ready decoders must stay out of DNS"
    assert _selects({"matchLabels": svc["selector"]}, _pod_labels(objects, DECODER))
    assert not _selects({"matchLabels": svc["selector"]}, _pod_labels(objects, GATEWAY))
    ports = {p["name"]: p for p in svc["ports"]}
    dec_port = _port(_flags(objects, "decoder")["--listen"])
    assert ports["grpc"]["port"] == ports["grpc"]["targetPort"] == dec_port, (
        f"grpc port {ports['grpc']}"
    )
    metrics = {int(_flags(objects, name)["--metrics-port"]) for name in ("decoder", "materializer")}
    assert metrics <= {p["targetPort"] for p in svc["ports"]}, (
        f"metrics ports {metrics} not in the Service"
    )
    for name in ("decoder", "materializer"):
        container = _container(objects, DECODER, name)
        port = int(_flags(objects, name)["--metrics-port"])
        assert port in [p["containerPort"] for p in container["ports"]], (
            f"{name}: metrics port {port}"
        )
        assert _flags(objects, name)["--metrics-host"] == "0.0.0.0", (
            f"{name}: /metrics must be reachable"
        )
    # The gateway dials every decoder Pod: dns:/// on the headless Service's name.
    namespace = objects[GATEWAY]["metadata"]["namespace"]
    target = f"dns:///{DECODER_SERVICE[1]}.{namespace}.svc.cluster.local:{ports['grpc']['port']}"
    assert _flags(objects, "gateway")["--decoder"] == target, (
        f"gateway --decoder {_flags(objects, 'gateway')['--decoder']}, want {target}"
    )


def check_gateway(objects) -> None:
    assert objects[GATEWAY]["spec"]["replicas"] == 2
    flags = _flags(objects, "gateway")
    want = {"grpc": _port(flags["--listen"]), "http": int(flags["--http-port"])}
    for key in GATEWAY_SERVICES:
        svc = objects[key]["spec"]
        ports = {p["name"]: (p["port"], p["targetPort"]) for p in svc["ports"]}
        assert ports == {name: (port, port) for name, port in want.items()}, f"{key}: ports {ports}"
        assert _selects({"matchLabels": svc["selector"]}, _pod_labels(objects, GATEWAY))
        assert not _selects({"matchLabels": svc["selector"]}, _pod_labels(objects, DECODER))
    assert objects[("Service", "omni-gateway-headless")]["spec"].get("clusterIP") == "None"


def check_checkpoint(objects) -> None:
    dec = _container(objects, DECODER, "decoder")
    model = PurePosixPath(_flags(objects, "decoder")["--model"])
    mount = _mount_of(dec, model)
    assert mount.get("readOnly") is True, f"checkpoint mount {mount} must be readOnly"
    volume = _volume(objects, DECODER, mount["name"])
    source = volume.get("persistentVolumeClaim")
    assert source and source.get("readOnly") is True, (
        f"checkpoint volume {volume} must be a read-only claim"
    )
    claim = objects[("PersistentVolumeClaim", source["claimName"])]["spec"]
    assert claim["accessModes"] == ["ReadOnlyMany"], claim["accessModes"]
    assert claim.get("storageClassName") == "", (
        "no dynamic provisioning: bind a volume that holds the checkpoint"
    )
    # The model cache (derived files) is writable and is not the checkpoint.
    cache = PurePosixPath(_env(objects, DECODER, dec)["OMNI_SERVING_MODEL_DIR"])
    cache_mount = _mount_of(dec, cache)
    assert cache_mount["name"] != mount["name"] and not cache_mount.get("readOnly"), (
        f"model cache {cache_mount}"
    )


def _dockerfile_user() -> tuple[int, int]:
    users = [
        line.split()[1] for line in DOCKERFILE.read_text().splitlines() if line.startswith("USER ")
    ]
    assert len(users) == 1, f"Dockerfile USER lines: {users}"
    uid, _, gid = users[0].partition(":")
    return int(uid), int(gid or uid)


def check_security_and_resources(objects) -> None:
    uid, gid = _dockerfile_user()
    for key in (DECODER, GATEWAY):
        pod = _pod_spec(objects, key)["securityContext"]
        assert pod.get("runAsNonRoot") is True, f"{key}: runAsNonRoot"
        assert (pod.get("runAsUser"), pod.get("runAsGroup")) == (uid, gid), (
            f"{key}: not the image's user {uid}:{gid}"
        )
        assert _pod_spec(objects, key).get("automountServiceAccountToken") is False, (
            f"{key}: no API access needed"
        )
        for container in _pod_containers(objects[key]):
            name = container["name"]
            ctx = container.get("securityContext", {})
            assert ctx.get("allowPrivilegeEscalation") is False, f"{name}: allowPrivilegeEscalation"
            assert ctx.get("capabilities", {}).get("drop") == ["ALL"], f"{name}: capabilities"
            if ctx.get("readOnlyRootFilesystem"):
                assert "/tmp" in _mounts(container), f"{name}: read-only root needs a writable /tmp"
            resources = container.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(kind, {})), (
                    f"{name}: resources.{kind} {resources}"
                )
                _bytes(resources[kind]["memory"])


def check_disruption_budget_and_network_policy(objects) -> None:
    decoder_labels, gateway_labels = _pod_labels(objects, DECODER), _pod_labels(objects, GATEWAY)
    pdb = objects[PDB]["spec"]
    assert _selects(pdb["selector"], decoder_labels) and not _selects(
        pdb["selector"], gateway_labels
    )
    assert pdb.get("maxUnavailable") == 1 or pdb.get("minAvailable"), pdb
    policy = objects[NETWORK_POLICY]["spec"]
    assert _selects(policy["podSelector"], decoder_labels)
    dec_port = _port(_flags(objects, "decoder")["--listen"])
    grpc_rules = [
        r for r in policy["ingress"] if dec_port in [p["port"] for p in r.get("ports", [])]
    ]
    assert len(grpc_rules) == 1, f"one ingress rule for port {dec_port}: {grpc_rules}"
    sources = grpc_rules[0].get("from", [])
    assert sources and all(
        set(s) == {"podSelector"} and _selects(s["podSelector"], gateway_labels) for s in sources
    ), f"port {dec_port} must be open to gateway Pods only: {sources}"
    metrics = {int(_flags(objects, name)["--metrics-port"]) for name in ("decoder", "materializer")}
    allowed = {p["port"] for r in policy["ingress"] for p in r.get("ports", [])}
    assert metrics <= allowed, f"metrics ports {metrics} closed by the network policy"


def _compose_image(path: Path, anchor: str) -> str:
    image = yaml.safe_load(path.read_text())[anchor]["image"]
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", image)


def check_images(objects, variant: str) -> None:
    want = (
        _compose_image(COMPOSE, "x-service")
        if variant == "base"
        else _compose_image(COMPOSE_GPU, "x-cuda-image")
    )
    images = {
        c["name"]: c["image"] for key in (DECODER, GATEWAY) for c in _pod_containers(objects[key])
    }
    assert set(images.values()) == {want}, f"{variant}: images {images}, compose builds {want}"


def check_gpu(objects, variant: str) -> None:
    gpus = {
        c["name"]: (c["resources"].get("requests", {}).get(GPU), c["resources"]["limits"].get(GPU))
        for key in (DECODER, GATEWAY)
        for c in _pod_containers(objects[key])
    }
    if variant == "base":
        assert set(gpus.values()) == {(None, None)}, f"base: GPUs {gpus}"
        return
    assert gpus.pop("decoder") == ("1", "1"), "gpu: the decoder needs one GPU"
    assert set(gpus.values()) == {(None, None)}, f"gpu: only the decoder takes a GPU: {gpus}"
    # Replacing a Pod frees its GPU first (no surge Pod waiting for a free one).
    assert objects[DECODER]["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


# -- tests ---------------------------------------------------------------------------------


def test_renderer_matches_kustomize(variant):
    binary = _kustomize_binary()
    if binary is None:
        pytest.skip("no kustomize or kubectl binary: only this test's renderer is used")
    proc = subprocess.run(
        [*binary, str(KUSTOMIZATIONS[variant])],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"{' '.join(binary)} failed:\n{proc.stderr}"
    theirs = _index([doc for doc in yaml.safe_load_all(proc.stdout) if doc])
    ours = _index(render(KUSTOMIZATIONS[variant]))
    assert set(ours) == set(theirs)
    for key in ours:
        assert ours[key] == theirs[key], (
            f"{variant}: {key} renders differently here than with {binary[0]}"
        )


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_objects_are_valid_kubernetes(variant, objects, version):
    for key, obj in objects.items():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.path)
            raise AssertionError(
                f"{variant}: {key} at {path}: {exc.message} (Kubernetes {version})"
            ) from None


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_kubernetes(path, version):
    for obj in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_rejects_unknown_fields(objects):
    # The validator is strict: a misspelt field fails instead of being ignored.
    broken = copy.deepcopy(objects[DECODER])
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 1}}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


def test_objects(objects):
    check_objects(objects)


@pytest.mark.parametrize("service", ["materializer", "decoder", "gateway"])
def test_command_matches_launcher(objects, service):
    check_command(objects, service)


@pytest.mark.parametrize("service", ["materializer", "decoder", "gateway"])
def test_environment_matches_launcher(objects, service):
    check_environment(objects, service)


def test_decoder_and_materializer_share_shm_and_sockets(objects):
    check_shared_memory_and_sockets(objects)


def test_probes_use_the_listen_ports(objects):
    check_probes(objects)


def test_gateway_finds_every_decoder_through_the_headless_service(objects):
    check_decoder_service(objects)


def test_gateway_deployment_and_services(objects):
    check_gateway(objects)


def test_checkpoint_is_mounted_read_only(objects):
    check_checkpoint(objects)


def test_security_context_and_resources(objects):
    check_security_and_resources(objects)


def test_disruption_budget_and_network_policy(objects):
    check_disruption_budget_and_network_policy(objects)


def test_images_are_the_ones_compose_builds(objects, variant):
    check_images(objects, variant)


def test_gpu_only_in_the_overlay_and_only_for_the_decoder(objects, variant):
    check_gpu(objects, variant)


# -- the checks fail on broken manifests -----------------------------------------------


def _decoder(o):
    return _container(o, DECODER, "decoder")


def _materializer(o):
    return _container(o, DECODER, "materializer")


def _gateway(o):
    return _container(o, GATEWAY, "gateway")


def _replace_arg(container: dict, old: str, new: str) -> None:
    container["command"] = [new if a == old else a for a in container["command"]]


def _set_configmap(o, key, value):
    o[CONFIGMAP]["data"][key] = value


BREAKAGES: dict[str, tuple[Callable[[dict], None], Callable[[dict], None]]] = {
    "decoder probe on another port": (
        lambda o: _decoder(o)["readinessProbe"]["grpc"].update(port=50053),
        check_probes,
    ),
    "decoder liveness on readiness": (
        lambda o: _decoder(o)["livenessProbe"]["grpc"].pop("service"),
        check_probes,
    ),
    "materializer probe on another socket": (
        lambda o: _materializer(o)["livenessProbe"]["exec"]["command"].__setitem__(
            3, "unix:///tmp/x.sock"
        ),
        check_probes,
    ),
    "gateway liveness on its decoders' health": (
        lambda o: _gateway(o)["livenessProbe"]["grpc"].pop("service"),
        check_probes,
    ),
    "gateway liveness on the TCP port only": (
        lambda o: _gateway(o).update(livenessProbe={"tcpSocket": {"port": 50051}}),
        check_probes,
    ),
    "decoder listening on another port": (
        lambda o: _replace_arg(_decoder(o), "0.0.0.0:50052", "0.0.0.0:50053"),
        check_decoder_service,
    ),
    "gateway dialing a ClusterIP name": (
        lambda o: _replace_arg(
            _gateway(o),
            "dns:///omni-decoder.$(POD_NAMESPACE).svc.cluster.local:50052",
            "omni-decoder:50052",
        ),
        check_decoder_service,
    ),
    "decoder Service with a virtual IP": (
        lambda o: o[DECODER_SERVICE]["spec"].pop("clusterIP"),
        check_decoder_service,
    ),
    "a flag the launcher does not pass": (
        lambda o: _decoder(o)["command"].extend(["--max-num-seqs", "8"]),
        lambda o: check_command(o, "decoder"),
    ),
    "another engine in the ConfigMap": (
        lambda o: _set_configmap(o, "OMNI_ENGINE", "fake"),
        lambda o: check_command(o, "decoder"),
    ),
    "a reference to a variable nobody sets": (
        lambda o: _replace_arg(_materializer(o), "$(OMNI_MATERIALIZER_IMPL)", "$(OMNI_IMPL)"),
        lambda o: check_command(o, "materializer"),
    ),
    "materializer without the shared /dev/shm": (
        lambda o: _materializer(o)["volumeMounts"].remove(_mounts(_materializer(o))["/dev/shm"]),
        check_shared_memory_and_sockets,
    ),
    "/dev/shm too small for two arenas": (
        lambda o: _set_configmap(o, "OMNI_ARENA_SLOTS", "64"),
        check_shared_memory_and_sockets,
    ),
    "sockets on separate volumes": (
        lambda o: _mounts(_materializer(o))[RUNTIME].update(name="tmp"),
        check_shared_memory_and_sockets,
    ),
    "node IPC namespace": (
        lambda o: _pod_spec(o, DECODER).update(hostIPC=True),
        check_shared_memory_and_sockets,
    ),
    "checkpoint mounted writable": (
        lambda o: _mounts(_decoder(o))[CHECKPOINT].pop("readOnly"),
        check_checkpoint,
    ),
    "container running as root": (
        lambda o: _pod_spec(o, GATEWAY)["securityContext"].update(runAsUser=0),
        check_security_and_resources,
    ),
    "decoder port open to every Pod": (
        lambda o: o[NETWORK_POLICY]["spec"]["ingress"][0].pop("from"),
        check_disruption_budget_and_network_policy,
    ),
    "gateway Service on another target port": (
        lambda o: o[GATEWAY_SERVICES[0]]["spec"]["ports"][1].update(targetPort=8080),
        check_gateway,
    ),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_checks_catch_broken_manifests(breakage):
    objects = _index(render(KUSTOMIZATIONS["base"]))
    break_it, check = BREAKAGES[breakage]
    check(objects)  # passes on the shipped manifests
    break_it(objects)
    with pytest.raises(AssertionError):
        check(objects)


# -- the manifests' command lines, run as processes --------------------------------------


def _wait(
    ready: Callable[[], bool], what: str, procs: list[subprocess.Popen], timeout_s: float = 120
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        dead = [p.args[2] for p in procs if p.poll() is not None]
        assert not dead, f"{dead} exited while waiting for {what}"
        time.sleep(0.5)
    raise AssertionError(f"{what}: not ready within {timeout_s}s")


def _tcp_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.e2e
def test_manifest_command_lines_serve_speech():
    """The three containers' command lines, as the kubelet would run them, serve a Speak.

    Run here as processes: the fake engine (no checkpoint in CI), paths and
    ports moved to this host, the Pod IPs to loopback, the decoder Service's
    DNS name to localhost (a dns:/// target all the same), and a deployment
    name of its own. The probes are the manifests' own: the materializer's
    exec command, grpc health on the decoder's and the gateway's ports, and a
    TCP connect for the gateway's liveness.
    """
    from omni_cli.probe import check

    objects = _index(render(KUSTOMIZATIONS["base"]))
    objects[CONFIGMAP]["data"]["OMNI_ENGINE"] = "fake"
    objects[CONFIGMAP]["data"]["OMNI_DEPLOYMENT"] = f"k8s{os.getpid()}"
    run = Path(tempfile.mkdtemp(prefix="omni-k8s-", dir="/tmp"))  # UDS paths are short
    ports = {"grpc": free_port(), "http": free_port(), "decoder": free_port()}
    ports |= {"decoder-metrics": free_port(), "materializer-metrics": free_port()}

    def local(argv: list[str]) -> list[str]:
        module, flags = _split(argv)
        out = {}
        for flag, value in flags.items():
            value = value.replace(RUNTIME, str(run)).replace("0.0.0.0", "127.0.0.1")
            value = value.replace(
                f"{DECODER_SERVICE[1]}.{NAMESPACE}.svc.cluster.local", "localhost"
            )
            value = value.replace(f":{DECODER_PORT}", f":{ports['decoder']}")
            out[flag] = value
        if module == "gateway":
            out["--listen"] = f"127.0.0.1:{ports['grpc']}"
            out["--http-port"] = str(ports["http"])
        if module == "decoder_svc":
            out["--model"] = str(run / "checkpoint")
        if "--metrics-port" in out:
            out["--metrics-port"] = str(ports[f"{module.removesuffix('_svc')}-metrics"])
        return [sys.executable, "-m", module, *(a for kv in out.items() for a in kv)]

    def environ(key, name) -> dict[str, str]:
        env = _env(objects, key, _container(objects, key, name))
        env["OMNI_SERVING_MODEL_DIR"] = str(run / "models")
        return {**os.environ, **env}

    (run / "checkpoint").mkdir()
    procs: list[subprocess.Popen] = []
    try:
        for key, name in ((DECODER, "materializer"), (DECODER, "decoder"), (GATEWAY, "gateway")):
            argv = local(_argv(objects, key, name))
            with (run / f"{name}.log").open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        argv, env=environ(key, name), stdout=log, stderr=subprocess.STDOUT
                    )
                )
            if name == "materializer":
                probe = _container(objects, key, name)["readinessProbe"]["exec"]["command"]
                probe = [sys.executable, *probe[1:3], probe[3].replace(RUNTIME, str(run))]
                _wait(
                    lambda probe=probe: (
                        subprocess.run(probe, capture_output=True, check=False).returncode == 0
                    ),
                    "materializer exec probe",
                    procs,
                )
            else:
                port = ports["decoder"] if name == "decoder" else ports["grpc"]
                _wait(lambda port=port: _grpc_serving(check, port), f"{name} grpc probe", procs)
        assert _tcp_open(ports["grpc"]), "gateway liveness (tcpSocket)"
        speak = subprocess.run(
            [
                sys.executable,
                "-m",
                "omni_cli.main",
                "speak",
                "Hello there",
                "-o",
                str(run / "hello.wav"),
                "--target",
                f"127.0.0.1:{ports['grpc']}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert speak.returncode == 0, f"speak failed: {speak.stdout}{speak.stderr}"
        assert (run / "hello.wav").stat().st_size > 44, "no audio"
    except AssertionError as exc:
        logs = {log.stem: log.read_text(errors="replace")[-2000:] for log in run.glob("*.log")}
        raise AssertionError(f"{exc}\nlogs: {logs}") from None
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(run, ignore_errors=True)


def _grpc_serving(check, port: int) -> bool:
    try:
        return check(f"127.0.0.1:{port}", timeout_s=1.0) == "SERVING"
    except Exception:  # noqa: BLE001 - not up yet
        return False
