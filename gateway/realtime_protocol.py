"""The realtime session's vocabulary: its settings, conversation items and
response options as OpenAI's Realtime API (GA) spells them, checked, and
their JSON shapes for the server's events.

Everything a client sends is checked here and refused with an error that
names the field as the client spelled it (``session.audio.input.format``,
``item.content[1].audio``); an option this server does not implement is
refused too (``tools`` other than none, ``semantic_vad``, input
transcription, noise reduction, G.711 audio), never silently ignored.
`gateway.realtime` runs the session.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from gateway.http_common import json_field
from gateway.realtime_vad import SAMPLE_RATE_HZ, VadOptions
from gateway.validation import check_unicode, check_voice_shape, json_type_name
from omni_common.errors import FailedPreconditionError, InvalidArgumentError, quote_value

AUDIO_FORMAT = {"type": "audio/pcm", "rate": SAMPLE_RATE_HZ}
"""The one audio format, both ways: PCM16 little-endian mono at 24 kHz (base64 in JSON)."""
MODALITIES = (("audio",), ("text",))
"""``output_modalities``: audio (with its transcript) or text."""
MAX_OUTPUT_TOKENS = 4096
MAX_METADATA_KEYS = 16
MAX_INSTRUCTIONS_CHARS = 4096


EVENT_FIELDS = {
    "session.update": ("session",),
    "input_audio_buffer.append": ("audio",),
    "input_audio_buffer.commit": (),
    "input_audio_buffer.clear": (),
    "conversation.item.create": ("item", "previous_item_id"),
    "conversation.item.truncate": ("item_id", "content_index", "audio_end_ms"),
    "conversation.item.delete": ("item_id",),
    "conversation.item.retrieve": ("item_id",),
    "response.create": ("response",),
    "response.cancel": ("response_id",),
}
"""The client events served and their fields (besides ``type`` and ``event_id``)."""
CLIENT_EVENTS = tuple(EVENT_FIELDS)


class SessionError(FailedPreconditionError):
    """A client event the session cannot take in its state (no audio to
    commit, a response already running, an unknown item), with OpenAI's
    error code for it."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.realtime_code = code
        self.field = param


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


# ------------------------------------------------------------------ field helpers


def obj(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidArgumentError(where, f"must be an object, got {json_type_name(value)}")
    return value


def known(body: Mapping[str, object], where: str, fields: tuple[str, ...]) -> None:
    for key in body:
        if key not in fields:
            raise InvalidArgumentError(f"{where}.{key}" if where else str(key),
                                       f"unknown field; known: {', '.join(fields)}")


def typed(body: Mapping[str, object], key: str, where: str, types: tuple[type, ...], default: object) -> object:
    """``body[key]`` if of one of `types` (absent or null: `default`): `json_field` at ``where.key``."""
    return json_field(body, f"{where}.{key}" if where else key, types, default)


def only(body: Mapping[str, object], key: str, where: str, allowed: tuple[object, ...], why: str) -> None:
    """An option this server does not implement: absent, null or one of `allowed`."""
    value = body.get(key)
    if value is not None and value not in allowed:
        raise InvalidArgumentError(f"{where}.{key}", f"{why}; got {quote_value(str(value))[:80]}")


def base64_audio(value: object, where: str) -> bytes:
    """Base64 PCM16 (whole samples)."""
    if not isinstance(value, str):
        raise InvalidArgumentError(where, f"must be a base64 string, got {json_type_name(value)}")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgumentError(where, "is not valid base64") from None
    if len(raw) % 2:
        raise InvalidArgumentError(where, f"has {len(raw)} bytes: PCM16 audio is whole 2-byte samples")
    return raw


def audio_format(value: object, where: str) -> None:
    fmt = obj(value, where)
    known(fmt, where, ("type", "rate"))
    if fmt.get("type", "audio/pcm") != "audio/pcm":
        raise InvalidArgumentError(f"{where}.type", f"only audio/pcm (PCM16 at {SAMPLE_RATE_HZ} Hz) is served; "
                                                    f"got {quote_value(str(fmt.get('type')))}")
    if fmt.get("rate", SAMPLE_RATE_HZ) != SAMPLE_RATE_HZ:
        raise InvalidArgumentError(f"{where}.rate", f"must be {SAMPLE_RATE_HZ}, got {fmt.get('rate')!r}")


def voice_of(value: object, where: str) -> str:
    if isinstance(value, dict):  # OpenAI's {"id": ...} form
        value = value.get("id")
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(where, "must be a voice name")
    return check_voice_shape(value, where)


def modalities(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or tuple(value) not in MODALITIES:
        raise InvalidArgumentError(where, 'must be ["audio"] (audio and its transcript) or ["text"]')
    return tuple(value)


def max_tokens(value: object, where: str) -> int | None:
    if value == "inf":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise InvalidArgumentError(where, f'must be "inf" or an integer from 1 to {MAX_OUTPUT_TOKENS}')
    return value


def instructions_of(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgumentError(where, f"must be a string, got {json_type_name(value)}")
    if len(value) > MAX_INSTRUCTIONS_CHARS:
        raise InvalidArgumentError(where, f"has {len(value)} characters; the limit is {MAX_INSTRUCTIONS_CHARS}")
    return check_unicode(value, where)


# ------------------------------------------------------------------ the session's settings

SESSION_FIELDS = ("type", "model", "output_modalities", "instructions", "audio", "max_output_tokens", "tools",
                  "tool_choice", "tracing", "truncation", "include", "prompt", "parallel_tool_calls")
VAD_FIELDS = ("type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
              "interrupt_response", "idle_timeout_ms")


@dataclass(frozen=True)
class SessionConfig:
    """What ``session.update`` sets."""

    output_modalities: tuple[str, ...] = ("audio",)
    instructions: str = ""
    voice: str = ""
    """As the client named it ("" : the deployment's first voice); checked against the decoder."""
    vad: VadOptions | None = field(default_factory=VadOptions)
    max_output_tokens: int | None = None
    truncation: str = "auto"

    def to_json(self, session_id: str, model: str, voice: str) -> dict:
        """OpenAI's session object (``session.created`` / ``session.updated``)."""
        vad = None
        if self.vad is not None:
            vad = {"type": "server_vad", "threshold": self.vad.threshold,
                   "prefix_padding_ms": self.vad.prefix_padding_ms,
                   "silence_duration_ms": self.vad.silence_duration_ms,
                   "create_response": self.vad.create_response,
                   "interrupt_response": self.vad.interrupt_response, "idle_timeout_ms": None}
        return {
            "type": "realtime", "object": "realtime.session", "id": session_id, "model": model,
            "output_modalities": list(self.output_modalities), "instructions": self.instructions,
            "audio": {
                "input": {"format": dict(AUDIO_FORMAT), "transcription": None, "noise_reduction": None,
                          "turn_detection": vad},
                "output": {"format": dict(AUDIO_FORMAT), "voice": voice, "speed": 1.0},
            },
            "tools": [], "tool_choice": "auto", "tracing": None, "truncation": self.truncation,
            "max_output_tokens": "inf" if self.max_output_tokens is None else self.max_output_tokens,
            "prompt": None, "include": None,
        }


def session_update(config: SessionConfig, body: object, where: str = "session") -> SessionConfig:
    """`config` with the fields of a ``session.update``'s session object (all checked first)."""
    s = obj(body, where)
    known(s, where, SESSION_FIELDS)
    if s.get("type", "realtime") != "realtime":
        raise InvalidArgumentError(f"{where}.type", 'must be "realtime" (transcription sessions are not served)')
    typed(s, "model", where, (str,), "")
    only(s, "tools", where, ([],), "tools are not implemented (only [])")
    only(s, "tool_choice", where, ("auto", "none"), 'tools are not implemented (only "auto" or "none")')
    only(s, "tracing", where, (), "tracing is not implemented (only null)")
    only(s, "prompt", where, (), "prompt templates are not implemented (only null)")
    only(s, "include", where, ([],), "no extra fields can be included (only [])")
    typed(s, "parallel_tool_calls", where, (bool,), False)
    changes: dict = {}
    if s.get("output_modalities") is not None:
        changes["output_modalities"] = modalities(s["output_modalities"], f"{where}.output_modalities")
    if s.get("instructions") is not None:
        changes["instructions"] = instructions_of(s["instructions"], f"{where}.instructions")
    if s.get("max_output_tokens") is not None:
        changes["max_output_tokens"] = max_tokens(s["max_output_tokens"], f"{where}.max_output_tokens")
    if s.get("truncation") is not None:
        if s["truncation"] not in ("auto", "disabled"):
            raise InvalidArgumentError(f"{where}.truncation", 'must be "auto" or "disabled"')
        changes["truncation"] = s["truncation"]
    audio = obj(s["audio"], f"{where}.audio") if s.get("audio") is not None else {}
    known(audio, f"{where}.audio", ("input", "output"))
    if audio.get("input") is not None:
        where_in = f"{where}.audio.input"
        inp = obj(audio["input"], where_in)
        known(inp, where_in, ("format", "transcription", "noise_reduction", "turn_detection"))
        if inp.get("format") is not None:
            audio_format(inp["format"], f"{where_in}.format")
        only(inp, "transcription", where_in, (), "input transcription is not implemented (only null)")
        only(inp, "noise_reduction", where_in, (), "noise reduction is not implemented (only null)")
        if "turn_detection" in inp:
            changes["vad"] = vad_options(inp["turn_detection"], f"{where_in}.turn_detection", config.vad)
    if audio.get("output") is not None:
        where_out = f"{where}.audio.output"
        out = obj(audio["output"], where_out)
        known(out, where_out, ("format", "voice", "speed"))
        if out.get("format") is not None:
            audio_format(out["format"], f"{where_out}.format")
        if out.get("speed") not in (None, 1, 1.0):
            raise InvalidArgumentError(f"{where_out}.speed", "only 1.0 is served (the model speaks at its pace)")
        if out.get("voice") is not None:
            changes["voice"] = voice_of(out["voice"], f"{where_out}.voice")
    return replace(config, **changes)


def vad_options(value: object, where: str, current: VadOptions | None) -> VadOptions | None:
    """``turn_detection``: null (commit by hand) or ``server_vad`` (fields not given keep
    their current values, or OpenAI's defaults)."""
    if value is None:
        return None
    td = obj(value, where)
    known(td, where, VAD_FIELDS)
    if td.get("type") != "server_vad":
        raise InvalidArgumentError(f"{where}.type", 'must be "server_vad" (semantic_vad is not implemented)')
    only(td, "idle_timeout_ms", where, (), "idle timeouts are not implemented (only null)")
    base = current or VadOptions()
    threshold = typed(td, "threshold", where, (int, float), base.threshold)
    assert isinstance(threshold, (int, float))
    if not 0.0 <= threshold <= 1.0:
        raise InvalidArgumentError(f"{where}.threshold", f"must be in [0, 1], got {threshold}")
    ms = {}
    for key, high in (("prefix_padding_ms", 10_000), ("silence_duration_ms", 10_000)):
        v = typed(td, key, where, (int,), getattr(base, key))
        assert isinstance(v, int)
        if not 0 <= v <= high or (key == "silence_duration_ms" and v < 10):
            raise InvalidArgumentError(f"{where}.{key}", f"must be from {10 if 'silence' in key else 0} to {high}")
        ms[key] = v
    return VadOptions(
        threshold=float(threshold), prefix_padding_ms=ms["prefix_padding_ms"],
        silence_duration_ms=ms["silence_duration_ms"],
        create_response=bool(typed(td, "create_response", where, (bool,), base.create_response)),
        interrupt_response=bool(typed(td, "interrupt_response", where, (bool,), base.interrupt_response)),
    )


# ------------------------------------------------------------------ conversation items


@dataclass
class Part:
    """One content part of an item: ``input_text``, ``input_audio`` (PCM16 at
    24 kHz), ``input_image`` (PNG/JPEG bytes), ``output_text`` or ``output_audio``."""

    type: str
    text: str = ""
    audio: bytes = b""
    image: bytes = b""
    transcript: str | None = None

    def to_json(self) -> dict:
        """As in OpenAI's item events: never the audio or image bytes back."""
        if self.type in ("input_text", "output_text"):
            return {"type": self.type, "text": self.text}
        if self.type == "input_image":
            return {"type": "input_image", "image_url": None, "detail": "auto"}
        return {"type": self.type, "transcript": self.transcript}


@dataclass
class Item:
    """A message of the conversation."""

    id: str
    role: str
    content: list[Part]
    status: str = "completed"
    audio_samples: int = 0
    """An assistant's audio so far (what ``conversation.item.truncate`` may cut)."""

    def to_json(self) -> dict:
        return {"id": self.id, "type": "message", "object": "realtime.item", "status": self.status,
                "role": self.role, "content": [p.to_json() for p in self.content]}


ROLE_PARTS = {"system": ("input_text",), "user": ("input_text", "input_audio", "input_image"),
              "assistant": ("output_text", "output_audio")}


def item_from_json(value: object, where: str, max_audio_samples: int) -> Item:
    """A ``conversation.item.create``'s item: a message (function calls are not served)."""
    it = obj(value, where)
    if it.get("type", "message") != "message":
        raise InvalidArgumentError(f"{where}.type", "only message items are served (no function calls)")
    known(it, where, ("id", "type", "object", "role", "content", "status"))
    role = it.get("role")
    if role not in ROLE_PARTS:
        raise InvalidArgumentError(f"{where}.role", f"must be one of {', '.join(ROLE_PARTS)}")
    item_id = typed(it, "id", where, (str,), "") or new_id("item")
    assert isinstance(item_id, str)
    if len(item_id) > 64 or not item_id.isprintable():
        raise InvalidArgumentError(f"{where}.id", "must be printable and at most 64 characters")
    content = it.get("content")
    if not isinstance(content, list) or not content:
        raise InvalidArgumentError(f"{where}.content", "must be a non-empty array of content parts")
    parts = [_part(c, f"{where}.content[{i}]", ROLE_PARTS[role], max_audio_samples) for i, c in enumerate(content)]
    return Item(item_id, role, parts)


def _part(value: object, where: str, allowed: tuple[str, ...], max_audio_samples: int) -> Part:
    p = obj(value, where)
    kind = p.get("type")
    if kind not in allowed:
        raise InvalidArgumentError(f"{where}.type", f"must be one of {', '.join(allowed)} here, "
                                                    f"got {quote_value(str(kind))}")
    if kind in ("input_text", "output_text"):
        known(p, where, ("type", "text"))
        text = p.get("text")
        if not isinstance(text, str):
            raise InvalidArgumentError(f"{where}.text", f"must be a string, got {json_type_name(text)}")
        return Part(kind, text=check_unicode(text, f"{where}.text"))
    if kind == "input_image":
        known(p, where, ("type", "image_url", "detail"))
        url = p.get("image_url")
        head, sep, data = url.partition(",") if isinstance(url, str) else ("", "", "")
        if not (head.startswith("data:") and sep and head.endswith(";base64")):
            raise InvalidArgumentError(f"{where}.image_url", "must be a base64 data URL (data:image/png;base64,...)")
        try:
            return Part(kind, image=base64.b64decode(data, validate=True))
        except (binascii.Error, ValueError):
            raise InvalidArgumentError(f"{where}.image_url", "is not valid base64 after the comma") from None
    known(p, where, ("type", "audio", "transcript"))
    transcript = typed(p, "transcript", where, (str,), None)
    assert transcript is None or isinstance(transcript, str)
    if kind == "output_audio":  # an earlier reply, as heard: its transcript is what the model reads
        if not transcript:
            raise InvalidArgumentError(f"{where}.transcript", "is required: the model reads a reply's transcript")
        return Part(kind, transcript=check_unicode(transcript, f"{where}.transcript"))
    audio = base64_audio(p.get("audio"), f"{where}.audio")
    if not audio:
        raise InvalidArgumentError(f"{where}.audio", "is empty")
    if len(audio) // 2 > max_audio_samples:
        raise InvalidArgumentError(f"{where}.audio", f"holds {len(audio) / 2 / SAMPLE_RATE_HZ:.1f} s; this "
                                                     f"deployment takes at most {max_audio_samples / SAMPLE_RATE_HZ:g} s "
                                                     "in one part")
    return Part(kind, audio=audio, transcript=transcript)


# ------------------------------------------------------------------ responses

RESPONSE_FIELDS = ("output_modalities", "instructions", "max_output_tokens", "audio", "conversation", "metadata",
                   "input", "tools", "tool_choice", "prompt")


@dataclass(frozen=True)
class ResponseOptions:
    output_modalities: tuple[str, ...]
    instructions: str
    voice: str
    max_output_tokens: int | None
    in_conversation: bool = True
    metadata: dict[str, str] | None = None


def response_options(config: SessionConfig, value: object, where: str = "response") -> ResponseOptions:
    """A ``response.create``'s options over the session's."""
    r = obj(value, where) if value is not None else {}
    known(r, where, RESPONSE_FIELDS)
    only(r, "input", where, (), "a response reads the conversation (custom input is not implemented)")
    only(r, "tools", where, ([],), "tools are not implemented (only [])")
    only(r, "tool_choice", where, ("auto", "none"), 'tools are not implemented (only "auto" or "none")')
    only(r, "prompt", where, (), "prompt templates are not implemented (only null)")
    if r.get("conversation", "auto") not in ("auto", "none"):
        raise InvalidArgumentError(f"{where}.conversation", 'must be "auto" or "none"')
    voice = config.voice
    audio = obj(r["audio"], f"{where}.audio") if r.get("audio") is not None else {}
    known(audio, f"{where}.audio", ("output",))
    if audio.get("output") is not None:
        out = obj(audio["output"], f"{where}.audio.output")
        known(out, f"{where}.audio.output", ("format", "voice"))
        if out.get("format") is not None:
            audio_format(out["format"], f"{where}.audio.output.format")
        if out.get("voice") is not None:
            voice = voice_of(out["voice"], f"{where}.audio.output.voice")
    metadata = typed(r, "metadata", where, (dict,), None)
    if metadata is not None:
        assert isinstance(metadata, dict)
        if len(metadata) > MAX_METADATA_KEYS or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items()):
            raise InvalidArgumentError(f"{where}.metadata", f"must hold at most {MAX_METADATA_KEYS} string "
                                                            "values (keys up to 64, values up to 512 characters)")
    return ResponseOptions(
        output_modalities=(modalities(r["output_modalities"], f"{where}.output_modalities")
                           if r.get("output_modalities") is not None else config.output_modalities),
        instructions=(instructions_of(r["instructions"], f"{where}.instructions")
                      if r.get("instructions") is not None else config.instructions),
        voice=voice,
        max_output_tokens=(max_tokens(r["max_output_tokens"], f"{where}.max_output_tokens")
                           if r.get("max_output_tokens") is not None else config.max_output_tokens),
        in_conversation=r.get("conversation", "auto") == "auto",
        metadata=metadata,
    )


def response_json(response_id: str, conversation_id: str | None, options: ResponseOptions, voice: str,
                  status: str, output: list[dict], *, details: dict | None = None,
                  usage: dict | None = None) -> dict:
    """OpenAI's response object."""
    return {
        "id": response_id, "object": "realtime.response", "status": status, "status_details": details,
        "output": output, "conversation_id": conversation_id,
        "output_modalities": list(options.output_modalities),
        "max_output_tokens": "inf" if options.max_output_tokens is None else options.max_output_tokens,
        "audio": {"output": {"format": dict(AUDIO_FORMAT), "voice": voice}},
        "usage": usage, "metadata": options.metadata,
    }


def truncated_transcript(text: str, kept: float) -> str:
    """The share `kept` (0..1) of a reply's transcript, to the end of the word
    being spoken: what was heard of it when its audio is cut there (the words
    are taken as evenly spread over the audio)."""
    if kept >= 1.0:
        return text
    cut = math.ceil(len(text) * max(0.0, kept))
    if not cut:  # nothing was heard
        return ""
    while cut < len(text) and not text[cut].isspace():
        cut += 1
    return text[:cut].rstrip()


class EventIds:
    """``event_<n>`` for the server's events."""

    def __init__(self) -> None:
        self._n = itertools.count(1)

    def next(self) -> str:
        return f"event_{next(self._n)}"


__all__ = [
    "AUDIO_FORMAT",
    "CLIENT_EVENTS",
    "EVENT_FIELDS",
    "EventIds",
    "Item",
    "Part",
    "ResponseOptions",
    "SessionConfig",
    "SessionError",
    "base64_audio",
    "item_from_json",
    "new_id",
    "response_json",
    "response_options",
    "session_update",
    "truncated_transcript",
]
