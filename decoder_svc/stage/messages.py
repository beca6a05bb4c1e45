"""What crosses a stage process's pipes: one frozen dataclass per kind, dispatched by type.

Like vLLM's ``v1/engine`` wire structs or SGLang's ``io_struct.py``: the
decoder (``.proxy``) and the stage process (``.host``) share these classes,
each side matches on the class, and nothing travels as a tagged tuple.
Everything here is pickled (plain pickle: tensors by value).

At spawn, the stage process gets a :class:`StageHostSpec` (what it builds).

decoder -> stage (the command pipe):

- :class:`Add`: start a request; :class:`Extend`: the next chunk of a
  request's input (the thinker's rows the talker reads); :class:`Embed`: a
  pooling pass. Each carries a call id: a command the decoder waits for
  (id > 0) is answered with a :class:`Reply`; one it does not wait for (id
  0: the hand-over of a request from the previous stage, the next chunk of
  its input) reports a refusal as a :class:`Fail` of that request;
- :class:`Abort` (never answered) and :class:`Stop` (the process ends).

stage -> decoder (the event pipe):

- :class:`Ready` (the engine is built; its :class:`StageFacts`) or
  :class:`StartFailed` (why not);
- :class:`Step`: one materialized step (``MaterializedStep`` bytes: the
  payloads, already built) with what routing reads of it (text deltas, new
  token ids, finish reasons);
- :class:`Reply` (the answer to a command waited for), :class:`Fail` (these
  requests ended with an error), :class:`FailAll` (a decode step failed:
  every request on the stage ends);
- :class:`Status`, every ``STATUS_INTERVAL_S``: steps, the link's state, the
  arena's, the step-time and step-gap observations (the decoder's metrics),
  the stage's forward-pass intervals (``decoder_svc.busy``), and the decode
  loop's liveness: its turn count (advanced by the loop itself, so a wedged
  loop's count stops while this report, from a thread of its own, goes on),
  whether work waited for it, its recent pace and the commands it applied;
  about once a second (``METRICS_EVERY`` reports), a snapshot of the
  process's metrics (``omni_common.metrics_forward``) but the families the
  decoder records itself from the observations (``PARENT_RECORDED``).

An engine's refusal crosses as a :class:`WireError` and is raised on the
decoder's side as the same ``omni_common.errors`` class (the gRPC code kept).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from decoder_svc.backend import RequestSpec
from decoder_svc.profile import Profile, StageConfig
from omni_common import errors
from omni_common.errors import OmniError

STATUS_INTERVAL_S = 0.2
"""How often a stage process reports its status (steps, link, arena, metrics)."""

METRICS_EVERY = 5
"""A metrics snapshot rides on every this-many status reports (about once a second)."""


@dataclass(frozen=True)
class StageHostSpec:
    """What a stage process needs to build its stage (picklable)."""

    profile: Profile
    stage: str  # the stage's name in the profile
    engine: str = "vllm"  # "vllm" | "fake"
    model: str = ""  # checkpoint directory ("": the tiny one in the model cache)
    max_num_seqs: int | None = None  # over the stage's engine settings when set
    shm_prefix: str = "omni-default"
    arena_slots: int = 16
    arena_slot_bytes: int = 4 * 2**20
    materializer_target: str = ""
    inline_transport: bool = False
    in_process_builder: bool = False
    readiness_timeout_ms: int = 5000
    stall_timeout_s: float = 3.0
    acquire_timeout_s: float = 0.5
    torch_threads: int = 0  # intra-op threads (OMP_NUM_THREADS); 0: torch's default (the decoder sets it)
    omp_wait_policy: str = ""  # OMP_WAIT_POLICY (passive | active); "": OpenMP's default
    log_level: str = "INFO"
    # the fake engine: its backend's factory ("package.module:attr"; default the
    # fake engine's FakeBackend) and keyword arguments (tests and benchmarks)
    fake_factory: str = ""
    fake_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> StageConfig:
        return next(s for s in self.profile.ar_stages if s.name == self.stage)


# -- errors across the pipe -----------------------------------------------------------


@dataclass(frozen=True)
class WireError:
    """An error of the stage process, as the decoder raises it again."""

    kind: str  # the class name in omni_common.errors
    field: str
    message: str

    @classmethod
    def of(cls, exc: BaseException, internal: str = "") -> WireError:
        """An OmniError as its nearest class of ``omni_common.errors`` (the
        gRPC code is kept), field and message; other errors travel as an
        internal error with ``internal`` as its message (the stage process
        logs their traceback under the error id that message names:
        ``omni_common.errors.log_internal``)."""
        if isinstance(exc, OmniError):
            kind = next(c.__name__ for c in type(exc).__mro__
                        if issubclass(c, OmniError) and getattr(errors, c.__name__, None) is c)
            field_ = getattr(exc, "field", "")
            msg = str(exc)
            if field_ and msg.startswith(f"{field_}: "):
                msg = msg[len(field_) + 2:]
            return cls(kind, field_, msg)
        return cls("OmniError", "", internal or "the stage could not take the request (internal error)")

    def rebuild(self) -> OmniError:
        cls = getattr(errors, self.kind, OmniError)
        if not (isinstance(cls, type) and issubclass(cls, OmniError)):
            cls = OmniError
        if cls is errors.InvalidArgumentError:
            return cls(self.field, self.message)
        return cls(self.message)


# -- what a stage process tells about its engine ------------------------------------------


@dataclass(frozen=True)
class StageFacts:
    """The engine's facts the pipeline reads of a backend, as the stage
    process reported them; None: the stage's backend does not say (the
    reader takes its default, as for a backend without that attribute)."""

    role: str | None = None
    max_model_len: int | None = None
    sampling_defaults: tuple[float, float, int] | None = None
    model_name: str | None = None
    num_codebooks: int | None = None
    codec_vocab: int | None = None
    streams_input: bool | None = None
    min_input_tokens: int | None = None
    hidden_size: int | None = None
    audio_input_rate: int | None = None
    image_input: bool | None = None
    speech_instructions: bool | None = None
    languages: tuple[str, ...] | None = None
    engine_facts: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, backend: Any) -> StageFacts:
        """The facts of a backend in this process (the attributes it has)."""
        said = {name: getattr(backend, name) for name in _FACT_NAMES if hasattr(backend, name)}
        if "languages" in said:  # (a backend's may be a map of names to ids)
            said["languages"] = tuple(sorted(said["languages"]))
        return cls(**said, engine_facts=dict(getattr(backend, "engine_facts", dict)()))


_FACT_NAMES = (
    "role", "max_model_len", "sampling_defaults", "model_name", "num_codebooks", "codec_vocab",
    "streams_input", "min_input_tokens", "hidden_size", "audio_input_rate", "image_input",
    "speech_instructions", "languages",
)


# -- decoder -> stage ------------------------------------------------------------------------


@dataclass(frozen=True)
class Add:
    call_id: int  # 0: not waited for (a refusal fails the request)
    spec: RequestSpec

    @property
    def request_id(self) -> str:
        return self.spec.request_id


@dataclass(frozen=True)
class Extend:
    call_id: int  # 0: not waited for (a refusal fails the request)
    request_id: str
    rows: Any  # {key: tensor}: the next chunk of the request's input
    finished: bool


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Embed:
    call_id: int
    spec: RequestSpec


@dataclass(frozen=True)
class Stop:
    pass


Command = Add | Extend | Abort | Embed | Stop

# -- stage -> decoder ------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    pid: int
    facts: StageFacts


@dataclass(frozen=True)
class StartFailed:
    reason: str


@dataclass(frozen=True)
class Step:
    data: bytes  # a serialized MaterializedStep
    text_deltas: dict[str, str]
    new_token_ids: dict[str, list[int]]
    finished: dict[str, str]  # request id -> finish reason


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: Any = None
    error: WireError | None = None  # None: the command succeeded (value is its answer)


@dataclass(frozen=True)
class Fail:
    request_ids: list[str]
    message: str
    error: WireError | None = None  # the refusal of a command that was not waited for


@dataclass(frozen=True)
class FailAll:
    message: str


@dataclass(frozen=True)
class Status:
    steps: int = 0
    observations: list[tuple[float, float]] = field(default_factory=list)  # (step time, gap)
    intervals: list[tuple[float, float]] = field(default_factory=list)  # forward passes
    connected: bool = False
    fallback_steps: int = 0
    in_flight: int = 0
    attachment: bytes | None = None  # a serialized MaterializerAttachment
    arena: tuple[str, int, int, int, int] | None = None  # name, slot bytes, slots, in use, peak
    # the decode loop's liveness (omni_common.liveness): turns taken, whether
    # work waited at its last look, its recent time per turn, commands applied
    turns: int = 0
    busy: bool = False
    pace_s: float | None = None
    commands: int = 0
    # the materializer link's dispatch loop, likewise (no link: 0, False, None)
    link_turns: int = 0
    link_busy: bool = False
    link_pace_s: float | None = None
    # a snapshot of the process's metrics (omni_common.metrics_forward), or None
    metrics: list | None = None


Event = Ready | StartFailed | Step | Reply | Fail | FailAll | Status
