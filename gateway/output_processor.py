"""The gateway's output processor: decoder messages in, request outputs out.

Modality-agnostic by construction. Modality decides two things, once, when a
request is added (`RequestState.from_new_request`): whether the request gets
a text accumulator and whether it gets a multimodal accumulator (a null
object otherwise), and the multimodal accumulator's default strategy
(`PayloadAccumulator.for_modality`, overridable per key). After that every
request goes through the same steps of `OutputProcessor.process_outputs`,
which is the only loop over decoder outputs in the gateway.

Channels: multimodal tensors are read only from ``multimodal_output``;
``pooling_output`` keeps its pooling meaning (one embedding) and is passed
through untouched.

Errors:

* a step tensor that does not fit its key (`TensorAccumulationError`) is
  skipped by the accumulator with a warning; the processor counts it
  (`ProcessorStats.skipped_tensors`, Prometheus ``omni_gateway_skipped_tensors``)
  and the request continues;
* pieces that cannot be merged (`TensorConsolidationError`) fail that request
  only: it is reported in `ProcessorResult.failures` and its state is freed;
* anything else propagates.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

import torch

from gateway import metrics
from gateway.outputs import (
    DecoderOutputError,
    EngineOutput,
    MultimodalPayload,
    RequestMetrics,
    decode_decoder_tensor,
    metadata_from_pb,
)
from omni_common.accumulation import (
    MergedValue,
    PayloadAccumulator,
    Scalar,
    TensorAccumulationStrategy,
    TensorConsolidationError,
)
from omni_common.errors import AlreadyExistsError, InvalidArgumentError
from omni_common.modality import OutputModality
from omni_serving.v1 import decoder_pb2, gateway_pb2, payload_pb2

logger = logging.getLogger(__name__)

Strategy = TensorAccumulationStrategy

DEFAULT_KEY_STRATEGIES: Mapping[str, TensorAccumulationStrategy] = {
    # Samples grow along time, the last dimension.
    "audio": Strategy.CONCAT_LAST,
    # Images and latents grow along the first (batch-like) dimension.
    "image": Strategy.CONCAT_DIM0,
    "images": Strategy.CONCAT_DIM0,
    "latent": Strategy.CONCAT_DIM0,
    "latents": Strategy.CONCAT_DIM0,
    # Markers that describe the stream rather than extend it: latest wins.
    # (Scalar metadata always replaces; these cover producers that send
    # them as tensors.)
    "sample_rate": Strategy.REPLACE,
    "is_last_chunk": Strategy.REPLACE,
    "last_chunk": Strategy.REPLACE,
}
"""Per-key strategies that hold whatever the request's modality (keys of mixed outputs)."""


class OutputKind(enum.Enum):
    """How a request's outputs relate to each other (values equal the proto enum)."""

    DELTA = gateway_pb2.OUTPUT_KIND_DELTA
    CUMULATIVE = gateway_pb2.OUTPUT_KIND_CUMULATIVE
    FINAL_ONLY = gateway_pb2.OUTPUT_KIND_FINAL_ONLY

    @classmethod
    def from_proto(cls, value: int, *, field_name: str = "output_kind") -> OutputKind:
        """UNSPECIFIED means DELTA; a value this build does not know is refused."""
        if value == gateway_pb2.OUTPUT_KIND_UNSPECIFIED:
            return cls.DELTA
        try:
            return cls(value)
        except ValueError:
            supported = ", ".join(k.name for k in cls)
            raise InvalidArgumentError(
                field_name, f"unknown value {value}; supported: {supported}"
            ) from None


# ---------------------------------------------------------------------------
# Accumulators (text and multimodal), each with a null object.


class TextAccumulator:
    """Token ids and their text, handed out as deltas or as the whole so far."""

    def __init__(self) -> None:
        self._token_ids: list[int] = []
        self._parts: list[str] = []
        self._delta_tokens = 0
        self._delta_parts = 0

    @staticmethod
    def from_new_request(modality: OutputModality) -> TextAccumulator | NullTextAccumulator:
        """A real accumulator when the request wants text, a null object otherwise."""
        return TextAccumulator() if modality.has_text else NullTextAccumulator()

    def add(self, token_ids: Iterable[int], text: str) -> bool:
        """Append one step; True if it carried anything."""
        before = len(self._token_ids)
        self._token_ids.extend(token_ids)
        if text:
            self._parts.append(text)
        return bool(text) or len(self._token_ids) != before

    def take_delta(self) -> tuple[str, list[int]]:
        text = "".join(self._parts[self._delta_parts :])
        ids = self._token_ids[self._delta_tokens :]
        self._delta_parts, self._delta_tokens = len(self._parts), len(self._token_ids)
        return text, ids

    def consolidate(self) -> tuple[str, list[int]]:
        if len(self._parts) > 1:
            # Keep the join so the next call does not redo it, unless a delta
            # boundary falls inside the parts.
            joined = "".join(self._parts)
            if self._delta_parts in (0, len(self._parts)):
                self._delta_parts = 0 if self._delta_parts == 0 else 1
                self._parts = [joined]
            return joined, list(self._token_ids)
        return "".join(self._parts), list(self._token_ids)


class NullTextAccumulator:
    """Text of a request that did not ask for text: dropped."""

    def add(self, token_ids: Iterable[int], text: str) -> bool:
        return False

    def take_delta(self) -> tuple[str, list[int]]:
        return "", []

    def consolidate(self) -> tuple[str, list[int]]:
        return "", []


class NullPayloadAccumulator:
    """Multimodal output of a request that asked for none: dropped."""

    skipped_total = 0

    def add(
        self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Scalar] | None = None
    ) -> list[str]:
        if tensors:
            logger.debug("dropping multimodal keys %s of a text-only request", list(tensors))
        return []

    def take_delta(self) -> tuple[dict[str, MergedValue], dict[str, Scalar]]:
        return {}, {}

    def consolidate(self) -> tuple[dict[str, MergedValue], dict[str, Scalar]]:
        return {}, {}


PayloadAccumulatorLike = PayloadAccumulator | NullPayloadAccumulator
PayloadAccumulatorFactory = Callable[
    [OutputModality, Mapping[str, TensorAccumulationStrategy]], PayloadAccumulatorLike
]


def make_payload_accumulator(
    modality: OutputModality, key_strategies: Mapping[str, TensorAccumulationStrategy]
) -> PayloadAccumulatorLike:
    """The request's multimodal accumulator: strategy chosen once, per modality, here."""
    if not modality.has_multimodal:
        return NullPayloadAccumulator()
    return PayloadAccumulator.for_modality(modality, key_strategies)


# ---------------------------------------------------------------------------
# Per-request state.


@dataclass
class RequestState:
    """Everything the processor keeps for one running request."""

    request_id: str
    output_modality: OutputModality
    output_kind: OutputKind
    text: TextAccumulator | NullTextAccumulator
    multimodal: PayloadAccumulatorLike
    arrival_time: float
    cumulative: bool
    stage_id: int = 0
    pooling_output: torch.Tensor | None = None
    new_pooling: bool = False
    changed: bool = False
    first_token_time: float | None = None
    first_packet_time: float | None = None
    decoder_metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @classmethod
    def from_new_request(
        cls,
        request_id: str,
        output_modality: OutputModality,
        output_kind: OutputKind,
        *,
        key_strategies: Mapping[str, TensorAccumulationStrategy] | None = None,
        arrival_time: float,
        payload_accumulator_factory: PayloadAccumulatorFactory = make_payload_accumulator,
    ) -> RequestState:
        """Pick the request's accumulators and output policy once."""
        return cls(
            request_id=request_id,
            output_modality=output_modality,
            output_kind=output_kind,
            text=TextAccumulator.from_new_request(output_modality),
            multimodal=payload_accumulator_factory(
                output_modality,
                dict(DEFAULT_KEY_STRATEGIES if key_strategies is None else key_strategies),
            ),
            arrival_time=arrival_time,
            cumulative=output_kind is not OutputKind.DELTA,
        )

    def add_step(
        self,
        response: decoder_pb2.GenerateResponse,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, Scalar],
        pooling: torch.Tensor | None,
        now: float,
    ) -> list[str]:
        """Accumulate one decoder message; return the tensor keys that were skipped."""
        self.stage_id = response.stage_id
        if response.HasField("metrics"):
            self.decoder_metrics = RequestMetrics.from_pb(response.metrics)
        if self.text.add(response.new_token_ids, response.text_delta):
            self.changed = True
            if self.first_token_time is None:
                self.first_token_time = now
        skipped = self.multimodal.add(tensors, metadata)
        if len(skipped) < len(tensors) or metadata:
            self.changed = True
            if self.first_packet_time is None and len(skipped) < len(tensors):
                self.first_packet_time = now
        if pooling is not None:
            self.pooling_output, self.new_pooling, self.changed = pooling, True, True
        return skipped

    def make_output(self, finished: bool, finish_reason: str, now: float) -> EngineOutput | None:
        """The output this request's kind asks for now, or None.

        Raises `TensorConsolidationError` if the multimodal pieces cannot be merged.
        """
        if self.output_kind is OutputKind.FINAL_ONLY and not finished:
            return None
        if not (finished or self.changed):
            return None
        if self.cumulative:
            text, token_ids = self.text.consolidate()
            tensors, metadata = self.multimodal.consolidate()
            pooling = self.pooling_output
        else:
            text, token_ids = self.text.take_delta()
            tensors, metadata = self.multimodal.take_delta()
            pooling = self.pooling_output if self.new_pooling else None
        self.changed = self.new_pooling = False
        return EngineOutput(
            request_id=self.request_id,
            stage_id=self.stage_id,
            text=text,
            token_ids=token_ids,
            multimodal=MultimodalPayload(tensors, metadata) if (tensors or metadata) else None,
            pooling_output=pooling,
            finished=finished,
            finish_reason=finish_reason,
            metrics=self._metrics(now),
        )

    def _metrics(self, now: float) -> RequestMetrics:
        """The decoder's counters with the gateway's own view of the timings."""

        def since_arrival_ms(t: float | None) -> float:
            return 0.0 if t is None else (t - self.arrival_time) * 1000.0

        return replace(
            self.decoder_metrics,
            ttft_ms=since_arrival_ms(self.first_token_time) or self.decoder_metrics.ttft_ms,
            ttfp_ms=since_arrival_ms(self.first_packet_time) or self.decoder_metrics.ttfp_ms,
            elapsed_ms=since_arrival_ms(now),
        )


# ---------------------------------------------------------------------------
# The processor.


@dataclass
class RequestFailure:
    """A request the processor had to fail, and why."""

    request_id: str
    error: TensorConsolidationError


@dataclass
class ProcessorResult:
    """What one `process_outputs` call produced."""

    outputs: list[EngineOutput] = field(default_factory=list)
    failures: list[RequestFailure] = field(default_factory=list)


@dataclass
class ProcessorStats:
    """Counters since the processor was created."""

    skipped_tensors: int = 0
    failed_consolidations: int = 0
    dropped_outputs: int = 0
    """Decoder messages for requests the processor no longer tracks (aborted)."""


def decode_step_payload(
    payload: payload_pb2.MultimodalPayload,
) -> tuple[dict[str, torch.Tensor], dict[str, Scalar]]:
    """One decoder message's multimodal tensors and metadata; names must be unique."""
    tensors: dict[str, torch.Tensor] = {}
    for i, named in enumerate(payload.tensors):
        field_name = f"multimodal_output.tensors[{i}]"
        if named.name in tensors:
            raise DecoderOutputError(f"{field_name}: duplicate tensor name {named.name!r}")
        tensors[named.name] = decode_decoder_tensor(named.tensor, field_name)
    return tensors, metadata_from_pb(payload.metadata)


class OutputProcessor:
    """Turns decoder `GenerateResponse`s into per-request `EngineOutput`s.

    Not thread-safe: one event loop drives it.
    """

    def __init__(
        self,
        *,
        key_strategies: Mapping[str, TensorAccumulationStrategy] | None = None,
        payload_accumulator_factory: PayloadAccumulatorFactory = make_payload_accumulator,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.key_strategies = {**DEFAULT_KEY_STRATEGIES, **(key_strategies or {})}
        self._factory = payload_accumulator_factory
        self._clock = clock
        self.request_states: dict[str, RequestState] = {}
        self.stats = ProcessorStats()

    def add_request(
        self,
        request_id: str,
        output_modality: OutputModality,
        output_kind: OutputKind = OutputKind.DELTA,
        *,
        key_strategies: Mapping[str, TensorAccumulationStrategy] | None = None,
    ) -> RequestState:
        """Start tracking a request; `key_strategies` override the processor's per key."""
        if request_id in self.request_states:
            raise AlreadyExistsError(f"request_id: {request_id!r} is already running")
        state = RequestState.from_new_request(
            request_id,
            output_modality,
            output_kind,
            key_strategies={**self.key_strategies, **(key_strategies or {})},
            arrival_time=self._clock(),
            payload_accumulator_factory=self._factory,
        )
        self.request_states[request_id] = state
        return state

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Stop tracking requests; return those that were tracked."""
        return [rid for rid in request_ids if self.request_states.pop(rid, None) is not None]

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def process_outputs(self, responses: Iterable[decoder_pb2.GenerateResponse]) -> ProcessorResult:
        """The only loop over decoder outputs in the gateway.

        Per message:
          1) find the request's state (messages of aborted requests are dropped);
          2) decode the step: multimodal tensors only from `multimodal_output`,
             `pooling_output` as the pooling result;
          3) accumulate text, tokens, tensors and metadata;
          4) count the tensors skipped by the accumulator;
          5) make the output the request's kind asks for (a consolidation
             error fails only this request);
          6) collect the output;
          7) free finished requests.
        """
        result = ProcessorResult()
        for response in responses:
            # 1) state lookup
            state = self.request_states.get(response.request_id)
            if state is None:
                self.stats.dropped_outputs += 1
                continue
            now = self._clock()

            # 2) decode the dedicated channels
            tensors, metadata = (
                decode_step_payload(response.multimodal_output)
                if response.HasField("multimodal_output")
                else ({}, {})
            )
            pooling = (
                decode_decoder_tensor(response.pooling_output, "pooling_output")
                if response.HasField("pooling_output")
                else None
            )

            # 3) accumulate
            skipped = state.add_step(response, tensors, metadata, pooling, now)

            # 4) skipped tensors: the request continues without them
            for key in skipped:
                self.stats.skipped_tensors += 1
                metrics.SKIPPED_TENSORS.labels(key=key).inc()

            # 5) output per kind
            try:
                output = state.make_output(response.finished, response.finish_reason, now)
            except TensorConsolidationError as exc:
                logger.error("request %s failed: %s", response.request_id, exc)
                self.stats.failed_consolidations += 1
                metrics.FAILED_CONSOLIDATIONS.inc()
                result.failures.append(RequestFailure(response.request_id, exc))
                del self.request_states[response.request_id]
                continue

            # 6) collect
            if output is not None:
                result.outputs.append(output)

            # 7) free
            if response.finished:
                del self.request_states[response.request_id]
        return result


__all__ = [
    "DEFAULT_KEY_STRATEGIES",
    "NullPayloadAccumulator",
    "NullTextAccumulator",
    "OutputKind",
    "OutputProcessor",
    "ProcessorResult",
    "ProcessorStats",
    "RequestFailure",
    "RequestState",
    "TextAccumulator",
    "decode_step_payload",
    "make_payload_accumulator",
]
