"""threads: the AR stage processes' thread budget, A/B under load.

    python -m bench.threads [--settings auto,1,auto/passive,1/passive] [--rounds 3]
                            [--profile omni] [--concurrency 16] [--requests 48] [--idle-s 5]
    (or omni-serving bench threads ...)

Each setting is the decoder's ``--stage-threads`` and ``--omp-wait-policy``
(``THREADS[/POLICY]``: ``auto`` = the decoder's default; ``passive`` /
``active`` = OMP_WAIT_POLICY; no policy = OpenMP's default). A round starts
one stack per setting, one at a time (the order rotates per round, so that
a slow moment of the host falls on a different setting each time): vLLM
serving the profile's tiny checkpoints, a warm-up of one request per client,
then

* **idle**: ``idle-s`` seconds with no request: the CPU the decoder (its
  stage processes and code2wav workers included) burns doing nothing, in
  cores;
* **load**: ``requests`` requests from ``concurrency`` closed-loop clients
  (Generate, text+audio, with the omni profile: thinker and talker
  processes compete for the cores; Speak with tts): throughput, time to
  first audio (p50, p90), the decoder's CPU per request, and every
  request's audio hash (it must not depend on the setting).

The stack is stopped before the next setting starts, so that no other
stack's processes spin beside it. What each stage process ran with is read
back from ``GetDecoderInfo`` (``engine_settings``: ``intra_op_threads``,
``omp_wait_policy``). The table gives the median over the rounds of each
measure with its spread, and each setting against the first.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import Any

import numpy as np

from bench import record
from bench.common import fmt, log, machine_md, md_table, pct, progress
from bench.e2e import Client, E2EConfig, cpu_snapshot, decoder_info

__all__ = ["analyze", "main", "parse_setting", "render", "run"]

MEASURES = (  # key, caption
    ("throughput_rps", "throughput (req/s)"),
    ("ttfp_p50_ms", "first audio p50 (ms)"),
    ("ttfp_p90_ms", "first audio p90 (ms)"),
    ("cpu_ms_per_request", "decoder CPU per request (ms)"),
    ("idle_cores", "decoder CPU at idle (cores)"),
)


def parse_setting(text: str) -> tuple[int, str]:
    """``THREADS[/POLICY]`` -> (threads, policy); 0 and "" for auto."""
    threads, _, policy = text.strip().partition("/")
    policy = policy.strip().lower()
    if policy not in ("", "auto", "passive", "active"):
        raise ValueError(f"{text!r}: the wait policy must be passive, active or auto")
    if threads.strip() in ("", "auto"):
        n = 0
    else:
        try:
            n = int(threads)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{text!r}: the threads must be auto or an integer >= 1")
    return n, "" if policy == "auto" else policy


def decoder_args(setting: str) -> list[str]:
    threads, policy = parse_setting(setting)
    return ["--stage-threads", str(threads) if threads else "auto", "--omp-wait-policy", policy or "auto"]


def _stage_threads(target: str) -> dict[str, dict[str, str]]:
    """Each stage's thread budget as GetDecoderInfo reports it (stages that say one)."""
    keys = ("intra_op_threads", "omp_wait_policy")
    return {st["name"]: {k: st["engine_settings"][k] for k in keys if k in st["engine_settings"]}
            for st in decoder_info(target)["stages"] if "intra_op_threads" in st["engine_settings"]}


def _decoder_cpu(stack: Any) -> float:
    """CPU seconds so far of the stack's decoders (their stage processes and code2wav workers included)."""
    return sum(v for name, v in cpu_snapshot(stack).items() if name.startswith("decoder"))


def _one(setting: str, profile: str, engine: str, concurrency: int, requests: int, idle_s: float,
         tag: str) -> dict[str, Any]:
    """One stack with `setting`: warm-up, idle, load."""
    from omni_stack.config import StackConfig
    from omni_stack.stack import Stack

    cfg = E2EConfig(engine=engine, max_tokens=32, omni_text_tokens=16, omni_audio_frames=32)
    call = "generate" if profile == "omni" else "speak"
    max_tokens = cfg.omni_text_tokens if call == "generate" else cfg.max_tokens
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as runtime:
        stack = Stack(StackConfig(profile=profile, engine=engine, port=0, http_port=0, runtime_dir=runtime,
                                  log_level="WARNING", extra_decoder_args=decoder_args(setting),
                                  deployment=f"benchthreads{tag}"))
        client = None
        try:
            stack.start(timeout_s=600)
            client = Client(stack.gateway_target, cfg)
            client.run_level(list(range(concurrency)), concurrency, max_tokens, f"warm-{tag}", call=call)
            time.sleep(1.0)  # the warm-up's last chunks and bookkeeping
            c0, t0 = _decoder_cpu(stack), time.perf_counter()
            time.sleep(idle_s)
            idle_cores = (_decoder_cpu(stack) - c0) / (time.perf_counter() - t0)
            c0 = _decoder_cpu(stack)
            reqs = client.run_level(list(range(requests)), concurrency, max_tokens, f"load-{tag}", call=call)
            cpu = _decoder_cpu(stack) - c0
            stages = _stage_threads(stack.decoder_target)
        finally:
            if client is not None:
                client.close()
            problems = stack.stop()
    first = [r["first_audio_s"] if call == "generate" else r["ttfp_s"] for r in reqs]
    wall = max(r["end"] for r in reqs) - min(r["start"] for r in reqs)
    return {"setting": setting, "stages": stages, "idle_cores": idle_cores, "requests": len(reqs),
            "wall_s": wall, "decoder_cpu_s": cpu, "first_audio_s": first,
            "hashes": {str(r["index"]): r["sha256"] for r in reqs}, "stop_problems": problems}


def run(settings: list[str], rounds: int = 3, profile: str = "omni", engine: str = "vllm", concurrency: int = 16,
        requests: int = 48, idle_s: float = 5.0, quick: bool = False) -> dict[str, Any]:
    """Measures and returns the completed record (bench/record.py)."""
    rec = record.begin("threads", quick=quick, settings={
        "settings": settings, "rounds": rounds, "profile": profile, "engine": engine,
        "concurrency": concurrency, "requests": requests, "idle_s": idle_s,
        "checkpoint": "the profile's tiny checkpoints (the model cache's)"})
    out: list[list[dict[str, Any]]] = []
    with progress(rounds * len(settings), "threads", "stack") as bar:
        for r in range(rounds):
            order = settings[r % len(settings):] + settings[: r % len(settings)]
            got = []
            for k, setting in enumerate(order):
                log(f"threads: round {r + 1}/{rounds}, {setting}")
                got.append(_one(setting, profile, engine, concurrency, requests, idle_s, f"{r}{k}"))
                bar.update(1)
            out.append(got)
    return record.complete(rec, {"rounds": out})


def _measures(cell: dict[str, Any]) -> dict[str, float]:
    first = [s * 1e3 for s in cell["first_audio_s"] if s == s]
    return {"throughput_rps": cell["requests"] / cell["wall_s"], "ttfp_p50_ms": pct(first, 50),
            "ttfp_p90_ms": pct(first, 90), "cpu_ms_per_request": cell["decoder_cpu_s"] / cell["requests"] * 1e3,
            "idle_cores": cell["idle_cores"]}


def analyze(rec: dict[str, Any]) -> dict[str, Any]:
    """Per setting and measure: the median over the rounds, the spread, and
    the ratio to the first setting's median; whether the audio is equal."""
    settings = rec["settings"]["settings"]
    cells: dict[str, list[dict[str, Any]]] = {s: [] for s in settings}
    for rnd in rec["raw"]["rounds"]:
        for cell in rnd:
            cells[cell["setting"]].append(cell)
    per: dict[str, Any] = {}
    for s, got in cells.items():
        ms = [_measures(c) for c in got]
        per[s] = {k: {"median": float(np.median([m[k] for m in ms])), "min": min(m[k] for m in ms),
                      "max": max(m[k] for m in ms)} for k, _ in MEASURES}
        per[s]["stages"] = got[0]["stages"] if got else {}
    base = per[settings[0]]
    for s in settings:
        per[s]["vs_first"] = {k: per[s][k]["median"] / base[k]["median"] if base[k]["median"] else float("nan")
                              for k, _ in MEASURES}
    hashes = [c["hashes"] for rnd in rec["raw"]["rounds"] for c in rnd]
    same = sum(1 for i in hashes[0] if len({h.get(i) for h in hashes}) == 1) if hashes else 0
    return {"per_setting": per, "settings": rec["settings"], "hashes_equal": same,
            "hashes_total": len(hashes[0]) if hashes else 0, "machine": rec["host"], "date": rec["date"],
            "load_average": rec["run"]["load_average_end"]}


def render(rec: dict[str, Any]) -> str:
    """The table from a results file (what `bench report` shows)."""
    res = analyze(rec)
    s = res["settings"]
    call = "Generate (text+audio)" if s["profile"] == "omni" else "Speak"
    head = (f"The {s['profile']} profile on {'vLLM' if s['engine'] == 'vllm' else 'the fake engine'}, one stack at "
            f"a time; per setting and round: {s['idle_s']:g} s idle, then {s['requests']} {call} requests from "
            f"{s['concurrency']} clients. Medians of {s['rounds']} rounds (the order rotating), spread "
            f"min-max; the ratio is to the first setting. Load average at the end {res['load_average']}.")
    rows = []
    for name, per in res["per_setting"].items():
        ran = ", ".join(f"{st} {v.get('intra_op_threads', '?')}/{v.get('omp_wait_policy', '?')}"
                        for st, v in per["stages"].items())
        row = [f"`{name}`", ran]
        for key, _ in MEASURES:
            m = per[key]
            row.append(f"{fmt(m['median'])} ({fmt(m['min'])}-{fmt(m['max'])}) {per['vs_first'][key]:.2f}x")
        rows.append(row)
    table = md_table(["setting", "stages ran with (threads/policy)", *(c for _, c in MEASURES)], rows)
    same = (f"Audio and text equal across every setting and round for {res['hashes_equal']} of "
            f"{res['hashes_total']} requests (seeded; the first chunk depends on the load at a request's start).")
    return f"{head}\n\n{table}\n\n{same}\n\n{machine_md(res['machine'], res['date'])}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-serving bench threads", description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default="auto,1,auto/passive,1/passive",
                        help="THREADS[/POLICY],...: the decoder's --stage-threads and --omp-wait-policy per setting; "
                             "the first is the one the others are compared with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", default="omni", choices=("omni", "tts"))
    parser.add_argument("--engine", default="vllm", choices=("vllm", "fake"))
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=48, help="requests per setting and round")
    parser.add_argument("--idle-s", type=float, default=5.0, help="idle seconds measured per setting and round")
    parser.add_argument("--quick", action="store_true", help="fake engine, 2 settings, 1 round: a tooling check")
    parser.add_argument("--out", default=None, help="folder for the results file (default: bench/results/)")
    parser.add_argument("--slug", default="", help="names the results file (default: full, or quick)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    try:
        settings = [s.strip() for s in args.settings.split(",") if s.strip()]
        for s in settings:
            parse_setting(s)
    except ValueError as exc:
        parser.error(f"--settings: {exc}")
    if not settings or len(set(settings)) != len(settings):
        parser.error(f"--settings: expected distinct settings separated by commas, got {args.settings!r}")
    if args.rounds < 1 or args.concurrency < 1 or args.requests < 1 or args.idle_s <= 0:
        parser.error("--rounds, --concurrency and --requests must be >= 1, --idle-s > 0")
    if args.quick:
        args.engine, settings, args.rounds, args.concurrency, args.requests, args.idle_s = (
            "fake", settings[:2], 1, 2, 4, 0.5)
    t0 = time.perf_counter()
    rec = run(settings, args.rounds, args.profile, args.engine, args.concurrency, args.requests, args.idle_s,
              args.quick)
    record.publish(rec, render(rec), out=args.out, slug=args.slug, argv=argv, suite="threads", started=t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
