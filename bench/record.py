"""Results files: what a benchmark run leaves to be committed, and reading
them back.

A results file is one JSON object (schema `SCHEMA`):

    schema    this format's version
    suite     step-gap | handoff | e2e | breakdown | code2wav-stream | ...
    quick     a --quick run (a tooling check: its times are not figures)
    date      when the run started (ISO 8601, with the UTC offset)
    run       command (a command line that repeats the run), argv, wall_s,
              git {commit, dirty, changed: the paths that made it dirty},
              load_average_start / load_average_end (1, 5, 15 min)
    host      processor model, logical / physical / available cores, the
              AVX2 / AVX-512 / AMX flags, RAM, OS, Python, torch, vLLM,
              grpcio, protobuf, numpy versions (bench.common.machine_info)
    settings  what the run was asked to do (the suite's config)
    raw       what it measured: per step, per request, per sample numbers
              and the facts the services reported, never only summaries

Layout: `bench/results/<YYYYMMDD-HHMM>-<suite>-<slug>.json` (UTC start
time; the slug names the run: `--slug`, default `quick` or `full`), written
as `.json.gz` when the JSON is over GZIP_ABOVE bytes. Run folders (plots,
results.md) are `bench/results/<suite>-<timestamp>/` and are not committed.

Invariants:
- A suite renders its tables from the record as the file holds it
  (`complete` returns the JSON round trip of what it was given: tuples are
  lists, int keys are strings, NaN is null), so the run's results.md and
  `bench report` compute the same figures from the same numbers.
- Writing is deterministic for a record: keys in insertion order, gzip with
  no name and mtime 0.
- `load` validates the common fields and names the file and the field
  that is wrong; the suite's own `analyze` reads `raw`.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import io
import json
import math
import os
import re
import shlex
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import RESULTS_ROOT, _jsonable, log, machine_info

SCHEMA = 1
RESULTS_DIR = RESULTS_ROOT
GZIP_ABOVE = 256 * 2**10  # plain JSON below this (readable in a diff), gzip above
COMMIT_LIMIT = 4 * 2**20  # a file above this is too big to commit: the writer says so
REPO_ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = (".json", ".json.gz")


class RecordError(ValueError):
    """A results file that cannot be read as one: names the file and the field."""


# -- making a record ------------------------------------------------------------


def normalize(obj: Any) -> Any:
    """`obj` as a results file gives it back (the JSON round trip)."""
    return json.loads(json.dumps(_jsonable(obj), allow_nan=False))


def git_state(root: Path = REPO_ROOT) -> dict[str, Any]:
    """The commit checked out at `root`, and whether the tree differs from it
    (results files under bench/results/ do not count: a run writes them)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain=v1", "--untracked-files=normal")
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None, "changed": []}
    changed = [line[3:] for line in status.splitlines() if line[3:] and not line[3:].startswith("bench/results/")]
    return {"commit": commit, "dirty": bool(changed), "changed": changed[:50]}


def _load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def begin(suite: str, *, quick: bool, settings: dict[str, Any]) -> dict[str, Any]:
    """A record's facts at the start of a run (before any measurement)."""
    return {
        "schema": SCHEMA,
        "suite": suite,
        "quick": bool(quick),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "run": {"command": "", "argv": [], "wall_s": None, "git": git_state(),
                "load_average_start": _load_average(), "load_average_end": None},
        "host": machine_info(),
        "settings": normalize(settings),
    }


def complete(record: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """The record with its raw numbers, as the file will hold it."""
    out = normalize({**record, "raw": raw})
    out["run"]["load_average_end"] = _load_average()
    return out


def file_name(record: dict[str, Any], slug: str) -> str:
    start = _dt.datetime.fromisoformat(record["date"]).astimezone(_dt.UTC)
    slug = re.sub(r"[^a-z0-9]+", "-", slug.lower()).strip("-") or ("quick" if record["quick"] else "full")
    return f"{start:%Y%m%d-%H%M}-{record['suite']}-{slug}"


def dumps(obj: Any, indent: int = 0) -> str:
    """JSON with one key per line, and lists of numbers or strings on one line
    (raw samples stay compact and a diff stays readable)."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(str(k))}: {dumps(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        return "[\n" + ",\n".join(inner + dumps(v, indent + 1) for v in obj) + f"\n{pad}]"
    return json.dumps(obj, allow_nan=False)


def encode(record: dict[str, Any]) -> tuple[bytes, str]:
    """(bytes, suffix) of a record's file: plain JSON, or gzip above GZIP_ABOVE."""
    text = (dumps(record) + "\n").encode()
    if len(text) <= GZIP_ABOVE:
        return text, ".json"
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(text)
    return buf.getvalue(), ".json.gz"


def save(record: dict[str, Any], folder: Path, *, slug: str = "", argv: Sequence[str] = (),
         program: str = "python -m bench", wall_s: float | None = None) -> Path:
    """Writes a completed record into `folder` (never over another file) and
    returns its path. `program` + `argv` is the command line that repeats it."""
    record["run"]["argv"] = list(argv)
    record["run"]["command"] = " ".join([program, shlex.join(argv)]).strip()
    record["run"]["wall_s"] = None if wall_s is None else round(wall_s, 3)
    data, suffix = encode(record)
    folder.mkdir(parents=True, exist_ok=True)
    base = file_name(record, slug)
    path = folder / f"{base}{suffix}"
    n = 2
    while path.exists():
        path = folder / f"{base}-{n}{suffix}"
        n += 1
    path.write_bytes(data)
    if len(data) > COMMIT_LIMIT:
        log(f"{path.name}: {len(data) / 2**20:.1f} MiB, over the {COMMIT_LIMIT // 2**20} MiB a committed results "
            "file may weigh: run fewer requests or steps before committing it")
    return path


def publish(record: dict[str, Any], table: str, *, out: str | None, slug: str, argv: Sequence[str], suite: str,
            started: float) -> Path:
    """What a suite with its own command line does at its end: print its
    table, save its results file (into `out`, or bench/results/) with the
    command that repeats it, print the file's path."""
    print(table)
    path = save(record, Path(out) if out else RESULTS_DIR, slug=slug, argv=argv,
                program=f"omni-serving bench {suite}", wall_s=time.perf_counter() - started)
    print(f"results file: {path}")
    return path


# -- reading one ----------------------------------------------------------------


def _field(record: Any, dotted: str, kinds: tuple[type, ...], where: str) -> Any:
    value: Any = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise RecordError(f"{where}: field {dotted!r} is missing")
        value = value[part]
    if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool) and int in kinds):
        names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise RecordError(f"{where}: field {dotted!r} must be {names}, got {type(value).__name__} {value!r:.60}")
    return value


REQUIRED: tuple[tuple[str, tuple[type, ...]], ...] = (
    ("suite", (str,)), ("quick", (bool,)), ("date", (str,)),
    ("run.command", (str,)), ("run.argv", (list,)), ("run.wall_s", (int, float, type(None))),
    ("run.git.commit", (str,)), ("run.git.dirty", (bool, type(None))), ("run.git.changed", (list,)),
    ("host.cpu_model", (str,)), ("host.hostname_cores", (int,)), ("host.cores_available", (int,)),
    ("host.cpu_flags", (list,)), ("host.avx2", (bool,)), ("host.avx512", (bool,)),
    ("host.ram_gib", (int, float)), ("host.python", (str,)), ("host.torch", (str,)), ("host.vllm", (str,)),
    ("settings", (dict,)), ("raw", (dict,)),
)


def validate(record: Any, where: str) -> dict[str, Any]:
    """`record` if it has every common field with its type; RecordError naming
    the file and the field otherwise."""
    if not isinstance(record, dict):
        raise RecordError(f"{where}: a results file holds one JSON object, got {type(record).__name__}")
    schema = _field(record, "schema", (int,), where)
    if schema != SCHEMA:
        raise RecordError(f"{where}: field 'schema' is {schema}; this code reads schema {SCHEMA}")
    for dotted, kinds in REQUIRED:
        _field(record, dotted, kinds, where)
    try:
        _dt.datetime.fromisoformat(record["date"])
    except ValueError as exc:
        raise RecordError(f"{where}: field 'date' is not an ISO 8601 time: {record['date']!r}") from exc
    return record


def load(path: Path) -> dict[str, Any]:
    """A results file (.json or .json.gz), validated."""
    path = Path(path)
    if not path.name.endswith(SUFFIXES):
        raise RecordError(f"{path}: a results file is named *.json or *.json.gz")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RecordError(f"{path}: cannot be read ({exc.strerror})") from exc
    try:
        if path.name.endswith(".gz"):
            data = gzip.decompress(data)
        record = json.loads(data, parse_constant=lambda c: math.nan)
    except (OSError, EOFError, ValueError) as exc:
        raise RecordError(f"{path}: not a JSON{' gzip' if path.name.endswith('.gz') else ''} file ({exc})") from exc
    return validate(record, str(path))
