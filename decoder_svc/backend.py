"""The interface between a stage and its AR engine backend.

A backend owns the model and its decode state. `step()` runs one decode step
for the current batch: forward, sample, and any postprocess the next step
needs (eager). It returns batched tensors; no per-request payload work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

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
    # Stop sequences: the text stage's text ends where one appears (decoder_svc.stops).
    stop: tuple[str, ...] = ()
    # Cap on the request's audio in seconds (0 = the deployment's default).
    max_audio_seconds: float = 0.0
    # Codec frames of the first audio chunk (0 = the deployment's choice).
    first_chunk_frames: int = 0
    # Style instructions for the model's prompt (a system turn); only where
    # the deployment takes them (DeploymentSettings.supports_instructions).
    instructions: str = ""
    # The language to speak (a text-to-speech model's; "" or "auto": the model's own choice).
    language: str = ""
    # A voice to clone (a text-to-speech model's): a reference clip as sent
    # (omni_common.media.AudioInput), and its transcript ("": the voice alone).
    reference_audio: Any = None
    reference_text: str = ""
    # Codec frames [F, Q] the vocoder decodes before the request's own, whose
    # audio is not sent: the context its first frames are decoded in (a
    # cloned voice's reference clip, which the model continues).
    audio_context: Any = None
    # A conversation instead of one prompt: (role, content) turns, each
    # through the model's chat template (``prompt`` is then the last user
    # turn's text, for engines without a template); a turn's content is its
    # text, or its parts with audio (omni_common.conversation).
    messages: tuple[tuple[str, Any], ...] = ()
    # The conversation's audio parts decoded (float32 mono numpy arrays at
    # the first stage's input rate), in order (decoder_svc.inputs).
    audio: tuple[Any, ...] = ()
    # Its image parts decoded (uint8 RGB arrays [height, width, 3]), in order,
    # and each image's grid (t, h, w) of vision patches as the model's
    # processor sizes it (set with the prompt's ids; the talker's 3-D
    # positions follow it).
    images: tuple[Any, ...] = ()
    image_grids: tuple[tuple[int, int, int], ...] = ()
    # Speak the prompt as it is written: the request starts at the speaking
    # stage (the talker), whatever stages come before it (GenerateRequest.verbatim).
    verbatim: bool = False
    # Conditioning from an upstream stage (e.g. the thinker's hidden states).
    conditioning: dict[str, torch.Tensor] = field(default_factory=dict)
    # The first stage's prompt as token ids (a rendered chat prompt), and the
    # assistant reply to speak as is (a talker-first pipeline), when the
    # engine prepares requests that way.
    prompt_token_ids: list[int] = field(default_factory=list)
    reply_token_ids: list[int] = field(default_factory=list)
    # The conditioning is the upstream stage's output so far: more comes
    # through the backend's extend_request (StreamedInputBackend), the last
    # piece with finished=True. Only for stages that stream input.
    streaming: bool = False


T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")


class LazyList(Sequence[T]):
    """A read-only list computed on first use.

    Per-request lists that only the snapshot sender or the router read
    (batch indices, per-row counts, spans) are built there, off the decode
    step. Computing twice (two threads at once) is harmless: the function is
    pure over values fixed when the step was built.
    """

    __slots__ = ("_fn", "_value")

    def __init__(self, fn: Callable[[], Iterable[T]]) -> None:
        self._fn = fn
        self._value: list[T] | None = None

    def _get(self) -> list[T]:
        value = self._value
        if value is None:
            value = self._value = list(self._fn())
        return value

    def __getitem__(self, i: Any) -> Any:
        return self._get()[i]

    def __len__(self) -> int:
        return len(self._get())

    def __iter__(self) -> Iterator[T]:
        return iter(self._get())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyList):
            other = other._get()
        if isinstance(other, (list, tuple)):
            return self._get() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a list: unhashable

    def __repr__(self) -> str:
        return f"LazyList({self._get()!r})"


class LazyDict(Mapping[K, V]):
    """A read-only dict computed on first use (see :class:`LazyList`)."""

    __slots__ = ("_fn", "_value")

    def __init__(self, fn: Callable[[], Mapping[K, V]]) -> None:
        self._fn = fn
        self._value: dict[K, V] | None = None

    def _get(self) -> dict[K, V]:
        value = self._value
        if value is None:
            value = self._value = dict(self._fn())
        return value

    def __getitem__(self, key: K) -> V:
        return self._get()[key]

    def __len__(self) -> int:
        return len(self._get())

    def __iter__(self) -> Iterator[K]:
        return iter(self._get())

    def __repr__(self) -> str:
        return f"LazyDict({self._get()!r})"


def _spans(qsl: torch.Tensor, n: int) -> list[tuple[int, int]]:
    q = qsl.tolist()
    return [(q[i], q[i + 1]) for i in range(n)]


@dataclass
class StepOutput:
    """One decode step's outputs, batched (rows in batch order).

    The per-request lists and dicts may be :class:`LazyList` /
    :class:`LazyDict` (read-only, computed on first use, off the decode
    step): read them, never mutate them. Tensors are the step's own (no
    later step rewrites them); they may live on the engine's device, except
    ``query_start_loc`` and ``sampled_token_ids`` (small, on CPU).
    """

    request_ids: list[str]
    batch_indices: Sequence[int]
    num_scheduled_tokens: Sequence[int]
    query_start_loc: torch.Tensor  # [n + 1] int32, CPU
    sampled_token_ids: torch.Tensor  # [n, k] int64, CPU
    hidden_states: torch.Tensor | None  # [num_tokens, hidden]
    mm_outputs: dict[str, tuple[torch.Tensor, int]]  # name -> (tensor, TensorLayout)
    finished: dict[str, str]  # request id -> finish reason
    text_deltas: Mapping[str, str] = field(default_factory=dict)  # text stages only
    new_token_ids: Mapping[str, list[int]] = field(default_factory=dict)  # text stages only

    @property
    def spans(self) -> Sequence[tuple[int, int]]:
        """[(start, end)] token rows per request; computed when first read."""
        qsl, n = self.query_start_loc, len(self.request_ids)
        return LazyList(lambda: _spans(qsl, n))


class ARBackend(Protocol):
    """What a stage runner needs from an AR engine."""

    name: str

    def add_request(self, spec: RequestSpec) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> StepOutput | None: ...

    def embed(self, spec: RequestSpec) -> torch.Tensor: ...

    def close(self) -> None: ...


class StreamedInputBackend(ARBackend, Protocol):
    """An AR stage that can start a request before its upstream stage has
    finished it (``RequestSpec.streaming``) and take the rest in chunks."""

    def extend_request(
        self, request_id: str, conditioning: dict[str, torch.Tensor], finished: bool
    ) -> None:
        """Append the upstream stage's next rows (the same keys as the
        start's conditioning, only the new rows); ``finished``: the upstream
        stage is done with the request (the chunk may be empty). A request
        no longer running is ignored. The caller wakes the stage's loop
        afterwards: a request waiting for these rows is held meanwhile."""
        ...
