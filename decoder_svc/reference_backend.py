"""Deterministic reference AR backend: a test double where the engine goes.

As a talker it behaves like one under continuous batching: requests join at
any step (a prefill step with one hidden row per prompt token), then decode
one codec frame per step (codebook 0 is the sampled token; a code-predictor
fills the other codebooks), and finish after a length fixed by the prompt.
As a thinker it writes text (one printable byte token per step) and exposes
hidden rows for the talker. A talker request conditioned on a thinker's
output speaks the thinker's tokens.

Every number is an integer hash of (seed, position, index), computed with
batched int64 tensor ops, so a request's outputs never depend on which other
requests share its batch or on timing: the same seed gives the same codes on
the synchronous and the asynchronous paths.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from decoder_svc.backend import RequestSpec, StepOutput
from omni_serving.v1 import snapshot_pb2

PER_REQUEST = snapshot_pb2.TENSOR_LAYOUT_PER_REQUEST
PER_TOKEN = snapshot_pb2.TENSOR_LAYOUT_PER_TOKEN
_M1 = 0x5851F42D4C957F2D  # odd multipliers that fit int64 (wrapping arithmetic)
_M2 = 0x14057B7EF767814F
_MASK62 = (1 << 62) - 1


def mix(x: torch.Tensor) -> torch.Tensor:
    """A cheap integer hash on int64 tensors (wrapping arithmetic, exact)."""
    x = x * _M1 + 0x2545F491
    x = x ^ (x >> 29)
    x = x * _M2
    x = x ^ (x >> 32)
    return x & _MASK62


@dataclass
class _Req:
    spec: RequestSpec
    prompt_ids: list[int]
    target_frames: int
    position: int = 0  # frames emitted so far
    prefilled: bool = False


def tokenize(text: str) -> list[int]:
    """Byte-level token ids (the reference tokenizer)."""
    return list(text.encode("utf-8"))


def frames_for(prompt_ids: list[int], max_tokens: int) -> int:
    n = 4 + 2 * len(prompt_ids)
    return min(n, max_tokens) if max_tokens > 0 else n


class ReferenceBackend:
    """Deterministic stand-in for the vLLM talker (and a benchmark engine)."""

    name = "reference"

    def __init__(
        self,
        *,
        role: str = "talker",
        hidden_size: int = 64,
        num_codebooks: int = 16,
        codec_vocab: int = 2048,
        max_num_seqs: int = 256,
        work_per_step: int = 0,
    ) -> None:
        if role not in ("talker", "thinker"):
            raise ValueError(f"role must be 'talker' or 'thinker', got {role!r}")
        self.role = role
        self.hidden_size = hidden_size
        self.num_codebooks = num_codebooks
        self.codec_vocab = codec_vocab
        self.max_num_seqs = max_num_seqs
        # Optional synthetic model cost (a matmul of this size per step), so
        # benchmarks have a decode step to compare gaps against.
        self._work = torch.randn(work_per_step, work_per_step) if work_per_step else None
        self._lock = threading.Lock()
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._cols = torch.arange(max(hidden_size, num_codebooks), dtype=torch.int64)

    # -- request management (any thread) ---------------------------------------
    def add_request(self, spec: RequestSpec) -> None:
        cond = spec.conditioning.get("thinker_token_ids")
        ids = [int(x) for x in cond.reshape(-1).tolist()] if cond is not None else tokenize(spec.prompt)
        if self.role == "thinker":
            n = 8 + len(ids) // 2
            target = min(n, spec.max_tokens) if spec.max_tokens > 0 else n
        else:
            target = frames_for(ids, spec.max_tokens)
        with self._lock:
            self._waiting.append(_Req(spec, ids, target))

    def abort(self, request_id: str) -> bool:
        with self._lock:
            for queue in (self._waiting, self._running):
                for r in queue:
                    if r.spec.request_id == request_id:
                        queue.remove(r)
                        return True
        return False

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running)

    # -- the model ------------------------------------------------------------
    def _hash(self, seeds: torch.Tensor, positions: torch.Tensor, salt: int, width: int) -> torch.Tensor:
        base = mix(seeds * 1_000_003 + positions * 8191 + salt)
        return mix(base[:, None] + self._cols[None, :width])

    def _hidden(self, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self._hash(seeds, positions, 17, self.hidden_size)
        # 16-bit values scaled by a power of two: exact in float32.
        return ((h & 0xFFFF).to(torch.float32) - 32768.0) / 32768.0

    def step(self) -> StepOutput | None:
        """One decode step for the running batch (admitting waiting requests)."""
        with self._lock:
            room = self.max_num_seqs - len(self._running)
            if room > 0 and self._waiting:
                self._running.extend(self._waiting[:room])
                del self._waiting[:room]
            batch = list(self._running)
        if not batch:
            return None
        if self._work is not None:
            torch.mm(self._work, self._work)
        # 1) schedule: prefill rows for new requests, one row for the others
        num_sched = [1 if r.prefilled else len(r.prompt_ids) or 1 for r in batch]
        qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(num_sched, dtype=torch.int32), 0)
        seeds = torch.tensor([r.spec.seed for r in batch], dtype=torch.int64)
        frame_pos = torch.tensor([r.position for r in batch], dtype=torch.int64)
        counts = torch.tensor(num_sched, dtype=torch.int64)
        # per-token positions: prompt positions for prefill rows, frame index for decode rows
        tok_seed = torch.repeat_interleave(seeds, counts)
        starts = torch.repeat_interleave(qsl[:-1].to(torch.int64), counts)
        tok_pos = torch.arange(int(qsl[-1]), dtype=torch.int64) - starts + torch.repeat_interleave(frame_pos, counts) * 100_000
        # 2) forward: hidden rows for every scheduled token
        hidden = self._hidden(tok_seed, tok_pos)
        # 3) sample (+ code predictor for the talker: one frame of codes per request)
        mm_outputs: dict[str, tuple[torch.Tensor, int]] = {}
        text_deltas: dict[str, str] = {}
        new_token_ids: dict[str, list[int]] = {}
        if self.role == "talker":
            codes = self._hash(seeds, frame_pos, 99, self.num_codebooks) % self.codec_vocab
            sampled = codes[:, :1].clone()
            mm_outputs["codec_codes"] = (codes, PER_REQUEST)
        else:
            # printable text: lowercase letters and spaces
            sampled = (self._hash(seeds, frame_pos, 5, 1) % 27 + 97).clone()
            sampled[sampled == 123] = 32
            for r, tok in zip(batch, sampled[:, 0].tolist(), strict=True):
                text_deltas[r.spec.request_id] = chr(tok)
                new_token_ids[r.spec.request_id] = [tok]
            # what a Qwen3-Omni thinker hands its talker, per token
            mm_outputs["thinker_embed"] = (self._hidden(tok_seed + 7, tok_pos), PER_TOKEN)
            mm_outputs["thinker_hidden"] = (hidden, PER_TOKEN)
        # 4) update decode state (eager postprocess: the next step needs it)
        finished: dict[str, str] = {}
        with self._lock:
            for r in batch:
                r.prefilled = True
                r.position += 1
                if r.position >= r.target_frames:
                    finished[r.spec.request_id] = "length" if r.target_frames == r.spec.max_tokens else "stop"
                    if r in self._running:
                        self._running.remove(r)
        return StepOutput(
            request_ids=[r.spec.request_id for r in batch],
            batch_indices=list(range(len(batch))),
            num_scheduled_tokens=num_sched,
            query_start_loc=qsl,
            sampled_token_ids=sampled,
            hidden_states=hidden,
            mm_outputs=mm_outputs,
            finished=finished,
            text_deltas=text_deltas,
            new_token_ids=new_token_ids,
        )

    def embed(self, spec: RequestSpec) -> torch.Tensor:
        """Pooling: mean of the prompt's hidden rows (deterministic)."""
        ids = tokenize(spec.prompt) or [0]
        n = len(ids)
        hidden = self._hidden(torch.full((n,), spec.seed, dtype=torch.int64), torch.arange(n, dtype=torch.int64))
        return hidden.mean(dim=0)

    def close(self) -> None:
        with self._lock:
            self._waiting.clear()
            self._running.clear()
