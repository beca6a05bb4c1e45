"""Engines the suites run on: a vLLM talker with hidden size 2048, or the
reference backend sized to match, plus a wrapper that tags every step.

The vLLM talker is a checkpoint written by `models.create_model` (random
weights, offline tokenizer) and loaded from its path like any checkpoint.
For steady-state batches it ignores EOS, so a batch keeps its size for the
whole measurement (a benchmark-only subclass; the shipped backend is not
changed).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import log

BENCH_HIDDEN = 2048
BENCH_LAYERS = 1


def default_bench_model_root() -> Path:
    base = os.environ.get("OMNI_SERVING_MODEL_DIR")
    if base:
        return Path(base) / "bench"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "omni-serving" / "models" / "bench"


def ensure_talker_model(root: Path | None, hidden_size: int = BENCH_HIDDEN, num_layers: int = BENCH_LAYERS) -> Path:
    """`<root>/h<hidden>-l<layers>/talker`, written once (idempotent).

    Returns the folder that holds `talker/` (what build/StandinBackend take).
    """
    root = Path(root) if root else default_bench_model_root()
    folder = root / f"h{hidden_size}-l{num_layers}"
    target = folder / "talker"
    cfg = target / "omni_stage.json"
    if cfg.is_file() and (target / "model.safetensors").is_file():
        have = json.loads(cfg.read_text())
        if have.get("hidden_size") == hidden_size and have.get("num_layers") == num_layers and have.get("kind") == "talker":
            return folder
    from decoder_svc.testing.standin_models import create_model_atomically

    log(f"creating a talker checkpoint (hidden {hidden_size}, {num_layers} layer(s)) in {target}")
    create_model_atomically("talker", target, hidden_size=hidden_size, num_layers=num_layers)
    return folder


def build_vllm_talker(model_folder: Path, *, max_num_seqs: int = 64, kv_cache_memory_bytes: int = 768 * 2**20) -> Any:
    """A vLLM talker (async scheduling, as the tts profile sets it) that ignores EOS."""
    from decoder_svc.testing.standin_backend import StandinBackend

    class SteadyVLLMBackend(StandinBackend):
        """Benchmark-only: requests run to max_tokens (no early EOS), so a
        batch keeps its size while it is measured."""

        def _sampling_params(self, spec):  # noqa: ANN001
            params = super()._sampling_params(spec)
            params.ignore_eos = True
            return params

    return SteadyVLLMBackend(
        Path(model_folder) / "talker",
        role="talker",
        name="talker",
        capture_hidden=True,
        max_num_seqs=max_num_seqs,
        async_scheduling=True,
        enable_prefix_caching=False,
        pooling_engine="off",
        kv_cache_memory_bytes=kv_cache_memory_bytes,
    )


def calibrate_work(target_s: float) -> int:
    """Side n of an n x n float32 matmul that takes about target_s here."""
    if target_s <= 0:
        return 0
    n = 256
    for _ in range(6):
        a = torch.randn(n, n)
        torch.mm(a, a)
        t = time.perf_counter()
        reps = 3
        for _ in range(reps):
            torch.mm(a, a)
        dt = (time.perf_counter() - t) / reps
        n_new = int(n * (target_s / max(dt, 1e-6)) ** (1 / 3))
        n_new = max(64, min(n_new, 8192))
        if abs(n_new - n) / n < 0.05:
            return n_new
        n = n_new
    return n


def build_reference_talker(*, hidden_size: int = BENCH_HIDDEN, work_per_step: int = 0, max_num_seqs: int = 64) -> Any:
    from decoder_svc.testing.fake_engine import FakeBackend

    return FakeBackend(role="talker", hidden_size=hidden_size, work_per_step=work_per_step, max_num_seqs=max_num_seqs)


@dataclass
class StepRecord:
    rows: int
    decode_only: bool


class MeasuredBackend:
    """Wraps an ARBackend: records (rows, decode-only) for every step that
    returned an output, in the order the stage runner records its gaps; its
    `close` does nothing (the suite owns the engine and reuses it across
    pipelines)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.records: list[StepRecord] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def reset(self) -> None:
        self.records = []

    def step(self):  # noqa: ANN201
        out = self.inner.step()
        if out is not None:
            self.records.append(StepRecord(len(out.request_ids), all(n == 1 for n in out.num_scheduled_tokens)))
        return out

    def close(self) -> None:
        pass

    def really_close(self) -> None:
        self.inner.close()
