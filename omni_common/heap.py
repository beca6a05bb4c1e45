"""Handing freed heap memory back to the operating system.

glibc keeps memory that a process frees in its heap for later allocations
and returns little of it: a freed block below the mmap threshold (128 KiB
to 32 MiB, raised as larger blocks are freed) stays resident until the top
of the heap is free. A code2wav worker's decode frees many such
temporaries, so after a burst of requests its resident memory stays well
above what it holds (measured on the released widths, float32, one thread:
8 streams of 4 ten-frame chunks left the process at 1283 to 1423 MiB, and a
trim brought it back to 1178 MiB each time, in 13 to 19 ms).
``malloc_trim(0)`` returns the free pages of every arena.

:class:`HeapTrimmer` trims at idle moments: asked while the loop that
owns it waits, it trims if the loop did some work since the last trim, at
most once per ``interval_s``. Where the C library is not glibc it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

__all__ = ["HeapTrimmer", "malloc_trim"]


def _load_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_TRIM = _load_trim()


def malloc_trim() -> bool:
    """Return the free pages of every heap arena to the operating system;
    False where there is no glibc ``malloc_trim`` (nothing done)."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class HeapTrimmer:
    """Trims at most every ``interval_s`` seconds, at an idle moment after
    some work (:meth:`worked` marks work, :meth:`idle` trims if due).
    ``trim`` and ``clock`` are seams for tests."""

    def __init__(self, interval_s: float = 2.0, *, trim: Callable[[], bool] = malloc_trim,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = float(interval_s)
        self._trim = trim
        self._clock = clock
        self._last = clock()
        self._dirty = False
        self.trims = 0  # trims done

    def worked(self) -> None:
        self._dirty = True

    def idle(self) -> bool:
        """Trim now if work was done since the last trim and the interval
        has passed; whether it trimmed."""
        now = self._clock()
        if not self._dirty or now - self._last < self.interval_s:
            return False
        self._dirty = False
        self._last = now
        if self._trim():
            self.trims += 1
            return True
        return False
