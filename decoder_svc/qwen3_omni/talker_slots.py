"""The talker's per-request state as tensors indexed by slot.

Every running talker request owns a *slot*: a row in each of a few tensors on
the model's device. The talker's step reads and writes them with batched
tensor ops, without a Python read per row and without a device-to-host copy:

- ``forward`` (:meth:`TalkerSlots.step_inputs`): each scheduled token past
  its request's prompt gets the residual codes' embedding sum of the frame
  at its position plus the text row of its step (or the request's
  ``tts_pad`` row once the text has run out), selected by position with
  ``torch.where``;
- ``compute_logits`` (:meth:`TalkerSlots.penalize`): the repetition penalty on
  the codebook-0 ids each request sampled before, as a mask;
- after the code predictor (:meth:`TalkerSlots.record`): the frame's residual
  sum (stored at the frame's index), the frame counter of the counter-based
  sampler and the sampled id, by scatter.

The input rows are kept per position, not only the last one: a step that
computes several positions of a request past its prompt (a request
recomputed after a preemption) reads each position's own residual sum and
text row, as its decode steps did.

What the step reads per row is one slot index: :meth:`TalkerSlots.prepare`
maps the runner's batch (request ids in row order and the query start
locations, host values) to ``row_slot`` (one per scheduled token) and
``req_slot`` (one per request), persistent device buffers written once per
step before the forward (the runner's ``_preprocess``: outside any captured
graph), and only when the batch changed.

The text rows of every request live in one flat pool ``[P, H]``, and the
residual sums of its frames in another (:class:`RowPool`): each slot a region
(offset, capacity) in it, so a step's rows are one gather each. Rows that
keep arriving (text of a talker request started from the first rows of the
thinker's reply; a frame per step) are written in place; a region that is
full moves to the pool's free tail (doubling), and the pool is compacted, or
grown, when the tail runs out: appending is amortised O(rows), not a copy of
the whole queue each time. A frame's residual row is written on the device
at the request's frame count, so :meth:`TalkerSlots.prepare` makes room for
the step's frames from the host's positions before the step (no device
value is read).

Threads: requests are added, extended and removed from any thread
(:meth:`add`, :meth:`extend`, :meth:`remove`: host bookkeeping under a lock,
plus a queue of device writes); the queue is applied by the step's thread in
:meth:`prepare`, before the forward, so the step's device tensors have one
writer and a step never sees half of a change. A slot is reused only after
its removal was applied. Slot 0 is a sentinel (no request): rows of requests
the store does not know (removed while still in the batch, padding rows)
read it and add nothing; writes for rows without a frame go to it and are
cleared.

The store grows (slots, pool, step buffers) when it needs to, between steps.
Growth replaces the tensors, so a step captured as a CUDA graph would keep
reading the old ones: the capacities must be set for the deployment before
any capture (they are not, yet: the talker runs eagerly).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .code_sampling import SamplingBatch, candidate_count, seed_words

__all__ = ["RowPool", "TalkerRequestState", "TalkerSlots"]

_NO_PROMPT = 2**62  # the sentinel's prompt length: every position is before it
_MIN_REGION = 32  # rows of a new region (text or frames)


@dataclass
class TalkerRequestState:
    """What a talker request starts with (:meth:`TalkerSlots.add`)."""

    prompt_len: int
    trailing: torch.Tensor  # [N, H] projected text embeddings, one per decode step
    pad: torch.Tensor  # [H] projected tts_pad embedding
    # False while the thinker's reply is still arriving: steps past the text
    # rows so far wait for more (the backend holds the request, :meth:`TalkerSlots.held`)
    # instead of reading ``pad``.
    complete: bool = True
    repetition_penalty: float = 1.0
    temperature: float = 0.0  # the code predictor's sampling
    top_k: int = 0
    top_p: float = 1.0
    # The request's seed (unsigned 64-bit): the code predictor's noise key,
    # with the frame index (frames predicted so far, counted in the store:
    # never steps or batch rows, so the draws do not depend on the batch).
    seed: int = 0


@dataclass
class _Host:
    """A live request's host-side facts (what scheduling decisions read)."""

    slot: int
    prompt_len: int
    text_len: int  # text rows given so far
    complete: bool


@dataclass
class _Region:
    off: int
    len: int  # rows written from the host (the text pool; the residual pool's are counted on the device)
    cap: int


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


class RowPool:
    """Rows ``[P, H]`` on the device shared by the slots, each slot a region
    of it (``off`` / ``cap``: device copies of the regions, per slot). Used
    by the step's thread only."""

    def __init__(self, hidden_size: int, device: torch.device, rows: int, slots: int) -> None:
        self.hidden_size = hidden_size
        self.device = device
        self.data = torch.zeros((max(int(rows), 1), hidden_size), device=device)
        self.off = torch.zeros(slots, dtype=torch.int64, device=device)
        self.cap = torch.zeros(slots, dtype=torch.int64, device=device)
        self.cap_host = np.zeros(slots, dtype=np.int64)
        self.regions: dict[int, _Region] = {}
        self.tail = 0

    def resize(self, slots: int) -> None:
        """Room for ``slots`` slots (the per-slot tensors grown, rows kept)."""
        for name in ("off", "cap"):
            old = getattr(self, name)
            new = torch.zeros(slots, dtype=torch.int64, device=self.device)
            new[: old.shape[0]] = old
            setattr(self, name, new)
        self.cap_host = np.concatenate((self.cap_host, np.zeros(slots - self.cap_host.shape[0], np.int64)))

    def open(self, slot: int, rows: int, *, exact: bool = False) -> None:
        """A new region for ``slot`` with room for ``rows`` rows."""
        cap = max(int(rows), 1) if exact else _pow2_at_least(max(int(rows), _MIN_REGION))
        region = self.regions[slot] = _Region(self._alloc(cap), 0, cap)
        self._set(slot, region)

    def close(self, slot: int) -> None:
        self.regions.pop(slot, None)
        self.cap_host[slot] = 0

    def reserve(self, slot: int, rows: int) -> None:
        """Room for ``rows`` rows in ``slot``'s region: a region too small
        moves, with its rows, to one of the next power of two at least that."""
        region = self.regions.get(slot)
        if region is None or rows <= region.cap:
            return
        cap = _pow2_at_least(rows)
        off = self._alloc(cap)  # may compact: region.off can change (the old rows move with it)
        self.data[off : off + region.cap] = self.data[region.off : region.off + region.cap]
        region.off, region.cap = off, cap
        self._set(slot, region)

    def append(self, slot: int, rows: torch.Tensor) -> int:
        """Write host rows [k, H] after the region's rows; its row count after."""
        region = self.regions.get(slot)
        if region is None:
            return 0
        k = int(rows.shape[0])
        if k:
            self.reserve(slot, region.len + k)
            at = region.off + region.len
            self.data[at : at + k] = rows.to(self.device, non_blocking=True)
            region.len += k
        return region.len

    def _set(self, slot: int, region: _Region) -> None:
        self.off[slot] = region.off
        self.cap[slot] = region.cap
        self.cap_host[slot] = region.cap

    def _alloc(self, cap: int) -> int:
        """A region of ``cap`` rows at the pool's tail (compacting, then growing, when it does not fit)."""
        if self.tail + cap > self.data.shape[0]:
            self._compact()
        if self.tail + cap > self.data.shape[0]:
            rows = max(self.tail + cap, 2 * self.data.shape[0])
            grown = torch.zeros((rows, self.hidden_size), device=self.device)
            grown[: self.tail] = self.data[: self.tail]
            self.data = grown
        off = self.tail
        self.tail += cap
        return off

    def _compact(self) -> None:
        """Move the live regions to the pool's front, in order."""
        at = 0
        moved: list[tuple[int, int]] = []
        for slot, region in sorted(self.regions.items(), key=lambda kv: kv[1].off):
            if region.off != at:
                self.data[at : at + region.cap] = self.data[region.off : region.off + region.cap].clone()
                region.off = at
                moved.append((slot, at))
            at += region.cap
        self.tail = at
        if moved:
            idx, off = zip(*moved, strict=True)
            self.off[torch.tensor(idx, device=self.device)] = torch.tensor(off, device=self.device)


class TalkerSlots:
    """Per-request talker state in slot-indexed tensors (module docstring)."""

    def __init__(self, hidden_size: int, vocab_size: int, *, device: torch.device | str | None = None,
                 capacity: int = 16, pool_rows: int = 1024) -> None:
        self.hidden_size = int(hidden_size)
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device or "cpu")
        self._lock = threading.Lock()
        capacity = max(int(capacity), 2)
        # host side (under the lock)
        self._live: dict[str, _Host] = {}
        self._free: list[int] = []  # slots whose removal was applied
        self._next = 1  # slot 0 is the sentinel
        self._ops: list[tuple[Any, ...]] = []  # device writes, applied by prepare()
        self._temperature = np.zeros(capacity, dtype=np.float32)  # per slot: the sampler's static size
        self._top_k = np.zeros(capacity, dtype=np.int64)
        self._prompt_len = np.zeros(capacity, dtype=np.int64)  # and the frames' room
        # step thread only
        self._key: Any = None  # the batch the step buffers were written for
        self._rows = 0  # step buffer rows written by the last prepare
        self._reqs: list[str] = []  # that batch's row ids
        self._req_idx = np.zeros(0, dtype=np.int64)  # and their slots
        self.capacity = 0
        self.text = RowPool(self.hidden_size, self.device, pool_rows, capacity)  # text rows, by step
        self.residual = RowPool(self.hidden_size, self.device, pool_rows, capacity)  # residual sums, by frame
        self._alloc_slots(capacity)
        self.residual.open(0, 1, exact=True)  # the sentinel's: what rows without a frame write
        self.row_slot = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.req_slot = torch.zeros(0, dtype=torch.int64, device=self.device)

    # -- device tensors ------------------------------------------------------------
    _PER_SLOT = ("prompt_len", "text_len", "pad", "penalty", "seen", "temperature", "top_k", "top_p", "seed",
                 "frames")

    def _alloc_slots(self, capacity: int) -> None:
        """(Re)allocate the per-slot tensors for ``capacity`` slots, keeping the old rows."""
        old = {name: getattr(self, name) for name in self._PER_SLOT} if self.capacity else {}
        dev, s = self.device, capacity
        self.prompt_len = torch.full((s,), _NO_PROMPT, dtype=torch.int64, device=dev)
        self.text_len = torch.zeros(s, dtype=torch.int64, device=dev)
        self.pad = torch.zeros((s, self.hidden_size), device=dev)
        self.penalty = torch.ones(s, device=dev)
        self.seen = torch.zeros((s, self.vocab_size), dtype=torch.bool, device=dev)  # codebook-0 ids sampled
        self.temperature = torch.zeros(s, device=dev)
        self.top_k = torch.zeros(s, dtype=torch.int64, device=dev)
        self.top_p = torch.ones(s, device=dev)
        self.seed = torch.zeros((s, 2), dtype=torch.int64, device=dev)
        self.frames = torch.zeros(s, dtype=torch.int64, device=dev)  # frames predicted
        for name, t in old.items():
            getattr(self, name)[: t.shape[0]] = t
        if self.capacity:
            self.text.resize(s)
            self.residual.resize(s)
        self.capacity = capacity

    # -- requests (any thread) -----------------------------------------------------
    def add(self, request_id: str, state: TalkerRequestState) -> int:
        """Take a slot for a request (its device state is written before the next step)."""
        trailing = state.trailing.detach().to(torch.float32).reshape(-1, self.hidden_size)
        pad = state.pad.detach().to(torch.float32).reshape(self.hidden_size)
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request {request_id!r} already has a talker slot")
            slot = self._free.pop() if self._free else self._next
            if slot == self._next:
                self._next += 1
            if slot >= self._temperature.shape[0]:
                grow = max(slot + 1, 2 * self._temperature.shape[0]) - self._temperature.shape[0]
                self._temperature, self._top_k, self._prompt_len = (
                    np.concatenate((a, np.zeros(grow, a.dtype)))
                    for a in (self._temperature, self._top_k, self._prompt_len))
            self._temperature[slot], self._top_k[slot] = state.temperature, state.top_k
            self._prompt_len[slot] = state.prompt_len
            self._live[request_id] = _Host(slot, int(state.prompt_len), int(trailing.shape[0]), bool(state.complete))
            self._ops.append(("add", slot, state, trailing, pad))
        return slot

    def extend(self, request_id: str, rows: torch.Tensor, complete: bool) -> bool:
        """Append text rows [k, H] (k may be 0) to a request's; ``complete``:
        no more will come. False when the request has no slot (it ended)."""
        rows = rows.detach().to(torch.float32).reshape(-1, self.hidden_size)
        with self._lock:
            host = self._live.get(request_id)
            if host is None:
                return False
            host.complete = bool(complete)
            if rows.shape[0]:
                host.text_len += int(rows.shape[0])
                self._ops.append(("text", host.slot, rows))
        return True

    def remove(self, request_id: str) -> None:
        """Free a request's slot (once the next step is prepared); unknown ids are ignored."""
        with self._lock:
            host = self._live.pop(request_id, None)
            if host is not None:
                self._ops.append(("free", host.slot))

    def held(self, request_id: str, position: int) -> bool:
        """Whether the step at ``position`` needs a text row that has not arrived yet."""
        with self._lock:
            host = self._live.get(request_id)
            return host is not None and not host.complete and position - host.prompt_len >= host.text_len

    def live(self) -> list[str]:
        """The ids of the requests holding a slot."""
        with self._lock:
            return list(self._live)

    # -- the step (the step's thread) -----------------------------------------------
    def prepare(self, row_ids: Sequence[str], query_start_loc: Sequence[int], computed: Sequence[int],
                key: Callable[[str], str] | None = None) -> None:
        """Before a step's forward: apply the queued writes, map the step's
        rows to slots and make room for the frames the step predicts.
        ``row_ids``: the step's requests in batch order (``key`` maps one to
        the id it was added under); ``query_start_loc`` [n + 1]: where each
        request's tokens start; ``computed`` [n]: each request's tokens
        computed before the step (host values)."""
        changed = self._apply()
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        batch = (tuple(row_ids), qsl.tobytes())
        if changed or batch != self._key:
            with self._lock:
                slots = [self._slot_of(key(r) if key else r) for r in row_ids]
            req = torch.tensor(slots, dtype=torch.int64)
            rows = torch.repeat_interleave(req, torch.from_numpy(np.diff(qsl)))
            self.row_slot = self._write_step(self.row_slot, rows, self._rows)
            self.req_slot = self._write_step(self.req_slot, req, len(self._reqs))
            with self._lock:
                self._key, self._rows, self._reqs, self._req_idx = batch, int(rows.shape[0]), list(row_ids), req.numpy()
        # the frame a request's last token samples is stored at index (its position - prompt length + 1)
        idx = self._req_idx
        if idx.shape[0]:
            need = np.asarray(computed, dtype=np.int64)[: idx.shape[0]] + np.diff(qsl) - self._prompt_len[idx] + 1
            short = (need > self.residual.cap_host[idx]) & (idx > 0)
            for slot, rows_needed in zip(idx[short].tolist(), need[short].tolist(), strict=True):
                self.residual.reserve(slot, rows_needed)

    def _slot_of(self, request_id: str) -> int:
        host = self._live.get(request_id)
        return 0 if host is None else host.slot

    def _write_step(self, buf: torch.Tensor, values: torch.Tensor, stale: int) -> torch.Tensor:
        """Write a step's slots to the front of a persistent buffer (the
        previous step's rows past them back to the sentinel)."""
        n = int(values.shape[0])
        if n > buf.shape[0]:
            grown = torch.zeros(max(n, 2 * buf.shape[0], 64), dtype=torch.int64, device=self.device)
            grown[: buf.shape[0]] = buf
            buf = grown
        if n:
            buf[:n].copy_(values.to(self.device, non_blocking=True))
        if stale > n:
            buf[n:stale].zero_()
        return buf

    def _step_rows(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        """The first n entries of a step buffer (rows past what prepare wrote read the sentinel)."""
        if n > buf.shape[0]:  # e.g. a padded batch larger than any step so far
            buf = torch.cat((buf, torch.zeros(n - buf.shape[0], dtype=torch.int64, device=buf.device)))
        return buf[:n]

    def step_inputs(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``forward``: embeds [T, H] of the step's tokens plus, for each
        token at step k past its request's prompt whose frame k was
        predicted, that frame's residual sum and the step's text row
        (``tts_pad`` past the text). positions [T]: each token's position."""
        n = embeds.shape[0]
        slot = self._step_rows(self.row_slot, n)
        step = positions.reshape(-1)[:n].to(torch.int64) - self.prompt_len[slot]
        k = step.clamp(min=0)
        decode = (step >= 0) & (k < self.frames[slot])
        text, res = self.text, self.residual
        in_text = k < self.text_len[slot]
        text_row = text.data[(text.off[slot] + k).clamp(max=text.data.shape[0] - 1)]
        res_row = res.data[(res.off[slot] + k).clamp(max=res.data.shape[0] - 1)]
        extra = res_row + torch.where(in_text[:, None], text_row, self.pad[slot])
        return embeds + torch.where(decode[:, None], extra, 0).to(embeds.dtype)

    def penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """``compute_logits``: logits [n, V] (one row per request, batch
        order) with each request's repetition penalty on the ids it sampled
        (x * p below zero, x / p above; a penalty of 1 changes nothing)."""
        slot = self._step_rows(self.req_slot, logits.shape[0])
        p = self.penalty[slot][:, None]
        seen = self.seen[slot][:, : logits.shape[-1]]
        return torch.where(seen, torch.where(logits < 0, logits * p, logits / p), logits)

    def frame_rows(self, row_ids: Sequence[str], vocab_size: int,
                   key: Callable[[str], str] | None = None) -> tuple[torch.Tensor, SamplingBatch]:
        """After the step's sampling: the slots of its requests (int64 [n],
        device) and the code predictor's settings for them (``vocab_size``:
        the predictor's). The prepared step's slots when ``row_ids`` is its
        batch (no host work), else mapped now (the sentinel for requests
        without room for a frame)."""
        with self._lock:
            if list(row_ids) == self._reqs:
                idx, slot = self._req_idx, self.req_slot[: len(row_ids)]
            else:
                idx = np.array([self._slot_of(key(r) if key else r) for r in row_ids], dtype=np.int64)
                slot = torch.from_numpy(idx).to(self.device, non_blocking=True)
            candidates = candidate_count(self._temperature[idx], self._top_k[idx], vocab_size)
        return slot, SamplingBatch(temperature=self.temperature[slot], top_k=self.top_k[slot],
                                   top_p=self.top_p[slot], seed=self.seed[slot], frame=self.frames[slot],
                                   candidates=candidates)

    def record(self, slot: torch.Tensor, ok: torch.Tensor, code0: torch.Tensor, embed_sum: torch.Tensor) -> None:
        """After the code predictor: for rows with ``ok`` (bool [n]), the
        frame's residual sum [n, H] is stored at the request's frame index,
        its frame count goes up by one and ``code0`` [n] joins its sampled
        ids. Rows without ``ok`` write to the sentinel, which is cleared. A
        frame past the room :meth:`prepare` made overwrites the region's last
        row (never another request's)."""
        res = self.residual
        target = torch.where(ok, slot, 0)
        at = res.off[target] + torch.minimum(self.frames[target], res.cap[target] - 1)
        res.data.index_copy_(0, at, embed_sum.to(res.data.dtype))
        self.frames.index_add_(0, target, torch.ones_like(target))
        self.seen[target, code0] = True
        self.frames[0] = 0
        self.seen[0] = False

    def frame_residual(self, slot: int, frame: int) -> torch.Tensor:
        """The residual sum [H] stored for a slot's frame (a view; for checks and tools)."""
        return self.residual.data[self.residual.regions[slot].off + frame]

    # -- queued writes (the step's thread) ---------------------------------------------
    def _apply(self) -> bool:
        """Apply the queued device writes; True when a slot was taken or freed."""
        with self._lock:
            ops, self._ops = self._ops, []
            needed = self._next
        if not ops:
            return False
        if needed > self.capacity:
            self._alloc_slots(max(needed, 2 * self.capacity))
        slots_changed = False
        for op in ops:
            if op[0] == "text":
                self.text_len[op[1]] = self.text.append(op[1], op[2])
                continue
            slots_changed = True
            if op[0] == "add":
                self._write_request(*op[1:])
            else:
                self._release(op[1])
        return slots_changed

    def _write_request(self, slot: int, st: TalkerRequestState, trailing: torch.Tensor, pad: torch.Tensor) -> None:
        self.prompt_len[slot] = int(st.prompt_len)
        self.pad[slot].copy_(pad.to(self.device, non_blocking=True))
        self.penalty[slot] = float(st.repetition_penalty)
        self.seen[slot] = False
        self.temperature[slot] = float(st.temperature)
        self.top_k[slot] = int(st.top_k)
        self.top_p[slot] = float(st.top_p)
        self.seed[slot].copy_(torch.tensor(seed_words(st.seed), dtype=torch.int64).to(self.device, non_blocking=True))
        self.frames[slot] = 0
        self.text.open(slot, trailing.shape[0])
        self.text_len[slot] = self.text.append(slot, trailing)
        self.residual.open(slot, _MIN_REGION)

    def _release(self, slot: int) -> None:
        self.text.close(slot)
        self.residual.close(slot)
        self.prompt_len[slot] = _NO_PROMPT
        self.text_len[slot] = 0
        self.frames[slot] = 0
        with self._lock:
            self._free.append(slot)
