"""The talker's 3-D rotary positions, for requests whose prompt holds images.

The reference talker (like the thinker) uses M-RoPE: each position has
temporal, height and width coordinates. Text and audio positions have all
three equal, which is the plain 1-D rotary embedding, and that is how the
talker runs on vLLM (its config view has no mrope keys, so vLLM gives it
1-D positions). An image's tokens, though, sit on a (t, h, w) grid, and the
positions after an image continue from the grid's largest coordinate + 1,
so a request whose talker prompt holds image tokens needs 3-D positions:

- :func:`talker_positions` computes them for the talker's input ids (the
  user turns' thinker ids and the assistant head's ``tts_pad`` ids, as the
  reference's ``get_rope_index`` does), and the offset ``delta`` of every
  later position (position p is p + delta on all three axes);
- :class:`TalkerRope` keeps each such request's table, maps a step's rows
  to their 3-D positions before the forward (host values only, like
  ``TalkerSlots.prepare``), and :class:`StepRotary` applies vLLM's
  ``MRotaryEmbedding`` to those rows, every other row keeping the talker's
  1-D rotary embedding bit for bit (a request's numbers do not depend on
  the batch it shares).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["StepRotary", "TalkerRope", "talker_positions"]


def talker_positions(ids: Sequence[int], image_token: int, grids: Sequence[tuple[int, int, int]], merge: int,
                     per_second: float) -> tuple[np.ndarray, int]:
    """(positions [3, L] int64, delta) of the talker input ``ids``: one after
    another from the previous largest position + 1, except each run of
    ``image_token`` (the next of ``grids``: its (t, h, w) patches, merged
    ``merge`` x ``merge``), laid out as its grid from the next position."""
    n = len(ids)
    pos = np.zeros((3, n), dtype=np.int64)
    grid = iter(grids)
    nxt, i = 0, 0
    while i < n:
        if ids[i] != image_token:
            pos[:, i] = nxt
            nxt += 1
            i += 1
            continue
        t, h, w = next(grid)
        gh, gw = h // merge, w // merge
        size = t * gh * gw
        if any(tok != image_token for tok in ids[i:i + size]) or i + size > n:
            raise ValueError(f"an image block of {size} tokens at {i} does not match its grid {(t, h, w)}")
        t_index = (np.arange(t) * per_second).astype(np.int64)
        block = np.stack([np.repeat(t_index, gh * gw), np.tile(np.repeat(np.arange(gh), gw), t),
                          np.tile(np.arange(gw), t * gh)])
        pos[:, i:i + size] = block + nxt
        nxt = int(pos[:, i:i + size].max()) + 1
        i += size
    return pos, nxt - n


class TalkerRope:
    """3-D positions of the requests that need them, by request id (any
    thread adds and removes; the step's thread prepares)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._tables: dict[str, tuple[np.ndarray, int]] = {}
        # the prepared step: (row indices [m], positions [3, m]) on the device, or None
        self.step: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, request_id: str, positions: np.ndarray, delta: int) -> None:
        with self._lock:
            self._tables[request_id] = (positions, int(delta))

    def remove(self, request_id: str) -> None:
        with self._lock:
            self._tables.pop(request_id, None)

    def prepare(self, row_ids: Sequence[str], query_start_loc: Sequence[int], computed: Sequence[int],
                key: Callable[[str], str] | None = None) -> None:
        """Before a step's forward: the 3-D positions of the rows of requests
        with a table (a row's 1-D position p: the table's column p inside the
        prompt, p + delta after it); ``step`` None when the step has none."""
        with self._lock:
            if not self._tables:
                self.step = None
                return
            found = [(i, self._tables.get(key(r) if key else r)) for i, r in enumerate(row_ids)]
        rows: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        for i, entry in found:
            if entry is None:
                continue
            table, delta = entry
            start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
            p = int(computed[i]) + np.arange(end - start)
            inside = p < table.shape[1]
            col = np.where(inside, 0, p + delta)[None, :].repeat(3, 0)
            col[:, inside] = table[:, p[inside]]
            rows.append(np.arange(start, end))
            cols.append(col)
        if not rows:
            self.step = None
            return
        idx = torch.from_numpy(np.concatenate(rows)).to(self.device, non_blocking=True)
        pos = torch.from_numpy(np.concatenate(cols, axis=1)).to(self.device, non_blocking=True)
        self.step = (idx, pos)


class StepRotary(nn.Module):
    """The talker's rotary embedding: ``plain`` (1-D) for every row, then
    ``mrope`` on the rows :class:`TalkerRope` prepared, from their inputs."""

    def __init__(self, plain: Any, mrope: Any, rope: TalkerRope) -> None:
        super().__init__()
        self.plain, self.mrope, self.rope = plain, mrope, rope

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):  # noqa: ANN201
        step = self.rope.step
        if step is None:
            return self.plain(positions, query, key)
        idx, pos = step
        q_in, k_in = query[idx], key[idx]  # copies: the plain embedding may work in place
        query, key = self.plain(positions, query, key)
        q3, k3 = self.mrope(pos, q_in, k_in)
        query[idx] = q3
        key[idx] = k3
        return query, key
