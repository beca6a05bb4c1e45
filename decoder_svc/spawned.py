"""What the decoder's spawned processes share: rebuilding by import path, sending on a pipe, starting.

A stage process (``decoder_svc.stage``) and a code2wav worker
(``decoder_svc.code2wav``) are ``multiprocessing`` "spawn" children: what
they cannot be sent (an engine backend, a vocoder: torch modules are never
pickled) they rebuild from an importable factory path and its keyword
arguments (:func:`call_factory`), and what they report goes back over their
end of a pipe, from several threads (:func:`pipe_sender`). Messages are the
typed classes of each side's ``messages`` module, never tagged tuples. A
stage process starts with the intra-op thread count and OpenMP wait policy
it is given (:func:`start_with_threads`).
"""

from __future__ import annotations

import importlib
import os
import pickle
import threading
from collections.abc import Callable
from typing import Any

from omni_common.errors import InvalidArgumentError


def call_factory(path: str, kwargs: dict[str, Any], field: str):
    """Import "package.module:attr" and call it with `kwargs` (a process
    rebuilding what it cannot be sent: torch modules are never pickled)."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise InvalidArgumentError(field, f"{path!r} is not 'package.module:factory'")
    factory = getattr(importlib.import_module(module), attr)
    return factory(**dict(kwargs))


def pipe_sender(conn, *, as_bytes: bool = False) -> Callable[[Any], bool]:
    """A thread-safe send of messages on a worker's end of a pipe; False once
    the decoder is gone. `as_bytes`: pickled here and sent as bytes (plain
    pickle: tensors travel by value, never as shared-memory handles of
    ``torch.multiprocessing``)."""
    lock = threading.Lock()

    def send(msg: Any) -> bool:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL) if as_bytes else None
        try:
            with lock:
                if data is None:
                    conn.send(msg)
                else:
                    conn.send_bytes(data)
            return True
        except (OSError, ValueError):  # the decoder is gone
            return False

    return send


_ENV_LOCK = threading.Lock()


def start_with_threads(process, threads: int, wait_policy: str = "") -> None:
    """Start `process` with OMP_NUM_THREADS=threads (0: as ours) and
    OMP_WAIT_POLICY=wait_policy ("": as ours) in its environment. OpenMP
    reads both once, when torch loads: every thread of the process then
    agrees on the count (vLLM's CPU attention checks that the thread that
    plans a step and the one that runs it do). A variable already set in
    our environment (the deployment's) is left as it is. Every spawned
    process of the decoder starts through here (threads 0: nothing set), so
    none inherits another's variables while they are set."""
    wanted = {"OMP_NUM_THREADS": str(threads) if threads > 0 else "",
              "OMP_WAIT_POLICY": wait_policy.upper()}
    wanted = {k: v for k, v in wanted.items() if v and not os.environ.get(k)}
    with _ENV_LOCK:
        os.environ.update(wanted)
        try:
            process.start()
        finally:
            for key in wanted:
                del os.environ[key]
