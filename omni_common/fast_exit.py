"""Leave a service process at once once its own shutdown is done.

A service shuts down in its main function: requests drained or ended,
stages, workers and links stopped, arenas closed and unlinked. What the
interpreter does after main returns (the atexit hooks of the libraries it
imported, finalizing the torch and vLLM modules) took 1 to 2.5 s per process
here and does nothing a stopped service needs: a decoder's stage process
spent 2.2 s there after its last line ran. So the service entry points end
with :func:`exit_now`: logs and standard streams flushed, then ``os._exit``
with the exit status.

Only the normal path is short-cut: an exception, ``SystemExit`` with a
message included, takes the ordinary way out (its traceback or message
printed, the usual status). Never call this in a process that hosts other
code (a test runner): it ends the process without running anything else.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import sys
from collections.abc import Callable
from typing import NoReturn

CHILDREN_WAIT_S = 5.0
"""How long :func:`exit_now` waits for this process's multiprocessing
children (a tensor-parallel engine's workers) to end before it stops them."""


def exit_now(code: int = 0) -> NoReturn:
    """Reap multiprocessing children (those that outlive the wait are
    terminated, as the interpreter's own exit would), run multiprocessing's
    finalizers, flush logs and standard streams, then end the process with
    `code`."""
    children = multiprocessing.active_children()
    for child in children:
        child.join(CHILDREN_WAIT_S / max(len(children), 1))
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(1.0)
    # multiprocessing's own finalizers (its named semaphores unlinked, its
    # queues closed), as its exit hook runs them: skipped, the resource
    # tracker would report the semaphores as leaked
    run_finalizers = getattr(multiprocessing.util, "_run_finalizers", None)
    if run_finalizers is not None:
        try:
            run_finalizers()
        except Exception:  # noqa: BLE001 -- on the way out: the tracker cleans up after us
            pass
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 -- a closed stream: nothing to flush
            pass
    os._exit(code)


def run_service(main: Callable[[], int | str | None]) -> NoReturn:
    """``raise SystemExit(main())`` with the fast way out: an int (None = 0)
    ends the process through :func:`exit_now`; a string is printed to
    stderr and ends it with status 1, as ``SystemExit`` does."""
    code = main()
    if isinstance(code, str):
        print(code, file=sys.stderr)
        exit_now(1)
    exit_now(code or 0)
