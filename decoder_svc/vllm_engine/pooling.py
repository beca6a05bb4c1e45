"""A stage's pooling engine: embeddings on a second in-process engine with the same weights.

``VLLMBackend.embed`` (the request API) runs its pooling passes here. The
engine (``runner="pooling"``, last-token pooling, L2-normalised) is built on
first use, or at once. Its steps take the process-wide forward lock
(``.engine_factory.FORWARD_LOCK``), so they slot in between the decode steps
of a running generate batch; callers serialize their ``embed`` calls (the
backend's pooling lock).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from omni_common.errors import FailedPreconditionError, InvalidArgumentError

from .engine_factory import FORWARD_LOCK, make_engine


class PoolingEngine:
    """The embedding engine of one stage (module docstring)."""

    def __init__(self, model_dir: Path, *, seed: int, max_model_len: int, kv_cache_memory_bytes: int) -> None:
        self.model_dir = model_dir
        self._seed = seed
        self._max_model_len = max_model_len
        self._kv_bytes = kv_cache_memory_bytes
        self._ids = itertools.count()
        self.engine: Any = None

    def build(self) -> Any:
        with FORWARD_LOCK:
            if self.engine is None:
                self.engine = make_engine(
                    self.model_dir,
                    runner="pooling",
                    seed=self._seed,
                    max_num_seqs=8,
                    max_model_len=self._max_model_len,
                    kv_cache_memory_bytes=self._kv_bytes,
                )
        return self.engine

    def embed(self, ids: list[int]) -> torch.Tensor:
        """Embedding [hidden] float32 of a tokenized prompt (one caller at a time)."""
        from vllm import PoolingParams

        eng = self.engine or self.build()
        rid = f"embed-{next(self._ids)}"
        try:
            eng.add_request(rid, {"prompt_token_ids": ids}, PoolingParams(task="embed"))
        except ValueError as exc:
            raise InvalidArgumentError("prompt", str(exc)) from exc
        result = None
        while eng.has_unfinished_requests():
            with FORWARD_LOCK:
                outs = eng.step()
            for o in outs:
                if o.finished and o.request_id == rid:
                    result = o.outputs.data
        if result is None:  # pragma: no cover
            raise FailedPreconditionError("pooling engine returned no embedding")
        return result.detach().to(torch.float32).reshape(-1).clone()
