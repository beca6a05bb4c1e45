"""The interface between a stage and its AR engine backend.

A backend owns the model and its decode state. `step()` runs one decode step
for the current batch: forward, sample, and any postprocess the next step
needs (eager). It returns batched tensors; no per-request payload work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from omni_common.modality import OutputModality


@dataclass
class RequestSpec:
    request_id: str
    prompt: str
    # Tokens the stage may generate (0 = its default). The pipeline resolves
    # it per AR stage from the request's max_tokens and max_audio_seconds.
    max_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    voice: str = "default"
    task: str = "generate"  # "generate" | "embed"
    modality: OutputModality = OutputModality.AUDIO
    # Cap on the request's audio in seconds (0 = the deployment's default).
    max_audio_seconds: float = 0.0
    # Style instructions for the model's prompt (a system turn); only where
    # the deployment takes them (DeploymentSettings.supports_instructions).
    instructions: str = ""
    # Conditioning from an upstream stage (e.g. the thinker's hidden states).
    conditioning: dict[str, torch.Tensor] = field(default_factory=dict)
    # The first stage's prompt as token ids (a rendered chat prompt), and the
    # assistant reply to speak as is (a talker-first pipeline), when the
    # engine prepares requests that way.
    prompt_token_ids: list[int] = field(default_factory=list)
    reply_token_ids: list[int] = field(default_factory=list)


@dataclass
class StepOutput:
    """One decode step's outputs, batched (rows in batch order)."""

    request_ids: list[str]
    batch_indices: list[int]
    num_scheduled_tokens: list[int]
    query_start_loc: torch.Tensor  # [n + 1] int32
    sampled_token_ids: torch.Tensor  # [n, k] int64
    hidden_states: torch.Tensor | None  # [num_tokens, hidden]
    mm_outputs: dict[str, tuple[torch.Tensor, int]]  # name -> (tensor, TensorLayout)
    finished: dict[str, str]  # request id -> finish reason
    text_deltas: dict[str, str] = field(default_factory=dict)  # text stages only
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)  # text stages only

    @property
    def spans(self) -> list[tuple[int, int]]:
        q = self.query_start_loc.tolist()
        return [(q[i], q[i + 1]) for i in range(len(self.request_ids))]


class ARBackend(Protocol):
    """What a stage runner needs from an AR engine."""

    name: str

    def add_request(self, spec: RequestSpec) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> StepOutput | None: ...

    def embed(self, spec: RequestSpec) -> torch.Tensor: ...

    def close(self) -> None: ...
