"""`omni-serving up`: start the stack, print its endpoints, supervise it, stop it on a signal.

`run_up` is the whole command (omni_cli parses the options): it starts a
`Stack` as a child subreaper (orphans of the services come back to it), prints
the endpoints, supervises until Ctrl-C or SIGTERM, then stops the stack and
checks that no shared-memory segment of the deployment is left.

Signals: SIGINT/SIGTERM stop the stack (a second one kills it at once);
SIGHUP asks for a rolling restart of the materializers. The stack is driven
from the main thread for its whole life (the services' parent-death signal
follows the thread that started them).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from omni_stack.config import StackConfig
from omni_stack.errors import ConfigError, StackError, StartAborted
from omni_stack.processes import become_subreaper
from omni_stack.stack import Stack


def run_up(cfg: StackConfig, out=None) -> int:
    """Start the stack, print its endpoints, supervise it until Ctrl-C/SIGTERM, stop it.

    SIGHUP asks for a rolling restart of the materializers (Stack.request_rolling_restart).

    Exit status: 0 after a stop asked by SIGTERM or Ctrl-C (restarts on the
    way included); 1 when a service failed to start, failed more often in a
    row than max_restarts allows, or something was left behind; 130 when
    Ctrl-C stopped it while starting (SIGTERM then: 0).
    """
    out = out or sys.stdout
    try:
        stack = Stack(cfg, subreaper=become_subreaper())
    except ConfigError as exc:
        print(f"omni-serving up: error: {exc}", file=sys.stderr)
        return 2
    cfg = stack.cfg
    stop_requested = threading.Event()
    signals_seen: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        signals_seen.append(signum)
        stop_requested.set()
        if len(signals_seen) > 1:  # asked twice: no more waiting
            stack.kill()

    def on_hangup(signum: int, frame: object) -> None:
        stack.request_rolling_restart()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, on_hangup)
    rc = 0
    try:
        print(
            f"starting omni-serving: deployment {cfg.deployment}, profile {cfg.profile}, "
            f"engine {cfg.engine}, materializer "
            f"{'none (sync)' if cfg.sync else cfg.materializer_impl}"
            f"{f', {cfg.replicas} replicas' if cfg.replicas > 1 else ''} ...",
            file=sys.stderr,
            flush=True,
        )
        try:
            stack.start(abort=stop_requested)
        except StartAborted:
            print("stopped while starting", file=sys.stderr)
            return 0 if signals_seen[:1] == [signal.SIGTERM] else 130
        except StackError as exc:
            print(f"omni-serving up: error: {exc}", file=sys.stderr)
            return 1
        width = max(len(label) for label, _ in stack.endpoints()) + 1
        lines = [f"omni-serving is up (deployment {cfg.deployment})"]
        lines += [f"  {label + ':':<{width}} {value}" for label, value in stack.endpoints()]
        lines.append(
            f'try: omni-serving speak "Hello there" -o hello.wav --target {stack.gateway_target}'
        )
        lines.append(
            "Ctrl-C stops all three."
            if cfg.replicas == 1
            else f"Ctrl-C stops all {len(stack.services)} services."
        )
        if not cfg.sync:
            lines.append(
                f"rolling restart of the materializer{'s' if cfg.replicas > 1 else ''}: "
                f"omni-serving restart materializer --runtime-dir {stack.runtime} "
                f"(or kill -HUP {os.getpid()})"
            )
        print("\n".join(lines), file=out, flush=True)
        problem = stack.supervise(stop_requested)
        if problem is not None:
            print(
                f"omni-serving up: error: {problem}; stopping the stack",
                file=sys.stderr,
                flush=True,
            )
            rc = 1
    finally:
        started = time.monotonic()
        left = stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stack.killed:
        print(
            f"warning: stopped processes left behind by the services: {', '.join(stack.killed)}",
            file=sys.stderr,
        )
    if left:
        print(f"warning: shared-memory segments left: {left}", file=sys.stderr)
        return 1
    print(f"stopped in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return rc
