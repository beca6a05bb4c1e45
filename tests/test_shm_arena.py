"""The shared-memory arena: slots, generations, readiness, backpressure, cleanup."""

from __future__ import annotations

import os
import secrets
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from omni_common.errors import (
    AbortedError,
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from omni_common.shm_arena import (
    HEADER,
    MAGIC,
    SHM_DIR,
    VERSION,
    ArenaReader,
    ShmArena,
    list_segments,
    sweep_stale,
)
from omni_common.tensor_wire import dtype_info, tensor_from_buffer
from omni_serving.v1 import tensor_pb2

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def prefix():
    p = f"omni-t{os.getpid()}-{secrets.token_hex(3)}"
    yield p
    for name in list_segments(p):  # never leave anything behind, even on failure
        (SHM_DIR / name).unlink(missing_ok=True)


def read_back(reader: ArenaReader, ref) -> torch.Tensor:
    return tensor_from_buffer(reader.view(ref.shm), dtype_info(ref.dtype), list(ref.shape)).clone()


def test_slot_reuse_bumps_the_generation(prefix):
    with ShmArena(prefix, num_slots=1, slot_bytes=4096) as arena:
        first = arena.acquire()
        assert (first.slot, first.generation) == (0, 1)
        assert arena.release(first.slot, first.generation)
        assert not arena.release(first.slot, first.generation), "release must be idempotent"
        second = arena.acquire()
        assert (second.slot, second.generation) == (0, 2), f"{second.slot=} {second.generation=}"
        assert not arena.release(0, 1), "releasing an old generation must not free the new one"
        assert arena.in_use == 1


def test_written_tensor_reads_back_through_the_reader(prefix):
    with ShmArena(prefix, 2, 4096) as arena:
        lease = arena.acquire()
        t = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)
        ref = lease.write(t)
        lease.mark_ready()
        reader = ArenaReader(prefix)
        try:
            reader.wait_ready(ref.shm, time.monotonic() + 1)
            assert read_back(reader, ref).equal(t)
            assert ref.shm.offset % 64 == 0 and ref.shm.byte_size == 24
        finally:
            reader.close()


def test_stale_generation_read_is_refused(prefix):
    with ShmArena(prefix, 1, 4096) as arena:
        lease = arena.acquire()
        ref = lease.write(torch.ones(4))
        lease.mark_ready()
        reader = ArenaReader(prefix)
        try:
            view = reader.view(ref.shm)  # a read in progress...
            del view
            arena.release(lease.slot, lease.generation)
            again = arena.acquire()  # ... while the writer reuses the slot
            again.write(torch.zeros(4))
            again.mark_ready()
            with pytest.raises(
                AbortedError, match="stale handle, slot 0 is at generation 2, handle has 1"
            ):
                reader.verify_unchanged(ref.shm)
            with pytest.raises(AbortedError):
                reader.wait_ready(ref.shm, time.monotonic() + 1)
        finally:
            reader.close()


def test_readiness_wait_returns_once_marked(prefix):
    with ShmArena(prefix, 1, 4096) as arena:
        lease = arena.acquire()
        ref = lease.write(torch.ones(4))
        reader = ArenaReader(prefix)
        timer = threading.Timer(0.1, lease.mark_ready)
        t0 = time.monotonic()
        timer.start()
        try:
            reader.wait_ready(ref.shm, time.monotonic() + 5)
            waited = time.monotonic() - t0
        finally:
            timer.cancel()
            reader.close()
        assert 0.08 <= waited < 2, f"{waited=}"


def test_readiness_wait_times_out(prefix):
    with ShmArena(prefix, 1, 4096) as arena:
        lease = arena.acquire()
        ref = lease.write(torch.ones(4))
        reader = ArenaReader(prefix)
        t0 = time.monotonic()
        try:
            with pytest.raises(DeadlineExceededError, match="was not ready in time"):
                reader.wait_ready(ref.shm, time.monotonic() + 0.1)
        finally:
            reader.close()
        assert 0.09 <= time.monotonic() - t0 < 1.5


def test_acquire_blocks_when_full_and_unblocks_on_release(prefix):
    with ShmArena(prefix, 2, 4096) as arena:
        a, b = arena.acquire(), arena.acquire()
        got = []
        waiter = threading.Thread(target=lambda: got.append(arena.acquire(timeout=5)))
        waiter.start()
        time.sleep(0.15)
        assert waiter.is_alive() and not got, "acquire must wait while every slot is held"
        arena.release(a.slot, a.generation)
        waiter.join(2)
        assert got and got[0].slot == a.slot and got[0].generation == a.generation + 1
        assert arena.peak_in_use == 2
        with pytest.raises(ResourceExhaustedError, match="no free arena slot"):
            arena.acquire(timeout=0.05)
        assert arena.try_acquire() is None
        arena.release(b.slot, b.generation)
        assert arena.try_acquire() is not None


def test_close_wakes_a_blocked_acquire(prefix):
    arena = ShmArena(prefix, 1, 4096)
    arena.acquire()
    errors = []

    def wait() -> None:
        try:
            arena.acquire(timeout=5)
        except AbortedError as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.05)
    arena.close()
    t.join(2)
    assert errors, "a blocked acquire must fail when the arena closes"


def test_segment_mode_is_0600_whatever_the_umask(prefix):
    old = os.umask(0)
    try:
        with ShmArena(prefix, 1, 4096) as arena:
            mode = stat.S_IMODE(os.stat(arena.path).st_mode)
    finally:
        os.umask(old)
    assert mode == 0o600, f"{oct(mode)=}"


def test_no_segment_left_after_close(prefix):
    arena = ShmArena(prefix, 2, 4096)
    lease = arena.acquire()
    lease.write(torch.ones(8))
    assert list_segments(prefix) == [arena.name]
    arena.close()
    arena.close()  # twice is fine
    assert list_segments(prefix) == []
    assert not arena.path.exists()


def test_sweep_stale_removes_a_killed_owners_segment_and_keeps_a_live_one(prefix):
    live = ShmArena(prefix, 1, 4096)
    code = textwrap.dedent(
        f"""
        import sys, time
        from omni_common.shm_arena import ShmArena
        arena = ShmArena({prefix!r}, 1, 4096)
        print(arena.name, flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        orphan = proc.stdout.readline().strip()
        assert orphan.startswith(f"{prefix}-arena-{proc.pid}-"), f"{orphan=}"
        assert sweep_stale(prefix) == [], "a live owner's segment must not be swept"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    try:
        assert (SHM_DIR / orphan).exists(), (
            "SIGKILL leaves the segment behind (this is what sweep is for)"
        )
        assert sweep_stale(prefix) == [orphan]
        assert list_segments(prefix) == [live.name]
    finally:
        live.close()
    assert list_segments(prefix) == []


# -- reader validation (the handle error table, at the unit level) -------------------


@pytest.fixture
def arena_and_reader(prefix):
    with ShmArena(prefix, 4, 4096) as arena:
        reader = ArenaReader(prefix)
        lease = arena.acquire()
        ref = lease.write(torch.ones(16, dtype=torch.float32))
        lease.mark_ready()
        yield arena, reader, ref
        reader.close()


def _handle(ref, **fields):
    h = tensor_pb2.ShmHandle()
    h.CopyFrom(ref.shm)
    for k, v in fields.items():
        setattr(h, k, v)
    return h


@pytest.mark.parametrize(
    ("fields", "error", "words"),
    [
        (lambda a: {"region": "../x"}, InvalidArgumentError, "malformed or path-like"),
        (lambda a: {"region": "/dev/shm/x"}, InvalidArgumentError, "malformed or path-like"),
        (lambda a: {"region": ""}, InvalidArgumentError, "malformed or path-like"),
        (
            lambda a: {"region": "other-deployment-arena-1-aa"},
            PermissionDeniedError,
            "outside deployment prefix",
        ),
        (lambda a: {"region": f"{a.prefix}-arena-1-00000000"}, NotFoundError, "unknown region"),
        (lambda a: {"slot": a.num_slots}, OutOfRangeError, f"slot: {4} is out of range"),
        (lambda a: {"offset": a.size, "byte_size": 1}, OutOfRangeError, "past the end of region"),
        (
            lambda a: {"offset": a.size + 1, "byte_size": 0},
            OutOfRangeError,
            "is past the end of region",
        ),
        (lambda a: {"offset": a.slot_offset(1) - 8}, OutOfRangeError, "not inside slot 0"),
        (
            lambda a: {"offset": 2**64 - 1, "byte_size": 4},
            InvalidArgumentError,
            "overflows 64 bits",
        ),
        (lambda a: {"generation": 7}, AbortedError, "stale handle"),
    ],
    ids=[
        "dotdot",
        "abspath",
        "empty",
        "other_prefix",
        "unknown",
        "slot",
        "end",
        "offset",
        "cross_slot",
        "overflow",
        "gen",
    ],
)
def test_reader_refuses_bad_handles(arena_and_reader, fields, error, words):
    arena, reader, ref = arena_and_reader
    with pytest.raises(error, match=words):
        reader.check(_handle(ref, **fields(arena)))


def test_reader_refuses_a_segment_that_is_not_an_arena(prefix):
    bad = SHM_DIR / f"{prefix}-arena-1-notarena"
    bad.write_bytes(b"x" * 128)
    reader = ArenaReader(prefix)
    try:
        with pytest.raises(InvalidArgumentError, match="is not an arena"):
            reader.check(tensor_pb2.ShmHandle(region=bad.name, byte_size=1))
        # A header whose slot table runs past the segment is refused too.
        header = HEADER.pack(MAGIC, VERSION, 1000, 4096, 128)
        bad.write_bytes(header.ljust(128, b"\0"))
        reader.forget(bad.name)
        with pytest.raises(InvalidArgumentError, match="inconsistent arena header"):
            reader.check(tensor_pb2.ShmHandle(region=bad.name, byte_size=1))
    finally:
        reader.close()
        bad.unlink(missing_ok=True)


def test_reader_prunes_mappings_of_closed_arenas(prefix):
    arena = ShmArena(prefix, 1, 4096)
    lease = arena.acquire()
    ref = lease.write(torch.ones(4))
    lease.mark_ready()
    reader = ArenaReader(prefix)
    try:
        reader.check(ref.shm)
        assert reader.prune() == []
        arena.close()
        assert reader.prune() == [arena.name], "a gone segment's mapping must be dropped"
        with pytest.raises(NotFoundError):
            reader.check(ref.shm)
    finally:
        reader.close()
