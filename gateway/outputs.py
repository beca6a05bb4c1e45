"""What the gateway hands to clients: one flat, non-nestable request output.

Three types, from the inside out:

* `MultimodalPayload` - named tensors plus scalar metadata, the domain form
  of the proto message of the same name (`from_pb` / `to_pb`).
* `EngineOutput` - what the output processor made of one decoder message
  for one request (text, tokens, multimodal, pooling), already shaped by the
  request's output kind (delta, cumulative, final-only).
* `OmniRequestOutput` - the only type that reaches a client. Every path that
  produces results (decoder stream, raw decoder message, image generator)
  goes through `wrap_output` or one of the `from_*` constructors, so all of
  them carry the same fields. It never holds another output: wrapping an
  `OmniRequestOutput` returns the same object with its stage id updated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import torch

from omni_common.accumulation import MergedValue, Scalar, TensorConsolidationError
from omni_common.errors import OmniError
from omni_common.modality import OutputModality
from omni_common.tensor_wire import TensorWireError, decode_inline, encode_inline
from omni_serving.v1 import common_pb2, decoder_pb2, gateway_pb2, payload_pb2, tensor_pb2

IMAGE_KEY = "image"
"""Payload key under which `from_diffusion` stores its images (stacked on dim 0)."""


class DecoderOutputError(OmniError):
    """The decoder sent something the gateway cannot read (INTERNAL: not the client's fault)."""


def decode_decoder_tensor(ref: tensor_pb2.TensorRef, field_name: str) -> torch.Tensor:
    """Decode an inline tensor sent by the decoder; a malformed one is the decoder's bug."""
    try:
        return decode_inline(ref, field_name)
    except TensorWireError as exc:
        raise DecoderOutputError(f"decoder sent a malformed tensor: {exc}") from exc


def metadata_from_pb(metadata: Mapping[str, payload_pb2.MetadataValue]) -> dict[str, Scalar]:
    """Proto metadata as a plain dict; entries with no value set are left out."""
    result: dict[str, Scalar] = {}
    for key, value in metadata.items():
        kind = value.WhichOneof("kind")
        if kind is not None:
            result[key] = getattr(value, kind)
    return result


def _metadata_to_pb(key: str, value: Scalar) -> payload_pb2.MetadataValue:
    # bool before int: bool is a subclass of int.
    if isinstance(value, bool):
        return payload_pb2.MetadataValue(bool_value=value)
    if isinstance(value, int):
        return payload_pb2.MetadataValue(int_value=value)
    if isinstance(value, float):
        return payload_pb2.MetadataValue(double_value=value)
    if isinstance(value, str):
        return payload_pb2.MetadataValue(string_value=value)
    raise TypeError(
        f"metadata {key!r}: expected bool, int, float or str, got {type(value).__name__}"
    )


@dataclass
class MultimodalPayload:
    """Named tensors (in production order) and scalar metadata of one output.

    A value is one tensor, or a list of tensors for keys accumulated with
    `APPEND_LIST`; on the wire a list is sent as repeated entries of the key.
    """

    tensors: dict[str, MergedValue] = field(default_factory=dict)
    metadata: dict[str, Scalar] = field(default_factory=dict)

    @property
    def primary_tensor(self) -> torch.Tensor | None:
        """The first tensor (the first piece of a list value), or None."""
        for value in self.tensors.values():
            if isinstance(value, torch.Tensor):
                return value
            if value:
                return value[0]
        return None

    def __bool__(self) -> bool:
        return bool(self.tensors or self.metadata)

    @classmethod
    def from_pb(
        cls, payload: payload_pb2.MultimodalPayload, field_name: str = "multimodal_output"
    ) -> MultimodalPayload:
        """Decode inline tensors; a name sent more than once becomes a list."""
        tensors: dict[str, MergedValue] = {}
        for i, named in enumerate(payload.tensors):
            tensor = decode_decoder_tensor(named.tensor, f"{field_name}.tensors[{i}]")
            previous = tensors.get(named.name)
            if previous is None:
                tensors[named.name] = tensor
            elif isinstance(previous, list):
                previous.append(tensor)
            else:
                tensors[named.name] = [previous, tensor]
        return cls(tensors, metadata_from_pb(payload.metadata))

    def to_pb(self) -> payload_pb2.MultimodalPayload:
        out = payload_pb2.MultimodalPayload()
        for name, value in self.tensors.items():
            pieces = value if isinstance(value, list) else [value]
            for piece in pieces:
                out.tensors.add(name=name, tensor=encode_inline(piece))
        for key, scalar in self.metadata.items():
            out.metadata[key].CopyFrom(_metadata_to_pb(key, scalar))
        return out


@dataclass(frozen=True)
class RequestMetrics:
    """Timing of a request; field meanings as in the proto `RequestMetrics`."""

    ttfp_ms: float = 0.0
    ttft_ms: float = 0.0
    rtf: float = 0.0
    num_steps: int = 0
    audio_seconds: float = 0.0
    elapsed_ms: float = 0.0
    first_chunk_frames: int = 0
    prompt_tokens: int = 0

    @classmethod
    def from_pb(cls, pb: common_pb2.RequestMetrics) -> RequestMetrics:
        return cls(pb.ttfp_ms, pb.ttft_ms, pb.rtf, pb.num_steps, pb.audio_seconds, pb.elapsed_ms,
                   pb.first_chunk_frames, pb.prompt_tokens)

    def to_pb(self) -> common_pb2.RequestMetrics:
        return common_pb2.RequestMetrics(
            ttfp_ms=self.ttfp_ms,
            ttft_ms=self.ttft_ms,
            rtf=self.rtf,
            num_steps=self.num_steps,
            audio_seconds=self.audio_seconds,
            elapsed_ms=self.elapsed_ms,
            first_chunk_frames=self.first_chunk_frames,
            prompt_tokens=self.prompt_tokens,
        )


@dataclass
class EngineOutput:
    """The output processor's result for one request at one decoder message.

    Text, token ids and multimodal tensors are already a delta or the whole
    so far, as the request's output kind says.
    """

    request_id: str
    stage_id: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    multimodal: MultimodalPayload | None = None
    pooling_output: torch.Tensor | None = None
    finished: bool = False
    finish_reason: str = ""
    metrics: RequestMetrics = field(default_factory=RequestMetrics)


@dataclass
class OmniRequestOutput:
    """The one output type clients receive. Flat and never nested."""

    request_id: str
    finished: bool = True
    output_modality: OutputModality = OutputModality.TEXT
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    multimodal: MultimodalPayload | None = None
    pooling_output: torch.Tensor | None = None
    stage_id: int | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    finish_reason: str = ""
    images: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def from_engine_output(
        cls,
        engine_output: EngineOutput | decoder_pb2.GenerateResponse | OmniRequestOutput,
        stage_id: int | None,
        output_modality: OutputModality,
    ) -> OmniRequestOutput:
        """Build from what an engine path produced.

        * `EngineOutput` (the output processor's result, the normal path);
        * a raw `decoder_pb2.GenerateResponse` (one decoder message as is,
          without accumulation across messages);
        * an `OmniRequestOutput` is returned as is (stage id updated):
          outputs are never wrapped twice.
        """
        if isinstance(engine_output, OmniRequestOutput):
            return wrap_output(engine_output, stage_id, output_modality)
        if isinstance(engine_output, decoder_pb2.GenerateResponse):
            engine_output = _engine_output_from_pb(engine_output)
        if not isinstance(engine_output, EngineOutput):
            raise TypeError(
                "from_engine_output: expected EngineOutput, GenerateResponse or "
                f"OmniRequestOutput, got {type(engine_output).__name__}"
            )
        return cls(
            request_id=engine_output.request_id,
            finished=engine_output.finished,
            output_modality=output_modality,
            text=engine_output.text,
            token_ids=list(engine_output.token_ids),
            multimodal=engine_output.multimodal,
            pooling_output=engine_output.pooling_output,
            stage_id=stage_id,
            metrics=engine_output.metrics,
            finish_reason=engine_output.finish_reason,
        )

    @classmethod
    def from_diffusion(
        cls,
        request_id: str,
        images: Sequence[torch.Tensor],
        *,
        stage_id: int | None = None,
        metrics: RequestMetrics | None = None,
        metadata: Mapping[str, Scalar] | None = None,
        finish_reason: str = "stop",
    ) -> OmniRequestOutput:
        """Build from an image generator's finished result.

        The images are also put in `multimodal` under `IMAGE_KEY`, stacked
        along dim 0 (the image strategy), so consumers read every modality
        from the same field. Images of different shapes cannot be stacked and
        raise `TensorConsolidationError`.
        """
        images = list(images)
        tensors: dict[str, MergedValue] = {}
        if images:
            batch = [img if img.dim() > 0 else img.reshape(1) for img in images]
            try:
                tensors[IMAGE_KEY] = torch.stack(batch, dim=0)
            except RuntimeError as exc:  # torch's error for mismatched shapes or dtypes
                shapes = ", ".join(str(tuple(img.shape)) for img in images[:4])
                raise TensorConsolidationError(
                    IMAGE_KEY, f"cannot stack images of shapes {shapes}: {exc}"
                ) from exc
        return cls(
            request_id=request_id,
            finished=True,
            output_modality=OutputModality.IMAGE,
            multimodal=MultimodalPayload(tensors, dict(metadata or {})),
            stage_id=stage_id,
            metrics=metrics or RequestMetrics(),
            finish_reason=finish_reason,
            images=images,
        )

    def to_pb(self) -> gateway_pb2.OmniRequestOutput:
        out = gateway_pb2.OmniRequestOutput(
            request_id=self.request_id,
            finished=self.finished,
            output_modalities=self.output_modality.to_proto(),
            stage_id=self.stage_id or 0,
            metrics=self.metrics.to_pb(),
            finish_reason=self.finish_reason,
        )
        if self.text or self.token_ids:
            out.text.CopyFrom(gateway_pb2.TextOutput(text=self.text, token_ids=self.token_ids))
        if self.multimodal:
            out.multimodal.CopyFrom(self.multimodal.to_pb())
        if self.pooling_output is not None:
            out.pooling_output.CopyFrom(encode_inline(self.pooling_output))
        return out


OutputSource: TypeAlias = EngineOutput | decoder_pb2.GenerateResponse | OmniRequestOutput


def wrap_output(
    engine_output: OutputSource, stage_id: int | None, output_modality: OutputModality
) -> OmniRequestOutput:
    """The one function every client-facing path uses to produce its output.

    An `OmniRequestOutput` is returned as is with `stage_id` updated (never
    nested); anything else goes through `OmniRequestOutput.from_engine_output`.
    """
    if isinstance(engine_output, OmniRequestOutput):
        engine_output.stage_id = stage_id
        return engine_output
    return OmniRequestOutput.from_engine_output(engine_output, stage_id, output_modality)


def _engine_output_from_pb(response: decoder_pb2.GenerateResponse) -> EngineOutput:
    """One decoder message as an `EngineOutput`, without accumulation."""
    multimodal = (
        MultimodalPayload.from_pb(response.multimodal_output)
        if response.HasField("multimodal_output")
        else None
    )
    pooling = (
        decode_decoder_tensor(response.pooling_output, "pooling_output")
        if response.HasField("pooling_output")
        else None
    )
    return EngineOutput(
        request_id=response.request_id,
        stage_id=response.stage_id,
        text=response.text_delta,
        token_ids=list(response.new_token_ids),
        multimodal=multimodal,
        pooling_output=pooling,
        finished=response.finished,
        finish_reason=response.finish_reason,
        metrics=RequestMetrics.from_pb(response.metrics),
    )


__all__ = [
    "IMAGE_KEY",
    "DecoderOutputError",
    "EngineOutput",
    "MultimodalPayload",
    "OmniRequestOutput",
    "RequestMetrics",
    "decode_decoder_tensor",
    "metadata_from_pb",
    "wrap_output",
]
