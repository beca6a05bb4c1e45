"""Step assembly: a captured engine step turned into the ``StepOutput`` the decode loop hands on.

Two halves, both on the stage thread:

- :func:`take_capture`, in the step hook (inside ``engine.step()``, or right
  after it for a capture fetched from a worker process): the sampled ids
  come to the host (the step's one device-to-host copy; a copy in any case,
  int32 -> int64, so the sampler's tensor is never touched), with the
  runner's host metadata; hidden rows, codes and extras stay the runner's
  tensors on its device (``.backend``'s module docstring: why that is safe,
  and when -- CUDA graphs -- the one copy is taken here instead);
- :func:`build_step`, once the engine processed the step: batched row
  selection. Rows dropped (consistently across request ids, spans, tokens,
  hidden rows and codes): rows whose sampled token is discarded (a partial
  prefill chunk: its per-token rows are held by :class:`RowLedger` and come
  out with the step that samples) or a ``-1`` placeholder, and rows of
  requests that already finished or were aborted. When every row is kept (the common step) the
  capture's tensors are handed on as they are; otherwise rows are picked
  with index tensors on the tensors' own device (no boolean masks: their
  size is data-dependent, which would sync). Per-request lists and dicts are
  :class:`decoder_svc.backend.LazyList` / ``LazyDict``: built where they are
  read (the snapshot's sender thread, the router), not in the step.

Rows of requests that already finished or were aborted are dropped because
async scheduling schedules step N + 1 before it sees that a request stopped
at step N.

The critical path: per step only one device-to-host copy of the sampled ids
(``[n, 1 + num_spec]``, the step's one sync; everything host-side is decided
from it and the runner's host-side metadata), the talker's code predictor
(on the device), and row selection. Large tensors are never copied here:
``hidden_states`` and the per-token extras are the runner's own tensors of
the step (:func:`.capture.outputs_are_fresh` says why that is safe, and
when -- CUDA graphs -- the one copy is taken instead), so the snapshot's
slot copy is the step's only copy of them.

Prefix caching: cached prompt tokens are not scheduled, so they have no hidden
rows; ``query_start_loc`` / ``num_scheduled_tokens`` / ``spans`` describe
exactly the rows present in ``hidden_states`` (taken from the runner's
``query_start_loc`` at sample time, recomputed after dropping rows). The code
predictor reads only each request's last scheduled row. A consumer that needs
every prompt row (the thinker's hidden states as talker conditioning) must
run that stage with prefix caching off, as the shipped profiles do.

Speculative decoding (thinker only): ``sampled_token_ids`` holds each row's
last kept token and ``new_token_ids`` every token the engine kept; hidden
rows include the draft positions the step scheduled.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from decoder_svc import metrics
from decoder_svc.backend import LazyDict, LazyList, StepOutput
from omni_common.materialize import PER_REQUEST as TENSOR_LAYOUT_PER_REQUEST
from omni_common.materialize import PER_TOKEN as TENSOR_LAYOUT_PER_TOKEN

from .capture import StepCapture

__all__ = ["Captured", "HeldRows", "RowLedger", "RowPlan", "VLLMStepOutput", "build_step", "engine_outputs", "pop_capture",
           "take_capture"]


@dataclass
class VLLMStepOutput(StepOutput):
    """StepOutput plus the runner's capture index of the step (diagnostics).

    ``new_token_ids[rid]`` (thinker) lists every token the row accepted this
    step (one without speculative decoding, where it equals
    ``sampled_token_ids[i]``); ``text_deltas[rid]`` (thinker) is the engine's
    detokenized delta for it, possibly "" (incomplete UTF-8 is held back).
    """

    engine_step: int = -1


def _new_token_ids(
    request_ids: list[str], tokens: torch.Tensor, engine_ids: dict[str, list[int]]
) -> dict[str, list[int]]:
    """Per request: the tokens the engine reported, else the captured one."""
    captured = tokens[:, 0].tolist()
    return {rid: engine_ids.get(rid) or [t] for rid, t in zip(request_ids, captured, strict=True)}


class _Picker:
    """Row selection on each tensor's own device: the host index tensors are
    moved to a device once per step (an index of known length: no sync)."""

    def __init__(self, rows: torch.Tensor, token_rows: torch.Tensor) -> None:
        self._host = {"rows": rows, "tokens": token_rows}
        self._on: dict[tuple[str, torch.device], torch.Tensor] = {}

    def _index(self, kind: str, device: torch.device) -> torch.Tensor:
        key = (kind, device)
        idx = self._on.get(key)
        if idx is None:
            idx = self._on[key] = self._host[kind].to(device, non_blocking=True)
        return idx

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, self._index("rows", t.device))

    def tokens(self, t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, self._index("tokens", t.device))


@dataclass
class Captured:
    """One engine step as seen by the hook (stage thread), detached."""

    key: Any  # the step's SchedulerOutput (identity)
    step_index: int
    req_ids: list[str]  # internal ids, batch order
    row_ok: torch.Tensor  # [n] bool (host): a token was sampled and kept
    discarded: torch.Tensor  # [n] bool (host): the row's token is discarded (a partial prefill chunk)
    all_ok: bool  # row_ok.all()
    num_scheduled: torch.Tensor  # [n] int32 (host)
    computed: torch.Tensor  # [n] int32 (host): each request's tokens in KV before the step
    query_start_loc: torch.Tensor  # [n + 1] int32 (host)
    tokens: torch.Tensor  # [n, 1] int64 (host): the row's last accepted token
    accepted: torch.Tensor | None  # [n, S] int64 (host; -1 = none), only when S > 1
    hidden: torch.Tensor | None  # [T, H] float32 (device; capture_hidden): the runner's tensor or the one copy
    codes: torch.Tensor | None  # [n, K] int64 (device; talker)
    extra: dict[str, torch.Tensor]  # per-token tensors [T, ...] (device; model-specific)


def timed_codes(
    codes_of: Callable[[StepCapture, torch.Tensor], torch.Tensor], stage: str
) -> Callable[[StepCapture, torch.Tensor], torch.Tensor]:
    """`codes_of` (a talker's code predictor over the step's rows), its host
    time observed in ``omni_decoder_code_predictor_seconds{stage}``."""
    histogram = metrics.CODE_PREDICTOR_TIME.labels(stage)

    def timed(cap: StepCapture, row_ok: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return codes_of(cap, row_ok)
        finally:
            histogram.observe(time.perf_counter() - t0)

    return timed


def take_capture(
    cap: StepCapture,
    *,
    key: Any = None,
    codes_of: Callable[[StepCapture, torch.Tensor], torch.Tensor] | None,
    extra: dict[str, torch.Tensor] | None,
    extra_of: Callable[[StepCapture], dict[str, torch.Tensor]],
    capture_hidden: bool,
    copy_hidden: bool,
) -> Captured:
    """One captured step, detached from the runner's bookkeeping (module
    docstring). key: the step's SchedulerOutput (identity; default the
    capture's own); codes_of: the
    talker's frame codes of each row (``(cap, row_ok [n] bool on the
    runner's device) -> [n, K]``, called before the sampled ids are copied
    to the host, so that its device work is queued ahead of that copy;
    None: not a talker; one token per row); extra: the per-token extras fetched with
    the capture, else ``extra_of(cap)``; capture_hidden / copy_hidden: keep
    the hidden rows, and take the one copy of them."""
    codes = None
    if codes_of is not None:
        dev_sampled = cap.sampled_token_ids
        kept = (~cap.discard_mask.to(torch.bool)).to(dev_sampled.device, non_blocking=True)
        codes = codes_of(cap, kept & (dev_sampled[:, 0] >= 0))
    sampled = cap.sampled_token_ids.to("cpu", torch.int64, copy=True)
    n, s = sampled.shape
    if s == 1:
        row_ok = ~cap.discard_mask.to(torch.bool)
        row_ok &= sampled[:, 0] >= 0
        tokens, accepted = sampled, None
    else:  # speculative decoding: accepted tokens are a prefix, -1 after
        nvalid = (sampled >= 0).sum(1)
        row_ok = (~cap.discard_mask.to(torch.bool)) & (nvalid > 0)
        tokens = sampled.gather(1, (nvalid - 1).clamp(min=0)[:, None])
        accepted = sampled
    hidden = None
    if capture_hidden:
        hidden = cap.hidden_states
        if copy_hidden or hidden.dtype != torch.float32:
            # the one copy (a CUDA graph's buffer is rewritten by the next
            # replay); a conversion from the model's dtype is folded in
            hidden = hidden.to(torch.float32, copy=True)
    if extra is None:
        extra = extra_of(cap)
    return Captured(
        key=cap.scheduler_output if key is None else key,
        step_index=cap.step_index,
        req_ids=cap.req_ids,
        row_ok=row_ok,
        discarded=cap.discard_mask.to(torch.bool),
        all_ok=bool(row_ok.all()),
        num_scheduled=cap.num_scheduled_tokens,
        computed=cap.num_computed_tokens,
        query_start_loc=cap.query_start_loc,
        tokens=tokens,
        accepted=accepted,
        hidden=hidden,
        codes=codes,
        extra=extra,
    )


def _with_held(
    cap: Captured, rows: list[int], starts: torch.Tensor, nst: torch.Tensor,
    held: dict[int, HeldRows],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """(token row index, rows per kept request, hidden and extras to pick
    from): the step's tensors with the held rows appended, each kept
    request's held rows indexed ahead of its own (a step that ends a chunked
    prefill: rare, one copy of the step's rows)."""
    total = int(cap.query_start_loc[-1])
    parts: list[torch.Tensor] = []
    counts = nst.clone()
    hidden_parts = [] if cap.hidden is None else [cap.hidden[:total]]
    extra_parts: dict[str, list[torch.Tensor]] = {name: [t[:total]] for name, t in cap.extra.items()}
    at = total
    for j, i in enumerate(rows):
        h = held.get(i)
        if h is not None:
            parts.append(torch.arange(at, at + h.count, dtype=torch.int64))
            at += h.count
            counts[j] += h.count
            if h.hidden is not None:
                hidden_parts.append(h.hidden)
            for name, t in h.extra.items():
                extra_parts[name].append(t)
        start, n = int(starts[j]), int(nst[j])
        parts.append(torch.arange(start, start + n, dtype=torch.int64))
    tok_idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    hidden = None if cap.hidden is None else torch.cat(hidden_parts)
    return tok_idx, counts, hidden, {name: torch.cat(ts) for name, ts in extra_parts.items()}


def build_step(
    cap: Captured,
    live: list[bool],
    ext_ids: list[str],
    finished: dict[str, str],
    text: dict[str, str],
    engine_ids: dict[str, list[int]],
    *,
    is_talker: bool,
    plan: RowPlan | None = None,
) -> tuple[VLLMStepOutput, int]:
    """(the step's output, rows dropped): batched row selection, dropping
    dead / discarded / placeholder rows; with a ``plan``
    (:meth:`RowLedger.plan`) each row's first ``plan.skip[i]`` token rows
    (positions its request handed on before) are dropped and the rows held
    from its partial-prefill steps come ahead of its own.

    Critical path: when every row is kept (the common step) the capture's
    tensors are handed on as they are; otherwise rows are picked with one
    index per device. Per-request lists and dicts are lazy."""
    n_all = len(cap.req_ids)
    dropped = 0
    if plan is None and cap.all_ok and all(live):
        request_ids = ext_ids
        rows: Any = LazyList(lambda: range(n_all))
        nst, qsl, tokens = cap.num_scheduled, cap.query_start_loc, cap.tokens
        hidden, codes, extra = cap.hidden, cap.codes, cap.extra
    else:
        keep = cap.row_ok & torch.tensor(live, dtype=torch.bool)
        idx = keep.nonzero().squeeze(1)  # host
        rows = idx.tolist()
        dropped = n_all - len(rows)
        request_ids = [ext_ids[i] for i in rows]
        nst = cap.num_scheduled[idx]
        starts = cap.query_start_loc[:-1][idx].to(torch.int64)
        if plan is not None and plan.skip is not None:  # a recompute's rows of positions handed on before
            nst = nst - plan.skip[idx]
            starts = starts + plan.skip[idx]
        src_hidden, src_extra = cap.hidden, cap.extra
        if plan is not None and plan.held:
            tok_idx, nst, src_hidden, src_extra = _with_held(cap, rows, starts, nst, plan.held)
        else:  # token rows of the kept requests, in order: [sum(nst)] int64
            tok_idx = torch.arange(int(nst.sum()), dtype=torch.int64) + torch.repeat_interleave(
                starts - (torch.cumsum(nst, 0) - nst).to(torch.int64), nst.to(torch.int64)
            )
        qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(nst, 0)
        tokens = cap.tokens[idx]
        pick = _Picker(idx, tok_idx)
        hidden = None if src_hidden is None else pick.tokens(src_hidden)
        codes = None if cap.codes is None else pick.rows(cap.codes)
        extra = {name: pick.tokens(t) for name, t in src_extra.items()}
    new_ids: Any = {}
    deltas: Any = {}
    if not is_talker:  # text stage: token ids + text per row, as the engine reports them
        if cap.accepted is not None:
            # speculative decoding: a row may have sampled past the request's
            # end (the scheduler cuts at max_tokens / stop); its last token
            # is the last one the engine kept.
            new_ids = _new_token_ids(request_ids, tokens, engine_ids)
            tokens = torch.tensor(
                [[new_ids[rid][-1]] for rid in request_ids], dtype=torch.int64
            ).reshape(-1, 1)
        else:
            step_tokens = tokens
            new_ids = LazyDict(lambda: _new_token_ids(request_ids, step_tokens, engine_ids))
        deltas = LazyDict(lambda: {rid: text.get(rid, "") for rid in request_ids})
    mm: dict[str, tuple[torch.Tensor, int]] = {
        name: (t, TENSOR_LAYOUT_PER_TOKEN) for name, t in extra.items()
    }
    if codes is not None:
        mm["codec_codes"] = (codes, TENSOR_LAYOUT_PER_REQUEST)
    done: dict[str, str] = {}
    if finished:  # rare: a set of this step's ids only then
        present = set(request_ids)
        done = {r: why for r, why in finished.items() if r in present}
    counts = nst
    out = VLLMStepOutput(
        request_ids=request_ids,
        batch_indices=rows,
        num_scheduled_tokens=LazyList(lambda: counts.tolist()),
        query_start_loc=qsl,
        sampled_token_ids=tokens,
        hidden_states=hidden,
        mm_outputs=mm,
        finished=done,
        text_deltas=deltas,
        new_token_ids=new_ids,
        engine_step=cap.step_index,
    )
    return out, dropped


@dataclass
class HeldRows:
    """Per-token rows of positions computed by partial-prefill steps, held
    for the step that samples (on the runner's device)."""

    count: int
    hidden: torch.Tensor | None  # [count, H]
    extra: dict[str, torch.Tensor]  # name -> [count, ...]

    @staticmethod
    def join(chunks: list[HeldRows]) -> HeldRows:
        first = chunks[0]
        if len(chunks) == 1:
            return first
        return HeldRows(sum(c.count for c in chunks),
                        None if first.hidden is None else torch.cat([c.hidden for c in chunks if c.hidden is not None]),
                        {name: torch.cat([c.extra[name] for c in chunks]) for name in first.extra})


@dataclass
class RowPlan:
    """How a step's per-token rows are handed on (:meth:`RowLedger.plan`).

    ``skip`` [n] int32 (host), or None: each row's first token rows that are
    of positions its request handed on (or held) before; ``held``: row ->
    the rows its request's earlier partial-prefill steps computed, handed on
    ahead of the row's own."""

    skip: torch.Tensor | None
    held: dict[int, HeldRows]


class RowLedger:
    """Per live request: the positions whose per-token rows (hidden rows,
    extras) were handed on or held, and the rows held.

    Every position's row reaches consumers once, as first computed, and a
    request's rows come out complete with the step that samples its next
    token:

    - a chunked prefill computes a long prompt over several steps; the steps
      before the last sample nothing (vLLM discards their token), so their
      rows are held here (one copy of those rows) and handed on ahead of the
      rows of the step that samples: a consumer that needs every prompt row
      (the thinker's rows conditioning the talker) gets them in one step, as
      without chunking;
    - a request the engine preempted lost its KV; when it resumes, its prompt
      and every token decoded so far are computed again (in one step or in
      chunks): rows of positions handed on or held before are skipped.

    Steps without per-token rows, and steps with speculative decoding (a
    rejected draft's position is computed again by design; no such stage
    feeds the talker), are left alone. Called under the lock that retires
    requests (:meth:`forget`), so no entry outlives its request."""

    def __init__(self) -> None:
        self._marks: dict[str, int] = {}  # external id -> positions handed on or held
        self._held: dict[str, list[HeldRows]] = {}

    def plan(self, cap: Captured, live: list[bool], ext_ids: list[str]) -> RowPlan | None:
        """The step's :class:`RowPlan` (None when every row is handed on as
        computed: the common step); holds the rows of partial-prefill rows."""
        if (cap.hidden is None and not cap.extra) or cap.accepted is not None:
            return None
        computed = cap.computed.tolist()
        counts = cap.num_scheduled.tolist()
        ok = cap.row_ok.tolist()
        partial = cap.discarded.tolist()
        qsl = cap.query_start_loc.tolist()
        skip: torch.Tensor | None = None
        held: dict[int, HeldRows] = {}
        for i, rid in enumerate(ext_ids):
            if not live[i] or not (ok[i] or partial[i]):
                continue
            start, end = computed[i], computed[i] + counts[i]
            seen = self._marks.get(rid, 0)
            n_seen = min(max(seen - start, 0), counts[i])
            self._marks[rid] = max(seen, end)
            if not ok[i]:  # a partial prefill: its new rows wait for the step that samples
                if n_seen < counts[i]:
                    lo, hi = qsl[i] + n_seen, qsl[i + 1]
                    self._held.setdefault(rid, []).append(HeldRows(
                        hi - lo, None if cap.hidden is None else cap.hidden[lo:hi].clone(),
                        {name: t[lo:hi].clone() for name, t in cap.extra.items()}))
                continue
            if n_seen:
                if skip is None:
                    skip = torch.zeros(len(ext_ids), dtype=torch.int32)
                skip[i] = n_seen
            chunks = self._held.pop(rid, None)
            if chunks:
                held[i] = HeldRows.join(chunks)
        return None if skip is None and not held else RowPlan(skip, held)

    def forget(self, request_id: str) -> None:
        """The request left the engine: its marks and held rows go."""
        self._marks.pop(request_id, None)
        self._held.pop(request_id, None)

    def clear(self) -> None:
        self._marks.clear()
        self._held.clear()

    def marks(self) -> dict[str, int]:
        """External id -> positions handed on or held (a copy; checks and tools)."""
        return dict(self._marks)

    def held_rows(self) -> dict[str, int]:
        """External id -> rows held for it (checks and tools)."""
        return {rid: sum(c.count for c in chunks) for rid, chunks in self._held.items()}


def pop_capture(captured: deque[Captured], key: Any) -> tuple[Captured | None, int]:
    """(the capture of the step the scheduler just processed, if any; rows of
    older captures dropped on the way).

    Steps that scheduled no tokens (async scheduling queues such empty
    batches while the last requests finish) ran no model and have no
    capture: None, and the queue is left alone.
    """
    if not any(c.key is key for c in captured):
        return None, 0
    dropped = 0
    while captured:
        cap = captured.popleft()
        if cap.key is key:
            return cap, dropped
        # an older capture whose step was never processed (engine dropped it)
        dropped += len(cap.req_ids)
    return None, dropped  # pragma: no cover


def engine_outputs(
    outputs: Iterable[Any], running: Container[str]
) -> tuple[dict[str, str], dict[str, str], dict[str, list[int]]]:
    """(finish reasons, text deltas, token ids) by request, from the engine's
    ``RequestOutput`` s of the processed step(s), for the `running` requests."""
    finished: dict[str, str] = {}
    text: dict[str, str] = {}
    engine_ids: dict[str, list[int]] = {}
    for o in outputs:
        ext = o.request_id
        if ext not in running or not hasattr(o.outputs, "__len__"):
            continue
        comp = o.outputs[0]
        text[ext] = comp.text or ""
        engine_ids[ext] = list(comp.token_ids)
        if o.finished:
            finished[ext] = str(comp.finish_reason or "stop")
    return finished, text, engine_ids
