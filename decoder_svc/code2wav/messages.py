"""What crosses a code2wav worker's pipes: one frozen dataclass per kind.

decoder -> worker, in batches (a list per pipe write, in order):

- :class:`Frames`: a request's codec frames, by reference (:class:`ShmFrames`:
  a slot of the deployment's code2wav arena, which the worker copies out at
  once and hands back) or by value (:class:`InlineFrames`: no slot was free
  in time, or the frames do not fit one);
- :class:`Finish`: the request's frames are all there (its finish reason);
- :class:`Abort`: forget the request (and drop its later items);
- :class:`Stop`: end after the chunk being decoded (what is queued is dropped).

worker -> decoder, one per pipe write:

- :class:`Ready`: the vocoder is built;
- :class:`Released`: slots the worker copied out, to reclaim;
- :class:`Audio`: one decoded chunk of a request (the last one ends it), with
  the worker's ready chunks and the chunk's first-chunk wait;
- :class:`Error`: a request failed in the worker (the decoder fails it and
  logs the worker's traceback);
- :class:`Queue`: the worker's ready chunks changed while it was idle;
- :class:`Status`, from a reporter thread every ``STATUS_INTERVAL_S`` when
  something changed: the decode loop's liveness (chunks decoded, items
  handled, whether it waits for items: all set by the loop itself, so they
  stop when it wedges while the reports go on), its recent time per chunk, and about once a second
  (``METRICS_EVERY`` reports) a snapshot of the worker's own metrics
  (``omni_common.metrics_forward``) when it changed.

Each side dispatches on the class; nothing travels as a tagged tuple.
Plain values and numpy arrays only: the messages are pickled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

STATUS_INTERVAL_S = 0.2
"""How often a worker's reporter looks for news to send (a ``Status``)."""
METRICS_EVERY = 5
"""A metrics snapshot is considered on every this-many looks (about once a second)."""

# -- decoder -> worker ----------------------------------------------------------------------


@dataclass(frozen=True)
class ShmFrames:
    """Frames in a slot of the code2wav arena (marked ready before the message is sent)."""

    region: str
    offset: int
    nbytes: int
    slot: int
    generation: int
    dtype: str  # numpy dtype string
    shape: tuple[int, ...]


@dataclass(frozen=True)
class InlineFrames:
    """Frames carried in the message itself."""

    data: bytes
    dtype: str  # numpy dtype string
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Frames:
    request_id: str
    voice: str
    ref: ShmFrames | InlineFrames
    first: int  # frames of the request's first chunk (0: the ramp's)


@dataclass(frozen=True)
class Finish:
    request_id: str
    voice: str
    reason: str


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Stop:
    pass


Command = Frames | Finish | Abort | Stop

# -- worker -> decoder ----------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class Released:
    slots: list[tuple[int, int]]  # (slot, generation) copied out


@dataclass(frozen=True)
class Audio:
    request_id: str
    audio: np.ndarray  # float32 samples
    last: bool
    reason: str  # the finish reason, on the last chunk
    chunk: bool  # a decoded chunk (False: the empty last of a request without frames)
    queued: int  # the worker's ready chunks after this one
    first_wait: float | None  # the request's first chunk: how long it waited to decode


@dataclass(frozen=True)
class Error:
    request_id: str
    text: str
    trace: str


@dataclass(frozen=True)
class Queue:
    queued: int


@dataclass(frozen=True)
class Status:
    turns: int  # chunks the decode loop decoded (its liveness count)
    taken: int  # items (frames, finish, abort) the decode loop took from its inbox and handled
    waiting: bool  # the loop waits for items (nothing ready to decode)
    pace_s: float | None  # its recent time per chunk (None: none decoded yet)
    metrics: list | None = None  # a snapshot of the worker's metrics (omni_common.metrics_forward), or None


Event = Ready | Released | Audio | Error | Queue | Status
