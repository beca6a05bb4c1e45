"""The CLI sits on top: it imports the stack library, never bench; the library imports neither.

`omni-serving bench ...` runs `python -m bench ...` in the CLI's place
(exec), so the user sees bench's own help, output and exit status while no
import points from the CLI up to bench (bench imports omni_stack).
Imports are read from the source (lazy ones inside functions count too).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# package -> packages it must never import, at any depth (lazy imports included)
FORBIDDEN = {
    "omni_common": {"omni_stack", "omni_cli", "bench"},
    "omni_stack": {"omni_cli", "bench"},
    "omni_cli": {"bench"},
}


def _imports(path: Path) -> set[str]:
    """Top-level package of every import in `path`, function bodies included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def test_no_import_points_up():
    upward = {
        str(path.relative_to(REPO)): sorted(_imports(path) & banned)
        for package, banned in FORBIDDEN.items()
        for path in sorted((REPO / package).rglob("*.py"))
        if _imports(path) & banned
    }
    assert not upward, f"imports that point up (file: packages): {upward}"


def test_omni_serving_bench_is_bench_itself():
    cli = [sys.executable, "-m", "omni_cli.main", "bench"]
    shown = subprocess.run([*cli, "--help"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert shown.returncode == 0, f"bench --help exited {shown.returncode}: {shown.stderr}"
    assert "omni-serving bench" in shown.stdout and "step-gap" in shown.stdout, shown.stdout
    bad = subprocess.run(
        [*cli, "no-such-suite"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert bad.returncode == 2, f"bench's usage error should exit 2, got {bad.returncode}"
    assert "invalid choice: 'no-such-suite'" in bad.stderr, bad.stderr
