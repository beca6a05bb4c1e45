"""The Node.js materializer in examples/materializer-node passes the conformance kit.

It is a second implementation of omni_serving.v1.MaterializerService, written
from the protos and docs/writing-a-materializer.md only. The test installs its
npm dependencies if needed, serves it on a temporary Unix socket, runs the kit
(strict messages) against it as a separate process, then stops it with SIGTERM.

Without `node` on PATH the test is skipped, except in CI (CI=true), where it fails.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "materializer-node"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"`{name}` is not on PATH: the Node.js materializer example cannot run"
        if os.environ.get("CI") == "true":
            pytest.fail(message + " (CI=true: CI must run this test)")
        pytest.skip(message)
    return path


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return "(no log)"


def _prepare_example() -> Path:
    """The `node` binary, after installing the example's npm dependencies if needed."""
    node = _tool("node")
    if not (EXAMPLE / "node_modules" / "@grpc" / "grpc-js").is_dir():
        npm = _tool("npm")
        proc = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"],
            cwd=EXAMPLE,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0, f"npm ci failed:\n{proc.stdout}\n{proc.stderr}"
    version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30)
    major = int(version.stdout.strip().lstrip("v").split(".")[0])
    assert major >= 18, f"node {version.stdout.strip()} is too old (need >= 18)"
    return Path(node)


def test_node_materializer_passes_conformance(sock_dir: Path) -> None:
    node_example = _prepare_example()
    deployment = f"nodeex{os.getpid()}"
    target = f"unix://{sock_dir / 'node-m.sock'}"
    log_path = sock_dir / "server.log"
    results_path = sock_dir / "results.json"
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [str(node_example), "server.js", "--listen", target, "--deployment", deployment],
            cwd=EXAMPLE,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        kit = subprocess.run(
            [
                sys.executable,
                "-m",
                "materializer_svc.conformance",
                "--target",
                target,
                "--deployment",
                deployment,
                "--strict-messages",
                "--wait",
                "30",
                "--timeout",
                "20",
                "--json",
                str(results_path),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=150,
        )
        report = (
            f"kit exit code {kit.returncode}\n{kit.stdout}\n{kit.stderr}\n"
            f"--- server log ---\n{_tail(log_path)}"
        )
        assert server.poll() is None, "the Node.js server exited during the run\n" + report
        assert kit.returncode == 0, report
        results = json.loads(results_path.read_text())
        failed = [r["name"] for r in results if not r["passed"] and not r.get("skipped")]
        assert results and not failed, f"failed checks: {failed}\n{report}"

        # SIGTERM with no open stream: the server stops at once, with status 0.
        server.send_signal(signal.SIGTERM)
        rc = server.wait(timeout=15)
        assert rc == 0, f"server exit status {rc} after SIGTERM\n{_tail(log_path)}"
        assert not (sock_dir / "node-m.sock").exists(), "the server left its socket behind"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=10)
