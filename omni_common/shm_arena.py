"""A shared-memory arena of fixed slots, with generations and readiness marks.

One POSIX shared-memory segment (a file under /dev/shm, mode 0600) per arena:

    [ header 64 B | slot table: num_slots x 64 B | data: num_slots x slot_bytes ]

Each slot-table entry holds the slot's *generation* (bumped every time the
writer takes the slot) and its *ready generation* (set to the generation once
the slot's bytes are complete: at once on CPU, after the copy event on CUDA).
A reader accepts a handle only when both equal the handle's generation, and
checks again after reading: a slot that was reused meanwhile is a stale read,
refused, never returned.

The writer (decoder) owns the segment: it holds an flock on it for its whole
life, so `sweep_stale` can tell a live arena from one left by a killed process
(SIGKILL included) and unlink the latter at startup. The lock is the test of
liveness because it holds across PID namespaces (containers sharing one IPC
namespace see each other's segments, not each other's pids). The header also
records the owner (pid and process start time, as the owner sees them) for the
sweep's log. Segment names are `<prefix>-arena-<pid>-<nonce>`; a reader only
opens names under its own deployment prefix. `sweep_orphans` sweeps the
segments of every deployment on the host whose owner is gone.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

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
from omni_common.tensor_wire import UINT64_MAX, proto_dtype_of
from omni_serving.v1 import tensor_pb2

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
MAGIC = b"OMNIARN1"
HEADER = struct.Struct("<8sIIQQ")  # magic, version, num_slots, slot_bytes, data_offset
HEADER_BYTES = 64
# In the header's spare bytes, after HEADER: the owner's pid and start time
# (clock ticks after boot, /proc/<pid>/stat field 22). Zero in segments made
# before the field existed; readers ignore it.
OWNER = struct.Struct("<QQ")
OWNER_OFFSET = HEADER.size
# A segment without a header yet is one being created (the creator takes the
# lock right after creating the file, then writes the header); after this
# long it is debris of a creator killed in between.
CREATING_GRACE_S = 10.0
ENTRY = struct.Struct("<QQ")  # generation, ready_generation
ENTRY_BYTES = 64  # one cache line per slot entry: no false sharing between slots
ALIGN = 64
VERSION = 1
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def validate_prefix(prefix: str) -> str:
    """A deployment prefix is a plain name (letters, digits, `._-`)."""
    if not _NAME_RE.match(prefix) or ".." in prefix:
        raise InvalidArgumentError("shm_prefix", f"{prefix!r} is not a plain name of letters, digits, '.', '_', '-'")
    return prefix


def arena_glob(prefix: str) -> str:
    return f"{prefix}-arena-*"


def list_segments(prefix: str) -> list[str]:
    """Names of the arena segments under `prefix` present on this host."""
    return sorted(p.name for p in SHM_DIR.glob(arena_glob(prefix)))


def process_start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks after boot; None if it is gone.

    With the pid it names one process: a pid reused later has a later start.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2 (the command name) may hold spaces and parentheses: split after it.
    fields = stat[stat.rindex(")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class SegmentOwner:
    """The process that created a segment, as recorded in its header."""

    pid: int
    start_ticks: int

    def alive(self) -> bool:
        """Whether that process still runs here (meaningful in its own PID namespace only)."""
        return self.pid > 0 and process_start_ticks(self.pid) == self.start_ticks


def segment_owner(name: str) -> SegmentOwner | None:
    """The owner recorded in segment `name`; None if it is unreadable or has no record."""
    try:
        with open(SHM_DIR / name, "rb") as f:
            head = f.read(OWNER_OFFSET + OWNER.size)
    except OSError:
        return None
    if len(head) < OWNER_OFFSET + OWNER.size or head[: len(MAGIC)] != MAGIC:
        return None
    pid, start = OWNER.unpack_from(head, OWNER_OFFSET)
    return SegmentOwner(pid, start) if pid else None


def _unlink_if_orphaned(name: str, creating_grace_s: float) -> str | None:
    """Unlink segment `name` if no process holds its lock; return how it was
    recognized (for the log), or None when it was left alone.

    Left alone: a segment whose lock is held (its owner, or a child that
    inherited the descriptor, is alive), one we may not open, and one without
    a header younger than `creating_grace_s` (being created right now).
    """
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # gone meanwhile, not ours to read, or not a plain file
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None  # a live owner holds it
            raise
        st = os.fstat(fd)
        head = os.pread(fd, OWNER_OFFSET + OWNER.size, 0)
        if head[: len(MAGIC)] == MAGIC and len(head) == OWNER_OFFSET + OWNER.size:
            pid, start = OWNER.unpack_from(head, OWNER_OFFSET)
            why = f"owner pid {pid} gone" if pid else "owner gone"
        elif time.time() - st.st_mtime >= creating_grace_s:
            why = "no header, creator gone"
        else:
            return None  # its creator is about to take the lock
        try:
            current = os.lstat(path)
        except FileNotFoundError:
            return None
        if (current.st_dev, current.st_ino) != (st.st_dev, st.st_ino):
            return None  # replaced meanwhile: not the file we judged
        try:
            path.unlink()
        except FileNotFoundError:
            return None  # someone else swept it first
        except PermissionError:
            return None  # another user's, in the sticky /dev/shm
        return why
    finally:
        os.close(fd)


def _sweep(names: list[str], scope: str, creating_grace_s: float | None) -> list[str]:
    grace = CREATING_GRACE_S if creating_grace_s is None else creating_grace_s
    removed = []
    for name in names:
        why = _unlink_if_orphaned(name, grace)
        if why is not None:
            removed.append(name)
            logger.info("swept stale shared-memory segment %s (%s)", name, why)
    if removed:
        logger.info("swept %d stale shared-memory segment(s) %s", len(removed), scope)
    return removed


def sweep_stale(prefix: str, creating_grace_s: float | None = None) -> list[str]:
    """Unlink segments under `prefix` whose owner is gone; return their names.

    The owner holds an exclusive flock for its lifetime; the kernel drops it
    when the owner dies, however it dies. A segment we can lock is orphaned.
    One without a header is left alone while younger than `creating_grace_s`
    (default CREATING_GRACE_S): its creator may be about to lock it. 0 suits
    a caller that knows every writer of the prefix is gone (a launcher whose
    decoder has exited).
    """
    return _sweep(list_segments(prefix), f"under {prefix!r}", creating_grace_s)


def sweep_orphans() -> list[str]:
    """Unlink the arena segments of every deployment on this host whose owner
    is gone (`omni-*-arena-*`); return their names.

    Live arenas, of any deployment, hold their owner's lock and stay.
    """
    names = sorted(p.name for p in SHM_DIR.glob("omni-*-arena-*") if _NAME_RE.match(p.name))
    return _sweep(names, "of any deployment", None)


@dataclass(frozen=True)
class SlotRef:
    """Identity of one use of a slot: (region, slot, generation)."""

    region: str
    slot: int
    generation: int


class SlotLease:
    """A slot taken by the writer for one step. Write tensors, then mark ready."""

    def __init__(self, arena: ShmArena, slot: int, generation: int) -> None:
        self.arena = arena
        self.slot = slot
        self.generation = generation
        self._cursor = 0  # bytes used inside the slot

    @property
    def ref(self) -> SlotRef:
        return SlotRef(self.arena.name, self.slot, self.generation)

    @property
    def bytes_used(self) -> int:
        return self._cursor

    def write(self, tensor: torch.Tensor, *, non_blocking: bool = False) -> tensor_pb2.TensorRef:
        """Copy `tensor` into the slot (one memcpy); return its handle.

        For a CUDA tensor with `non_blocking=True` the copy is only enqueued
        on the current stream (the arena must be pinned; the caller marks the
        slot ready after the copy's event). Raises ResourceExhaustedError if
        the slot has no room left.
        """
        t = tensor.detach()
        nbytes = t.numel() * t.element_size()
        start = _align(self._cursor)
        if start + nbytes > self.arena.slot_bytes:
            raise ResourceExhaustedError(
                f"step output of {nbytes} bytes does not fit slot of {self.arena.slot_bytes} bytes "
                f"({start} used); raise the arena's slot_bytes"
            )
        offset = self.arena.slot_offset(self.slot) + start
        if nbytes and t.device.type == "cpu" and t.is_contiguous():
            # One plain memcpy (GIL released): no view objects, and no
            # intra-op thread pool to wake, which a busy engine also uses.
            ctypes.memmove(self.arena.base_address + offset, t.data_ptr(), nbytes)
        elif nbytes:
            dst = self.arena.data_view(offset, nbytes).view(t.dtype).view(t.shape)
            dst.copy_(t, non_blocking=non_blocking)
        self._cursor = start + nbytes
        return tensor_pb2.TensorRef(
            dtype=proto_dtype_of(t.dtype),
            shape=list(t.shape),
            shm=tensor_pb2.ShmHandle(
                region=self.arena.name,
                offset=offset,
                byte_size=nbytes,
                slot=self.slot,
                generation=self.generation,
            ),
        )

    def mark_ready(self) -> None:
        """Publish the slot's bytes (readers wait for this mark)."""
        self.arena._set_ready(self.slot, self.generation)


class ShmArena:
    """The writer side: owns the segment, hands out slots, takes them back.

    `acquire` blocks while every slot is held (backpressure, not unbounded
    memory). `release` is idempotent per (slot, generation).
    """

    def __init__(self, prefix: str, num_slots: int, slot_bytes: int) -> None:
        validate_prefix(prefix)
        if num_slots < 1:
            raise InvalidArgumentError("num_slots", f"must be >= 1, got {num_slots}")
        if slot_bytes < ALIGN:
            raise InvalidArgumentError("slot_bytes", f"must be >= {ALIGN}, got {slot_bytes}")
        self.prefix = prefix
        self.num_slots = num_slots
        self.slot_bytes = _align(slot_bytes)
        self.data_offset = _align(HEADER_BYTES + ENTRY_BYTES * num_slots)
        self.size = self.data_offset + self.num_slots * self.slot_bytes
        self.name = f"{prefix}-arena-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = SHM_DIR / self.name
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.fchmod(fd, 0o600)  # umask can only remove bits; make the mode exact
            # Blocking: a sweeper may hold the lock for a moment while it looks
            # at this header-less file; it leaves it alone (CREATING_GRACE_S).
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, self.size)
            self._mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        self._fd = fd  # held open: keeps the flock that marks the arena as live
        pid = os.getpid()
        OWNER.pack_into(self._mm, OWNER_OFFSET, pid, process_start_ticks(pid) or 0)
        HEADER.pack_into(self._mm, 0, MAGIC, VERSION, num_slots, self.slot_bytes, self.data_offset)
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.base_address = self._data.data_ptr()
        self._cond = threading.Condition()
        self._free = list(range(num_slots - 1, -1, -1))
        self._generation = [0] * num_slots
        self._held: set[int] = set()
        self.peak_in_use = 0
        self.closed = False

    # -- geometry -----------------------------------------------------------
    def slot_offset(self, slot: int) -> int:
        return self.data_offset + slot * self.slot_bytes

    def data_view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self._data[offset : offset + nbytes]

    @property
    def in_use(self) -> int:
        with self._cond:
            return len(self._held)

    # -- slot lifecycle -------------------------------------------------------
    def acquire(self, timeout: float | None = None) -> SlotLease:
        """Take a free slot, waiting up to `timeout` seconds (None = forever)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free or self.closed, timeout):
                raise ResourceExhaustedError(f"no free arena slot within {timeout}s ({self.num_slots} slots held)")
            if self.closed:
                raise AbortedError("arena closed")
            slot = self._free.pop()
            self._generation[slot] += 1
            gen = self._generation[slot]
            self._held.add(slot)
            self.peak_in_use = max(self.peak_in_use, len(self._held))
        # Clear the ready mark before the new bytes land: readers of the old
        # generation now see a mismatch and refuse.
        ENTRY.pack_into(self._mm, HEADER_BYTES + slot * ENTRY_BYTES, gen, 0)
        return SlotLease(self, slot, gen)

    def try_acquire(self) -> SlotLease | None:
        try:
            return self.acquire(timeout=0)
        except ResourceExhaustedError:
            return None

    def _set_ready(self, slot: int, generation: int) -> None:
        struct.pack_into("<Q", self._mm, HEADER_BYTES + slot * ENTRY_BYTES + 8, generation)

    def is_ready(self, slot: int, generation: int) -> bool:
        gen, ready = ENTRY.unpack_from(self._mm, HEADER_BYTES + slot * ENTRY_BYTES)
        return gen == generation and ready == generation

    def wait_ready(self, slot: int, generation: int, timeout_s: float) -> None:
        """Writer side: wait for a slot's pending copy (CUDA staging) to land."""
        deadline = time.monotonic() + timeout_s
        while not self.is_ready(slot, generation):
            if time.monotonic() >= deadline:
                raise DeadlineExceededError(f"slot {slot} generation {generation} not ready within {timeout_s}s")
            time.sleep(50e-6)

    def release(self, slot: int, generation: int) -> bool:
        """Give a slot back. False if it was not held at that generation."""
        with self._cond:
            if slot not in self._held or self._generation[slot] != generation:
                return False
            self._held.discard(slot)
            self._free.append(slot)
            self._cond.notify()
            return True

    def close(self) -> None:
        """Unlink the segment and drop the mapping. Safe to call twice."""
        with self._cond:
            if self.closed:
                return
            self.closed = True
            self._cond.notify_all()
        self.path.unlink(missing_ok=True)
        del self._data
        try:
            self._mm.close()
        except BufferError:
            # A tensor view still points into the mapping; the memory is freed
            # when it goes (the name is already unlinked).
            logger.debug("arena %s mapping still referenced at close", self.name)
        os.close(self._fd)

    def __enter__(self) -> ShmArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------
# Reader side
# --------------------------------------------------------------------------


class _MappedRegion:
    def __init__(
        self, name: str, mm: mmap.mmap, num_slots: int, slot_bytes: int, data_offset: int, identity: tuple[int, int] = (0, 0)
    ) -> None:
        self.name = name
        self.identity = identity  # (st_dev, st_ino) of the segment when it was mapped
        self.mm = mm
        self.size = len(mm)
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.data_offset = data_offset

    def entry(self, slot: int) -> tuple[int, int]:
        return ENTRY.unpack_from(self.mm, HEADER_BYTES + slot * ENTRY_BYTES)


class ArenaReader:
    """The reader side: validates handles, waits for readiness, maps bytes.

    Error table (code: case):
      INVALID_ARGUMENT   region name malformed or path-like; offset + byte_size
                         overflows 64 bits; the segment is not an arena (bad
                         magic, version or header); byte_size differs from
                         prod(shape) * itemsize (checked before the reader, by
                         tensor_wire.validate_ref)
      PERMISSION_DENIED  region outside this deployment's prefix, or not
                         readable by this process
      NOT_FOUND          no such region (segment gone or never existed)
      OUT_OF_RANGE       slot index, offset, or offset + byte_size outside the
                         region or outside the named slot
      ABORTED            stale generation (slot reused; the read is refused)
      DEADLINE_EXCEEDED  slot never became ready in time
    """

    def __init__(self, prefix: str, poll_interval_s: float = 50e-6) -> None:
        self.prefix = validate_prefix(prefix)
        self._regions: dict[str, _MappedRegion] = {}
        self._lock = threading.Lock()
        self.poll_interval_s = poll_interval_s

    # -- validation --------------------------------------------------------
    def _check_name(self, region: str, field: str) -> None:
        if not region or "/" in region or "\\" in region or "\x00" in region or ".." in region or not _NAME_RE.match(region):
            raise InvalidArgumentError(field, f"region name {region!r} is malformed or path-like")
        if not region.startswith(f"{self.prefix}-arena-"):
            raise PermissionDeniedError(f"{field}: region {region!r} is outside deployment prefix {self.prefix!r}")

    def _region(self, region: str, field: str) -> _MappedRegion:
        self._check_name(region, field)
        with self._lock:
            mapped = self._regions.get(region)
            if mapped is not None:
                return mapped
            # A miss is the moment to drop mappings of segments that are gone
            # (their writer exited): otherwise their memory is never freed.
            self._prune_locked()
            try:
                fd = os.open(SHM_DIR / region, os.O_RDONLY)
            except FileNotFoundError:
                raise NotFoundError(f"{field}: unknown region {region!r}") from None
            except PermissionError:
                raise PermissionDeniedError(f"{field}: region {region!r} is not readable by this process") from None
            except OSError as exc:
                raise InvalidArgumentError(field, f"region {region!r} cannot be opened: {exc.strerror}") from None
            try:
                st = os.fstat(fd)
                size = st.st_size
                if size < HEADER_BYTES:
                    raise InvalidArgumentError(field, f"region {region!r} is not an arena ({size} bytes)")
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
            finally:
                os.close(fd)
            magic, version, num_slots, slot_bytes, data_offset = HEADER.unpack_from(mm, 0)
            if magic != MAGIC or version != VERSION:
                mm.close()
                raise InvalidArgumentError(field, f"region {region!r} is not an arena of version {VERSION}")
            if data_offset < HEADER_BYTES + ENTRY_BYTES * num_slots or data_offset + num_slots * slot_bytes > size:
                # A corrupt header must not steer reads of the slot table.
                mm.close()
                raise InvalidArgumentError(field, f"region {region!r} has an inconsistent arena header")
            mapped = _MappedRegion(region, mm, num_slots, slot_bytes, data_offset, (st.st_dev, st.st_ino))
            self._regions[region] = mapped
            return mapped

    def check(self, handle: tensor_pb2.ShmHandle, field: str = "shm") -> _MappedRegion:
        """Validate every field of a handle against its region (no waiting)."""
        mapped = self._region(handle.region, f"{field}.region")
        offset, size = int(handle.offset), int(handle.byte_size)
        if offset + size > UINT64_MAX:
            raise InvalidArgumentError(f"{field}.byte_size", f"offset {offset} + byte_size {size} overflows 64 bits")
        if offset > mapped.size:
            raise OutOfRangeError(f"{field}.offset: {offset} is past the end of region {handle.region!r} ({mapped.size} bytes)")
        if offset + size > mapped.size:
            raise OutOfRangeError(
                f"{field}.byte_size: offset {offset} + byte_size {size} is past the end of region "
                f"{handle.region!r} ({mapped.size} bytes)"
            )
        if handle.slot >= mapped.num_slots:
            raise OutOfRangeError(f"{field}.slot: {handle.slot} is out of range (region has {mapped.num_slots} slots)")
        lo = mapped.data_offset + handle.slot * mapped.slot_bytes
        hi = lo + mapped.slot_bytes
        if not (lo <= offset and offset + size <= hi):
            raise OutOfRangeError(
                f"{field}.offset: bytes [{offset}, {offset + size}) are not inside slot {handle.slot} [{lo}, {hi})"
            )
        gen, _ = mapped.entry(handle.slot)
        if gen != handle.generation:
            raise AbortedError(
                f"{field}.generation: stale handle, slot {handle.slot} is at generation {gen}, handle has {handle.generation}"
            )
        return mapped

    def wait_ready(self, handle: tensor_pb2.ShmHandle, deadline: float, field: str = "shm") -> None:
        """Block until the handle's slot is ready at its generation, or fail.

        `deadline` is a time.monotonic() value.
        """
        mapped = self.check(handle, field)
        interval = self.poll_interval_s
        while True:
            gen, ready = mapped.entry(handle.slot)
            if gen != handle.generation:
                raise AbortedError(
                    f"{field}.generation: stale handle, slot {handle.slot} is at generation {gen}, handle has {handle.generation}"
                )
            if ready == handle.generation:
                return
            if time.monotonic() >= deadline:
                raise DeadlineExceededError(
                    f"{field}: slot {handle.slot} generation {handle.generation} of {handle.region!r} was not ready in time"
                )
            time.sleep(interval)
            interval = min(interval * 2, 1e-3)

    def view(self, handle: tensor_pb2.ShmHandle, field: str = "shm") -> memoryview:
        """The handle's bytes, without copying (validate first)."""
        mapped = self.check(handle, field)
        return memoryview(mapped.mm)[handle.offset : handle.offset + handle.byte_size]

    def verify_unchanged(self, handle: tensor_pb2.ShmHandle, field: str = "shm") -> None:
        """After reading: refuse the read if the slot was reused meanwhile."""
        self.check(handle, field)

    def close(self) -> None:
        with self._lock:
            for mapped in self._regions.values():
                try:
                    mapped.mm.close()
                except BufferError:
                    logger.debug("region %s still referenced at close", mapped.name)
            self._regions.clear()

    def prune(self) -> list[str]:
        """Drop mappings of segments that were unlinked (or replaced) since
        they were mapped; return their names."""
        with self._lock:
            return self._prune_locked()

    def _prune_locked(self) -> list[str]:
        gone = []
        for name, mapped in list(self._regions.items()):
            try:
                st = os.stat(SHM_DIR / name)
                alive = (st.st_dev, st.st_ino) == mapped.identity
            except FileNotFoundError:
                alive = False
            if not alive:
                gone.append(name)
                del self._regions[name]
                try:
                    mapped.mm.close()
                except BufferError:
                    # A reader still holds a view; the mapping goes with it.
                    logger.debug("region %s still referenced while pruned", name)
        return gone

    def forget(self, region: str) -> None:
        """Drop a cached mapping (its writer went away)."""
        with self._lock:
            mapped = self._regions.pop(region, None)
        if mapped is not None:
            try:
                mapped.mm.close()
            except BufferError:
                logger.debug("region %s still referenced", region)


# --------------------------------------------------------------------------
# Probe (GetMaterializerInfoRequest.arena_probe)
# --------------------------------------------------------------------------

ProbeResult = Literal["mapped", "not_found", "invalid"]


def probe_arena(region: str, prefix: str) -> ProbeResult:
    """Whether a reader serving `prefix` could read handles into segment `region`.

    Opens the segment read-only, maps it, validates the arena header exactly as
    `ArenaReader` does for a handle, then unmaps and closes it again; never
    writes to it, never unlinks it, keeps no mapping. Returns

    - "mapped": a valid arena under `<prefix>-arena-`, mapped here;
    - "not_found": no segment of that name is visible here (another host,
      container or shared-memory namespace);
    - "invalid": the name is malformed or outside the prefix, the segment is
      not a valid arena (magic, version, header), or it cannot be opened or
      mapped by this process.
    """
    try:
        reader = ArenaReader(prefix)
    except InvalidArgumentError:
        return "invalid"
    try:
        reader._region(region, "arena_probe")
    except NotFoundError:
        return "not_found"
    except (InvalidArgumentError, PermissionDeniedError, OSError, ValueError, struct.error):
        return "invalid"
    finally:
        reader.close()
    return "mapped"
