"""`omni-serving bench <suite> [--quick] [--out DIR]`.

Suites: step-gap, handoff, e2e, all. Each writes a results file (the raw
numbers, settings, command line, commit and host: bench/record.py) into
bench/results/ (to be committed), and results.md and PNG plots into its run
folder (default bench/results/<suite>-<timestamp>/, not committed; `all`
puts one subfolder per suite there plus summary.md with every table and the
targets). With --out, the results file goes into the run folder too, and
nothing into bench/results/. Progress bars go to stderr.

`--slug NAME` names the results file. `omni-serving bench report [--check]`
regenerates bench/RESULTS.md from the results files that
bench/results/INDEX.yaml names (bench/report.py); `--check` fails when
RESULTS.md differs from what the files give.

`checkpoint` (not part of all) serves one checkpoint as a user would
(`--checkpoint DIR`, e.g. one written by `omni-serving models create
--preset released`) and records its memory plan, resident memory per
process, TTFP per concurrency, step composition and Code2Wav's RTF.

`code-predictor`, `media-input`, `realtime`, `threads` and `tts` (not part of
all) have their own options (`omni-serving bench code-predictor --help`, `...
media-input --help`, `... realtime --help`, `... threads --help`, `... tts
--help`) and write their results files the same way.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

SUITES = ("step-gap", "handoff", "e2e")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omni-serving bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=(*SUITES, "all", "breakdown", "checkpoint", "code-predictor"),
                   help="which benchmark to run (breakdown: a diagnostic of the critical path, not part of all; "
                        "checkpoint: one checkpoint served, not part of all; "
                        "code-predictor, media-input, realtime, threads, tts: their own options, see "
                        "`<suite> --help`)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes for CI (batch 1 and 4, payloads up to 1 MiB, concurrency 1 and 4, fake engine)")
    p.add_argument("--out", default="", help="run folder (default bench/results/<suite>-<timestamp>/); "
                                             "the results file goes there too instead of bench/results/")
    p.add_argument("--slug", default="", help="names the results file: <date>-<suite>-<slug>.json "
                                              "(default: quick or full)")
    p.add_argument("--engine", choices=("auto", "vllm", "fake"), default="auto",
                   help="AR engine for step-gap and e2e (auto: vllm for full runs, fake for --quick)")
    p.add_argument("--model-dir", default="",
                   help="step-gap: folder for the hidden-2048 talker checkpoint (default: the user cache)")
    p.add_argument("--batch", type=int, default=0, help="breakdown: batch size (default: the largest step-gap batch)")
    p.add_argument("--e2e-model-dir", default="",
                   help="e2e: checkpoints folder given to the decoder (default: the tts profile's own tiny models)")
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="e2e: decoder + materializer pairs per stack (omni-serving up --replicas; default 1)")
    p.add_argument("--failover", action="store_true",
                   help="e2e: then SIGKILL one decoder of the async stack under load and measure the time "
                        "until requests succeed again (needs --replicas 2 or more)")
    p.add_argument("--checkpoint", default="", metavar="DIR",
                   help="checkpoint: the checkpoint directory to serve (only read; default: the model cache's "
                        "tiny checkpoint)")
    p.add_argument("--concurrency", default="", metavar="C[,C...]",
                   help="e2e and checkpoint: client concurrency levels (default: e2e 1,16,64, --quick 1,4; "
                        "checkpoint 1,16, --quick 1,2)")
    p.add_argument("--requests", default="", metavar="N[,N...]",
                   help="e2e and checkpoint: requests per level, one count for every level or one per "
                        "--concurrency level (default: e2e 16/96/384, --quick 3/8; checkpoint 4/32, --quick 2/2)")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="e2e: run every level N times, the order of the stacks rotating; the targets' ratios are "
                        "the medians over the rounds (default 1)")
    p.add_argument("--no-omni", action="store_true",
                   help="e2e: skip the omni variant (thinker -> talker -> code2wav through Generate)")
    p.add_argument("--first-chunk", type=int, default=0, metavar="FRAMES",
                   help="e2e: every request fixes its first audio chunk at this many codec frames "
                        "(sampling_params.first_chunk_frames; default 0: the deployment chooses by load)")
    return p


def request_counts(args: argparse.Namespace) -> tuple[int, ...]:
    """--requests as integers (checked by main)."""
    return tuple(int(n) for n in str(args.requests).split(",") if n.strip())


def run_suite(name: str, args: argparse.Namespace, out_dir: Path):
    concurrency = tuple(int(c) for c in args.concurrency.split(",") if c.strip())
    if name == "step-gap":
        from bench import step_gap

        return step_gap.run(step_gap.StepGapConfig.for_run(args.quick, args.engine, args.model_dir), out_dir)
    if name == "handoff":
        from bench import handoff

        return handoff.run(handoff.HandoffConfig.for_run(args.quick), out_dir)
    if name == "e2e":
        from bench import e2e

        return e2e.run(e2e.E2EConfig.for_run(args.quick, args.engine, args.e2e_model_dir, args.replicas,
                                             args.failover, concurrency, request_counts(args), args.first_chunk,
                                             args.rounds, omni=not args.no_omni), out_dir)
    if name == "checkpoint":
        from bench import checkpoint

        counts = request_counts(args)
        return checkpoint.run(checkpoint.CheckpointConfig.for_run(args.quick, args.checkpoint, concurrency,
                                                                  counts[0] if counts else 0), out_dir)
    if name == "breakdown":
        from bench import breakdown, step_gap

        batch = args.batch or max(step_gap.StepGapConfig.for_run(args.quick, args.engine).batches)
        return breakdown.run(args.quick, args.engine, batch, out_dir)
    raise ValueError(name)


def save_record(res, args: argparse.Namespace, argv: list[str], out: Path, wall_s: float) -> Path:  # noqa: ANN001
    """Writes a suite's results file: into bench/results/, or the run folder with --out."""
    from bench import record

    if res.record is None:  # every suite writes one: docs/benchmarks.md, "A new suite"
        raise RuntimeError(f"{res.suite}: the suite returned no results file record (bench.record.begin / "
                           "complete, and SuiteResult.record): docs/benchmarks.md, 'Results files'")
    return record.save(res.record, out if args.out else record.RESULTS_DIR, slug=args.slug, argv=argv, wall_s=wall_s)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:
        from bench.report import main as report_main

        return report_main(argv[1:])
    if argv[:1] == ["code-predictor"]:
        from bench import code_predictor

        return code_predictor.main(argv[1:])
    if argv[:1] == ["media-input"]:
        from bench import media_input

        return media_input.main(argv[1:])
    if argv[:1] == ["realtime"]:
        from bench import realtime

        return realtime.main(argv[1:])
    if argv[:1] == ["threads"]:
        from bench import threads

        return threads.main(argv[1:])
    if argv[:1] == ["tts"]:
        from bench import tts

        return tts.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replicas < 1:
        parser.error(f"--replicas: must be >= 1, got {args.replicas}")
    if args.failover and args.replicas < 2:
        parser.error("--failover: needs --replicas 2 or more (a decoder is killed while another serves)")
    try:
        if any(int(c) < 1 for c in args.concurrency.split(",") if c.strip()):
            raise ValueError
    except ValueError:
        parser.error(f"--concurrency: expected positive integers separated by commas, got {args.concurrency!r}")
    try:
        counts = request_counts(args)
        if any(n < 1 for n in counts):
            raise ValueError
    except ValueError:
        parser.error(f"--requests: expected positive integers separated by commas, got {args.requests!r}")
    if len(counts) > 1:
        from bench.e2e import E2EConfig

        levels = [c for c in args.concurrency.split(",") if c.strip()] or E2EConfig.for_run(args.quick).concurrency
        if args.suite != "e2e" or len(counts) != len(levels):
            parser.error(f"--requests: {len(counts)} counts for {len(levels)} e2e concurrency levels "
                         "(give one count, or one per e2e level)")
    if args.rounds < 1:
        parser.error(f"--rounds: must be >= 1, got {args.rounds}")
    if args.first_chunk < 0:
        parser.error(f"--first-chunk: must be >= 0 frames, got {args.first_chunk}")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from bench.common import RESULTS_ROOT, log, results_dir, targets_md, timestamp

    t0 = time.perf_counter()
    if args.suite != "all":
        out = results_dir(args.suite, args.out or None)
        res = run_suite(args.suite, args, out)
        saved = save_record(res, args, argv, out, time.perf_counter() - t0)
        log(f"{args.suite}: done in {time.perf_counter() - t0:.0f}s; results in {out}")
        print(targets_md(res.targets))
        print(f"\nresults: {out}\nresults file: {saved}")
        return 0
    root = Path(args.out) if args.out else RESULTS_ROOT / f"all-{timestamp()}"
    root.mkdir(parents=True, exist_ok=True)
    parts, targets = [], []
    for name in SUITES:
        t = time.perf_counter()
        out = results_dir(name, str(root / name))
        res = run_suite(name, args, out)
        saved = save_record(res, args, argv, out, time.perf_counter() - t)
        log(f"{name}: done in {time.perf_counter() - t:.0f}s; results file {saved}")
        parts.append(res.markdown)
        targets += res.targets
    summary = ["# omni-serving benchmarks" + (" (quick)" if args.quick else ""), "",
               f"Total wall time: {time.perf_counter() - t0:.0f}s.", "", "## Targets", "", targets_md(targets), ""]
    for md in parts:
        summary += ["---", "", md]
    (root / "summary.md").write_text("\n".join(summary))
    print(targets_md(targets))
    print(f"\nresults: {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
