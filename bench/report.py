"""`python -m bench report [--check] [--index FILE] [--output FILE]`
(or `omni-serving bench report`): bench/RESULTS.md from the results files.

RESULTS.md is generated. Its sections are the results files that the index
(bench/results/INDEX.yaml) names, in the index's order:

    sections:
      - file: 20261203-1415-e2e-full.json.gz   # in the index's folder
        title: e2e on the tiny Qwen3-Omni      # optional (default: suite and date)
        note: |                                # optional: words, no figures
          Why this run was made, what to read in it.
        quick: true                            # only to show a --quick run

Each section shows the file's command line, commit (and whether the tree
was dirty), date and wall time, the settings, and the suite's own tables,
computed from the file's raw numbers by the suite's `render` (the function
the suite itself used for its run folder's results.md). A results file the
index does not name is not read (a local run left in the folder changes
nothing).

Invariants:
- The output is a pure function of the index and the files it names: no
  clock, no fact of the machine that runs the report, nothing else read.
- Every figure comes from a file. A note that carries a figure (a number
  with a unit: "1.3x", "15 ms", "91%") is refused; so is a --quick run
  (a tooling check) unless its entry says `quick: true`.
- `--check` exits 1 when the output file differs from what the files give
  (a figure edited by hand), 2 when the index or a file is wrong; the test
  suite runs it (tests/test_bench_report.py).

A new suite adopts the format by writing its record with bench/record.py
(`begin`, `complete`, `save`), giving its module a `render(record) -> str`
that computes its tables from `record["raw"]`, and adding it to RENDERERS.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from bench import record

RENDERERS = {
    "step-gap": "bench.step_gap",
    "handoff": "bench.handoff",
    "e2e": "bench.e2e",
    "breakdown": "bench.breakdown",
    "checkpoint": "bench.checkpoint",
    "code2wav-stream": "bench.code2wav_stream",
    "code-predictor": "bench.code_predictor",
    "media-input": "bench.media_input",
    "realtime": "bench.realtime",
    "threads": "bench.threads",
    "tts": "bench.tts",
}
INDEX = record.RESULTS_DIR / "INDEX.yaml"
RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"
ENTRY_KEYS = {"file", "title", "note", "quick"}
# a measured-looking figure: a number followed by a unit or an "x" ratio
FIGURE = re.compile(r"\d(?:[\d,]*\d)?(?:\.\d+)?\s*(?:x|%|ms|us|µs|ns|s|sec|seconds|minutes|GB/s|MB/s|GiB|MiB|KiB"
                    r"|req/s|rps)(?![\w/])")


class ReportError(ValueError):
    """The index or a results file it names is wrong: says which and why."""


@dataclasses.dataclass(frozen=True)
class Section:
    file: str
    title: str = ""
    note: str = ""
    quick: bool = False


def load_index(path: Path) -> list[Section]:
    """The index's sections, checked: known keys, files named once, notes
    without figures."""
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ReportError(f"{path}: cannot be read ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ReportError(f"{path}: not YAML ({exc})") from exc
    if doc is None:
        doc = {}
    if not isinstance(doc, dict) or set(doc) - {"sections"}:
        raise ReportError(f"{path}: the index is a mapping with one key, 'sections'")
    entries = doc.get("sections") or []
    if not isinstance(entries, list):
        raise ReportError(f"{path}: 'sections' must be a list, got {type(entries).__name__}")
    out: list[Section] = []
    for i, e in enumerate(entries, 1):
        where = f"{path}: sections[{i}]"
        if not isinstance(e, dict):
            raise ReportError(f"{where}: an entry is a mapping (file, title, note, quick)")
        unknown = sorted(set(e) - ENTRY_KEYS)
        if unknown:
            raise ReportError(f"{where}: unknown key(s) {unknown}; an entry has {sorted(ENTRY_KEYS)}")
        file = e.get("file")
        if not isinstance(file, str) or not file or "/" in file or not file.endswith(record.SUFFIXES):
            raise ReportError(f"{where}: 'file' must name a *.json or *.json.gz file in {path.parent}, got {file!r}")
        for key in ("title", "note"):
            if not isinstance(e.get(key, ""), str):
                raise ReportError(f"{where}: '{key}' must be text, got {type(e[key]).__name__}")
        if not isinstance(e.get("quick", False), bool):
            raise ReportError(f"{where}: 'quick' must be true or false, got {e['quick']!r}")
        figure = FIGURE.search(e.get("note", "")) or FIGURE.search(e.get("title", ""))
        if figure:
            raise ReportError(f"{where}: a title or note may not carry a figure ({figure.group(0)!r}); "
                              "figures come from the results file")
        if any(s.file == file for s in out):
            raise ReportError(f"{where}: {file} is already a section")
        out.append(Section(file, e.get("title", "").strip(), e.get("note", "").strip(), e.get("quick", False)))
    return out


def shift_headings(md: str, by: int) -> str:
    """Markdown headings `by` levels deeper (a suite's "# e2e" inside a section)."""
    return "\n".join("#" * by + line if re.match(r"#+ ", line) else line for line in md.splitlines())


def render_record(rec: dict[str, Any], where: str) -> str:
    """A suite's tables from its results file, by the suite's own code."""
    module = RENDERERS.get(rec["suite"])
    if module is None:
        raise ReportError(f"{where}: suite {rec['suite']!r} has no report renderer (known: {sorted(RENDERERS)})")
    try:
        return importlib.import_module(module).render(rec)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise ReportError(f"{where}: the {rec['suite']} suite cannot compute its tables from this file "
                          f"({type(exc).__name__}: {exc})") from exc


def run_facts(rec: dict[str, Any], link: str, name: str) -> list[str]:
    run, git = rec["run"], rec["run"]["git"]
    if git["dirty"] is None:
        tree = "(no git checkout: not known whether the tree was clean)"
    elif git["dirty"]:
        changed = git["changed"]
        tree = (f"(the tree had uncommitted changes: {', '.join(f'`{c}`' for c in changed[:10])}"
                + (f" and {len(changed) - 10} more" if len(changed) > 10 else "") + ")")
    else:
        tree = "(clean tree)"
    wall = f"; wall time {run['wall_s']:.0f} s" if run.get("wall_s") is not None else ""
    load = run.get("load_average_start"), run.get("load_average_end")
    loads = f"; load average (1, 5, 15 min) {load[0]} at the start, {load[1]} at the end" if load[0] else ""
    return [
        f"- Results file: [`{name}`]({link}) (suite `{rec['suite']}`)",
        f"- Command: `{run['command']}`",
        f"- Commit: `{git['commit']}` {tree}",
        f"- Started: {rec['date']}{wall}{loads}",
    ]


def section_md(n: int, s: Section, rec: dict[str, Any], link: str) -> str:
    title = s.title or f"{rec['suite']}, {rec['date']}"
    lines = [f"## {n}. {title}", ""]
    if s.note:
        lines += [s.note, ""]
    if rec["quick"]:
        lines += ["A `--quick` run: a check of the tooling; its times are not figures to read.", ""]
    lines += run_facts(rec, link, s.file)
    lines += ["", "<details><summary>Settings</summary>", "", "```json",
              record.dumps(rec["settings"]), "```", "", "</details>", ""]
    lines += [shift_headings(render_record(rec, s.file).strip(), 2), ""]
    return "\n".join(lines)


def generate(index: Path = INDEX, output: Path = RESULTS_MD) -> str:
    """RESULTS.md's text from the index and the files it names."""
    folder = index.parent
    sections = load_index(index)
    link_dir = Path(os.path.relpath(folder.resolve(), output.resolve().parent)).as_posix()
    index_link = f"{link_dir}/{index.name}"
    head = [
        "<!-- Generated by `python -m bench report` from the index "
        f"{index_link} (a path relative to this file) and the results files it names. Do not edit: `python -m bench report --check` "
        "(run by the test suite) fails when this file differs from what the files give. -->",
        "",
        "# Benchmark results",
        "",
        f"Every figure here is computed from a results file committed in [{link_dir}/]({link_dir}/) (the raw "
        "per-step and per-request numbers, the settings, the command line, the commit and the host) by the "
        "suite's own code. The index "
        f"[{index.name}]({index_link}) chooses which files are shown, in which order, with a note each. "
        "To regenerate after adding a file or editing the index: `python -m bench report` (or `omni-serving "
        "bench report`). How runs are recorded and committed: [docs/benchmarks.md](../docs/benchmarks.md).",
        "",
    ]
    body: list[str] = []
    if not sections:
        body += ["No results are committed yet: no figures are shown until a run's results file is committed "
                 "and named in the index.", ""]
    else:
        body += ["Sections:", ""]
        for n, s in enumerate(sections, 1):
            body.append(f"{n}. {s.title or s.file} (`{s.file}`)")
        body.append("")
        for n, s in enumerate(sections, 1):
            rec = record.load(folder / s.file)
            if rec["quick"] and not s.quick:
                raise ReportError(f"{index}: sections[{n}]: {s.file} is a --quick run (a tooling check, not "
                                  "figures); its entry must say `quick: true` to show it")
            body.append(section_md(n, s, rec, f"{link_dir}/{s.file}"))
    return "\n".join(head + body).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench report", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when the output file differs from what the results files give")
    p.add_argument("--index", default=str(INDEX), help=f"the index (default {INDEX})")
    p.add_argument("--output", default=str(RESULTS_MD), help=f"the generated file (default {RESULTS_MD})")
    args = p.parse_args(argv)
    index, output = Path(args.index), Path(args.output)
    try:
        text = generate(index, output)
    except (ReportError, record.RecordError) as exc:
        print(f"bench report: {exc}", file=sys.stderr)
        return 2
    if not args.check:
        output.write_text(text)
        print(f"wrote {output}")
        return 0
    try:
        current = output.read_text()
    except OSError as exc:
        print(f"bench report --check: {output} cannot be read ({exc.strerror})", file=sys.stderr)
        return 1
    if current == text:
        print(f"{output}: as the results files give it")
        return 0
    diff = list(difflib.unified_diff(current.splitlines(), text.splitlines(), f"{output} (as committed)",
                                     f"{output} (from the results files)", lineterm="", n=1))
    print(f"bench report --check: {output} differs from what the results files give (a figure edited by hand, "
          "or the index or a file changed without regenerating): run `python -m bench report`.\n"
          + "\n".join(diff[:80]) + ("\n..." if len(diff) > 80 else ""), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
