"""A Generate request's conversation (``ChatMessage`` s): checked the same
way by the gateway and the decoder, as (role, content) turns.

Roles are ``system``, ``user`` and ``assistant``; the last turn is the
user's (the model's reply follows it). A turn's content is its text (text
parts joined by newlines), or, when it has audio parts, a tuple of parts in
order: text (adjacent text parts joined by newlines),
:class:`~omni_common.media.AudioInput` s and
:class:`~omni_common.media.ImageInput` s. A turn has text, media or both;
all turns together have at most ``max_chars`` characters of text, at most
``max_audio_parts`` audio parts and ``max_image_parts`` image parts. Every refusal names the field
(``messages[2].role``, ``messages[0].content[1]``).
"""

from __future__ import annotations

from collections.abc import Sequence

from omni_common.errors import InvalidArgumentError, quote_value
from omni_common.media import AudioInput, ImageInput

__all__ = [
    "NO_AUDIO_INPUT", "NO_IMAGE_INPUT", "ROLES", "Content", "Turn", "audio_parts", "image_parts", "conversation_from_pb", "last_user_text",
    "turn_text", "turns_to_pb",
]

ROLES = ("system", "user", "assistant")
Content = str | tuple[str | AudioInput | ImageInput, ...]
Turn = tuple[str, Content]  # (role, text) or (role, parts with audio)

NO_AUDIO_INPUT = "this deployment takes no audio input (its first stage reads no audio)"
NO_IMAGE_INPUT = "this deployment takes no image input (its first stage reads no images)"


def conversation_from_pb(
    messages: Sequence, max_chars: int, field: str = "messages", *, max_audio_parts: int = 0,
    max_image_parts: int = 0,
) -> tuple[Turn, ...]:
    """The (role, content) turns of ``messages`` (``common_pb2.ChatMessage``), checked."""
    turns: list[Turn] = []
    total = 0
    counts = {"audio": 0, "image": 0}
    limits = {"audio": (max_audio_parts, NO_AUDIO_INPUT), "image": (max_image_parts, NO_IMAGE_INPUT)}
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if message.role not in ROLES:
            raise InvalidArgumentError(f"{where}.role",
                                       f"unknown role {quote_value(message.role)}; roles: {', '.join(ROLES)}")
        parts: list[str | AudioInput | ImageInput] = []
        texts: list[str] = []  # the run of text parts being read
        for j, part in enumerate(message.content):
            kind = part.WhichOneof("part")
            if kind == "text":
                texts.append(part.text)
                continue
            if kind not in counts:
                raise InvalidArgumentError(f"{where}.content[{j}]",
                                           "is empty" if kind is None else f"{kind} parts are not taken here")
            counts[kind] += 1
            allowed, none_taken = limits[kind]
            if not allowed:
                raise InvalidArgumentError(f"{where}.content[{j}].{kind}", none_taken)
            if counts[kind] > allowed:
                raise InvalidArgumentError(
                    f"{where}.content[{j}].{kind}",
                    f"is {kind} part {counts[kind]} of the request; the deployment takes at most {allowed}")
            if texts:
                parts.append("\n".join(texts))
                texts = []
            if kind == "audio":
                a = part.audio
                parts.append(AudioInput(a.data, a.format, int(a.sample_rate), f"{where}.content[{j}].audio"))
            else:
                parts.append(ImageInput(part.image.data, f"{where}.content[{j}].image"))
        if texts:
            parts.append("\n".join(texts))
        text = turn_text(tuple(parts))
        has_media = any(not isinstance(p, str) for p in parts)
        if not text.strip() and not has_media:
            raise InvalidArgumentError(f"{where}.content", "has no text")
        total += len(text)
        if total > max_chars:
            raise InvalidArgumentError(
                f"{where}.content",
                f"the conversation has {total} characters up to here; the limit is {max_chars} in all")
        turns.append((message.role, tuple(parts) if has_media else text))
    if not turns:
        raise InvalidArgumentError(field, "is empty")
    if turns[-1][0] != "user":
        raise InvalidArgumentError(f"{field}[{len(turns) - 1}].role",
                                   "the last turn must be the user's (the model's reply follows it)")
    return tuple(turns)


def turn_text(content: Content) -> str:
    """A turn's text: its text parts joined by newlines (audio parts left out)."""
    if isinstance(content, str):
        return content
    return "\n".join(p for p in content if isinstance(p, str))


def audio_parts(turns: Sequence[Turn]) -> list[AudioInput]:
    """The audio parts of every turn, in order."""
    return [p for _, content in turns if not isinstance(content, str) for p in content if isinstance(p, AudioInput)]


def image_parts(turns: Sequence[Turn]) -> list[ImageInput]:
    """The image parts of every turn, in order."""
    return [p for _, content in turns if not isinstance(content, str) for p in content if isinstance(p, ImageInput)]


def last_user_text(turns: Sequence[Turn]) -> str:
    """The text of the last user turn (what an engine without a chat template reads)."""
    return next(turn_text(content) for role, content in reversed(turns) if role == "user")


def turns_to_pb(turns: Sequence[Turn]) -> list:
    """``turns`` as ``common_pb2.ChatMessage`` s (what the gateway sends the decoder)."""
    from omni_serving.v1 import common_pb2

    def part(p: str | AudioInput | ImageInput):  # noqa: ANN202
        if isinstance(p, str):
            return common_pb2.ContentPart(text=p)
        if isinstance(p, ImageInput):
            return common_pb2.ContentPart(image=common_pb2.ImageContent(data=p.data))
        return common_pb2.ContentPart(
            audio=common_pb2.AudioContent(data=p.data, format=p.format, sample_rate=p.sample_rate))

    return [common_pb2.ChatMessage(role=role, content=[part(content)] if isinstance(content, str)
                                   else [part(p) for p in content])
            for role, content in turns]
