"""A request's media inputs, decoded for the first stage (before its prompt is built).

``decode_inputs`` turns the audio parts of a request's conversation
(``omni_common.media.AudioInput``: the bytes a client sent) into float32
mono samples at the rate the first stage's audio tower reads
(``DeploymentSettings.audio_input_rate``), checked against the deployment's
limits; the request then carries the samples (``RequestSpec.audio``, in
order) and its turns keep only where each part stands (the bytes are
dropped: stage processes are sent the samples, not the files).
"""

from __future__ import annotations

import dataclasses

from decoder_svc.backend import RequestSpec
from decoder_svc.lengths import DeploymentSettings
from omni_common.conversation import NO_AUDIO_INPUT, audio_parts
from omni_common.errors import InvalidArgumentError
from omni_common.media import AudioInput, decode_audio

__all__ = ["decode_inputs"]


def decode_inputs(spec: RequestSpec, settings: DeploymentSettings) -> RequestSpec:
    """``spec`` with its audio parts decoded (itself when it has none)."""
    parts = audio_parts(spec.messages)
    if not parts:
        return spec
    if not settings.audio_input_rate or not settings.max_input_audio_parts:
        raise InvalidArgumentError(parts[0].field, NO_AUDIO_INPUT)
    if len(parts) > settings.max_input_audio_parts:
        raise InvalidArgumentError(
            parts[settings.max_input_audio_parts].field,
            f"the request has {len(parts)} audio parts; the deployment takes at most "
            f"{settings.max_input_audio_parts}",
        )
    clips = tuple(
        decode_audio(p, rate=settings.audio_input_rate, max_seconds=settings.max_input_audio_seconds) for p in parts
    )
    messages = tuple(
        (role, content if isinstance(content, str) else tuple(_placeholder(p) for p in content))
        for role, content in spec.messages
    )
    return dataclasses.replace(spec, messages=messages, audio=clips)


def _placeholder(part: str | AudioInput) -> str | AudioInput:
    return dataclasses.replace(part, data=b"") if isinstance(part, AudioInput) else part
