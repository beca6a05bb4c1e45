"""Starting services cannot hang the launcher: no fork() while it holds gRPC state.

A launcher that forks (as `preexec_fn` makes CPython do) runs gRPC's fork
handlers, which can block it for good while its channels are busy; `bench
e2e` stopped that way, and `up`'s supervisor forks the same way when it
restarts a crashed service. The launcher now spawns without fork()
(omni_stack.processes).

tests/spawn_stress.py is the launcher: a real Stack whose supervisor restarts
a tiny crashing service a few hundred times (3,000 with OMNI_SOAK_FULL=1) and
a tiny gRPC service a few times, while a thread of the launcher polls health
over a live channel. It runs as its own process under a time bound (a hung
fork holds the interpreter lock: only another process can end it), and
counts the fork handlers glibc ran in it: any at all means a fork().

On the spawn this replaced (`preexec_fn`), the run hung inside fork() within
the bound every time here; without the counting handler it crashed once in
seven runs (SIGSEGV in fork()) and took 4.7 times as long in the others,
their children aborting between fork and exec in gRPC's fork handling.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
FULL = os.environ.get("OMNI_SOAK_FULL") == "1"
RESTARTS = 3000 if FULL else 300
SERVICE_RESTARTS = 10 if FULL else 3
# The run's bound: a few seconds' work here on a quiet machine, much more on a
# loaded one; a hang never ends.
BOUND_S = 900.0 if FULL else 150.0


@pytest.mark.timeout(int(BOUND_S) + 120)
def test_services_start_and_restart_hundreds_of_times_while_grpc_is_busy(tmp_path):
    out = tmp_path / "summary.json"
    err = tmp_path / "stderr.txt"
    with err.open("w") as stderr:
        launcher = subprocess.Popen(
            [
                sys.executable, "-m", "tests.spawn_stress", "run",
                "--restarts", str(RESTARTS),
                "--service-restarts", str(SERVICE_RESTARTS),
                "--bound-s", str(BOUND_S),
                "--out", str(out),
            ],
            cwd=REPO,
            stderr=stderr,
            start_new_session=True,
        )
        try:
            rc = launcher.wait(BOUND_S + 60)  # faulthandler ends it at BOUND_S
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
            rc = None
    log = err.read_text()
    assert rc == 0, (
        f"the launcher {'hung' if rc is None else f'exited with {rc}'} "
        f"(bound {BOUND_S:g}s); its stderr (thread stacks on a hang):\n{log[-6000:]}"
    )
    got = json.loads(out.read_text())
    print(f"\nspawn stress: {got}")
    assert got["restarts"] >= RESTARTS, f"restarted {got['restarts']} times, want {RESTARTS}"
    assert got["health_restarts"] == SERVICE_RESTARTS, got
    assert got["fork_handlers_run"] == 0, (
        f"{got['fork_handlers_run']} fork() calls ran fork handlers in the launcher "
        f"(a spawn that forks: preexec_fn or a user/group change)"
    )
    assert got["checks_ok"] > 0 and got["checks_ok_at_end"] >= 10, (
        f"the launcher's health polling did not run throughout: {got}"
    )
    assert got["segments_left"] == [], got
    health = got["health_pid"]
    deadline = time.monotonic() + 10
    while psutil.pid_exists(health) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(health) or psutil.Process(health).status() == "zombie", (
        f"the health service (pid {health}) outlived the stack"
    )
