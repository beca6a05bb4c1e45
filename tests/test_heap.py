"""omni_common.heap: freed heap handed back to the OS (glibc's malloc_trim),
at idle moments, rate-limited."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from omni_common.heap import HeapTrimmer, malloc_trim


def test_the_trimmer_trims_at_idle_after_work_at_most_every_interval():
    now = [100.0]
    calls = []
    t = HeapTrimmer(2.0, trim=lambda: calls.append(now[0]) or True, clock=lambda: now[0])
    assert not t.idle(), "no work yet: nothing to trim"
    t.worked()
    assert not t.idle(), "within the interval of the start"
    now[0] += 2.5
    assert t.idle() and calls == [102.5] and t.trims == 1
    assert not t.idle(), "no work since the last trim"
    t.worked()
    now[0] += 1.0
    assert not t.idle(), "within the interval of the last trim"
    now[0] += 1.0
    assert t.idle() and t.trims == 2
    with pytest.raises(ValueError, match="interval_s"):
        HeapTrimmer(0)


def test_a_trimmer_without_glibc_does_nothing():
    now = [0.0]
    t = HeapTrimmer(1.0, trim=lambda: False, clock=lambda: now[0])
    t.worked()
    now[0] = 5.0
    assert not t.idle() and t.trims == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or not malloc_trim(), reason="needs glibc")
def test_malloc_trim_returns_freed_small_blocks_to_the_os():
    """In a fresh process: 200 MiB of 1 KiB blocks from malloc, all freed
    but the last (it pins the top of the heap, so glibc keeps the rest):
    resident memory stays up until malloc_trim, then falls."""
    code = textwrap.dedent("""
        import ctypes, ctypes.util
        from omni_common.heap import malloc_trim
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096
        base = rss()
        blocks = [libc.malloc(1024) for _ in range(200 * 1024)]
        for b in blocks:
            ctypes.memset(b, 1, 1024)
        full = rss()
        for b in blocks[:-1]:
            libc.free(b)
        freed = rss()
        assert malloc_trim()
        print(base, full, freed, rss())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    base, full, freed, trimmed = map(int, out.stdout.split())
    mib = 2**20
    assert full - base > 150 * mib, (base, full)
    assert freed - base > 150 * mib, f"glibc returned the freed blocks by itself: {(base, full, freed)}"
    assert trimmed - base < 50 * mib, f"malloc_trim left them resident: {(base, full, freed, trimmed)}"
