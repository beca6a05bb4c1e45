"""A request's media inputs, decoded for the first stage (before its prompt is built).

``decode_inputs`` turns the audio and image parts of a request's
conversation (``omni_common.media.AudioInput`` / ``ImageInput``: the bytes
a client sent) into what the first stage's encoders read, checked against
the deployment's limits: float32 mono samples at its audio rate
(``DeploymentSettings.audio_input_rate``), RGB pixels. The request then
carries them (``RequestSpec.audio`` / ``images``, in order) and its turns
keep only where each part stands (the bytes are dropped: stage processes
are sent the decoded media, not the files).
"""

from __future__ import annotations

import dataclasses

from decoder_svc.backend import RequestSpec
from decoder_svc.lengths import DeploymentSettings
from omni_common.conversation import NO_AUDIO_INPUT, NO_IMAGE_INPUT, audio_parts, image_parts
from omni_common.errors import InvalidArgumentError
from omni_common.media import AudioInput, ImageInput, decode_audio, decode_image

__all__ = ["decode_inputs"]


def decode_inputs(spec: RequestSpec, settings: DeploymentSettings) -> RequestSpec:
    """``spec`` with its media parts decoded (itself when it has none)."""
    audio, images = audio_parts(spec.messages), image_parts(spec.messages)
    if not audio and not images:
        return spec
    _check_count(audio, settings.max_input_audio_parts if settings.audio_input_rate else 0, "audio", NO_AUDIO_INPUT)
    _check_count(images, settings.max_input_image_parts, "image", NO_IMAGE_INPUT)
    clips = tuple(
        decode_audio(p, rate=settings.audio_input_rate, max_seconds=settings.max_input_audio_seconds) for p in audio
    )
    pictures = tuple(decode_image(p, max_pixels=settings.max_input_image_pixels) for p in images)
    messages = tuple(
        (role, content if isinstance(content, str) else tuple(_placeholder(p) for p in content))
        for role, content in spec.messages
    )
    return dataclasses.replace(spec, messages=messages, audio=clips, images=pictures)


def _check_count(parts: list, allowed: int, kind: str, none_taken: str) -> None:  # noqa: ANN001
    if parts and not allowed:
        raise InvalidArgumentError(parts[0].field, none_taken)
    if len(parts) > allowed:
        raise InvalidArgumentError(
            parts[allowed].field, f"the request has {len(parts)} {kind} parts; the deployment takes at most {allowed}"
        )


def _placeholder(part: str | AudioInput | ImageInput) -> str | AudioInput | ImageInput:
    return part if isinstance(part, str) else dataclasses.replace(part, data=b"")
