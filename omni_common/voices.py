"""The voice names a request may give: the model's voices, ``default``, and
aliases (OpenAI's voice names, mapped by the model family to its own
voices). The decoder resolves them (``Pipeline.submit``) and reports its
aliases (``GetDecoderInfoResponse.voice_aliases``); the gateway resolves
them the same way before a request leaves (``gateway.validation.check_voice``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from omni_common.errors import InvalidArgumentError, quote_value

__all__ = ["DEFAULT_VOICE", "voice_aliases", "resolve_voice"]

DEFAULT_VOICE = "default"
"""The model's default voice (its first), where the model has no voice of that name."""


def voice_aliases(voices: Sequence[str], table: Mapping[str, str]) -> dict[str, str]:
    """The aliases a model with `voices` answers to: ``default`` (its first
    voice) and each entry of `table` (alias -> voice) whose voice it has and
    whose alias is not one of its voices (a voice of its own wins)."""
    out = {alias: voice for alias, voice in table.items() if voice in voices and alias not in voices}
    if voices and DEFAULT_VOICE not in voices:
        out[DEFAULT_VOICE] = voices[0]
    return dict(sorted(out.items()))


def resolve_voice(voice: str, voices: Sequence[str], aliases: Mapping[str, str], field: str = "voice") -> str:
    """The model's voice for `voice`: empty means its first, an alias its
    voice; anything else is INVALID_ARGUMENT naming `field` and listing the
    voices (and aliases)."""
    if not voice:
        return voices[0] if voices else ""
    if voice in voices:
        return voice
    target = aliases.get(voice)
    if target is not None:
        return target
    listed = ", ".join(voices) if voices else "none"
    more = f"; aliases: {', '.join(sorted(aliases))}" if aliases else ""
    raise InvalidArgumentError(field, f"unknown voice {quote_value(voice)}; voices: {listed}{more}")
