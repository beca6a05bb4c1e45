"""The voice registry over HTTP, and reference clips in JSON bodies (a voice-clone model's; docs/voices.md).

Routes:

* ``POST /v1/audio/voices`` - register a reference clip under a name:
  ``multipart/form-data`` (fields ``name``, ``audio`` (the file),
  ``transcript``, ``replace``) or JSON (``name``, ``audio``: the file's
  bytes in base64 or a ``data:audio/...;base64,`` URI, ``audio_format``,
  ``transcript``, ``replace``). 201 with the voice; 409 when the name
  exists (without ``replace``); 400 naming the problem for a bad name, clip
  or transcript; 400 (``failed_precondition``) where the model clones no voices.
* ``GET /v1/audio/voices`` - the registered voices (``{"object": "list", "data": [...]}``).
* ``DELETE /v1/audio/voices/{name}`` - delete one (its clip and its
  features for every checkpoint); 404 when there is none.

A voice as JSON: ``{"object": "voice", "name", "transcript",
"duration_seconds", "sha256", "created_at"}``.
"""

from __future__ import annotations

import base64
import binascii
import math
import re

from aiohttp import web

from gateway.engine import GatewayEngine
from gateway.http_common import error_response_for, json_field, read_json
from gateway.servicer import CLIENT_ERRORS
from gateway.validation import MAX_REFERENCE_BYTES, check_instructions, check_reference_audio
from omni_common.errors import InvalidArgumentError
from omni_serving.v1 import common_pb2

__all__ = ["VoicesEndpoint", "audio_from_json", "voice_json", "ROUTE"]

ROUTE = "/v1/audio/voices"
_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+/-]*)(;[\w=.-]+)*;base64,", re.IGNORECASE)
_MIME_FORMATS = {"audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav", "audio/flac": "flac",
                 "audio/x-flac": "flac", "audio/mpeg": "mp3", "audio/mp3": "mp3", "audio/ogg": "ogg"}
FORMATS = ("wav", "flac", "mp3", "ogg", "pcm16")


def audio_from_json(value: object, field: str, audio_format: object = "", sample_rate: object = 0,
                    ) -> common_pb2.AudioContent:
    """A clip in a JSON body: base64 of a file (or of pcm16 samples with their
    ``sample_rate``), or a ``data:audio/...;base64,`` URI (its type names the format)."""
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(field, "must be a non-empty string: the clip's bytes in base64, or a data URI")
    fmt = audio_format if isinstance(audio_format, str) else ""
    match = _DATA_URI.match(value)
    if match:
        fmt = fmt or _MIME_FORMATS.get(match["mime"].lower(), "")
        value = value[match.end():]
    if fmt and fmt not in FORMATS:
        raise InvalidArgumentError(f"{field}_format", f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")
    if len(value) > math.ceil(MAX_REFERENCE_BYTES / 3) * 4 + 4:
        raise InvalidArgumentError(field, f"is over {MAX_REFERENCE_BYTES} bytes once decoded")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgumentError(field, f"is not valid base64: {exc}") from exc
    rate = sample_rate if isinstance(sample_rate, int) and not isinstance(sample_rate, bool) else 0
    audio = check_reference_audio(common_pb2.AudioContent(data=data, format=fmt, sample_rate=rate), field)
    assert audio is not None
    return audio


def voice_json(voice: common_pb2.Voice) -> dict[str, object]:
    return {"object": "voice", "name": voice.name, "transcript": voice.transcript,
            "duration_seconds": voice.duration_seconds, "sha256": voice.sha256,
            "created_at": int(voice.created_unix)}


_PARAMS = {"audio.data": "audio", "audio": "audio"}


class VoicesEndpoint:
    """``POST``, ``GET`` ``/v1/audio/voices`` and ``DELETE /v1/audio/voices/{name}``."""

    def __init__(self, engine: GatewayEngine) -> None:
        self._engine = engine

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post(ROUTE, self.register)
        router.add_get(ROUTE, self.list)
        router.add_delete(ROUTE + "/{name}", self.delete)

    async def _form(self, request: web.Request) -> tuple[str, common_pb2.AudioContent, str, bool]:
        if request.content_type.startswith("multipart/"):
            form = await request.post()
            upload = form.get("audio")
            if upload is None or isinstance(upload, str):
                raise InvalidArgumentError("audio", "is missing: the reference clip, as a file field")
            data = upload.file.read(MAX_REFERENCE_BYTES + 1)
            fmt = _MIME_FORMATS.get((upload.content_type or "").lower(), "")
            audio = check_reference_audio(common_pb2.AudioContent(data=data, format=fmt), "audio")
            assert audio is not None
            name, transcript = str(form.get("name", "")), str(form.get("transcript", ""))
            replace = str(form.get("replace", "")).lower() in ("1", "true", "yes")
        else:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise InvalidArgumentError("body", "must be a JSON object")
            name = str(json_field(body, "name", (str,), ""))
            audio = audio_from_json(body.get("audio"), "audio", body.get("audio_format", ""),
                                    body.get("sample_rate", 0))
            transcript = str(json_field(body, "transcript", (str,), ""))
            replace = bool(json_field(body, "replace", (bool,), False))
        return name, audio, check_instructions(transcript, self._engine.limits, "transcript"), replace

    async def register(self, request: web.Request) -> web.Response:
        try:
            name, audio, transcript, replace = await self._form(request)
            voice = await self._engine.register_voice(name, audio, transcript, replace)
        except CLIENT_ERRORS as exc:
            return error_response_for(exc, _PARAMS)
        return web.json_response(voice_json(voice), status=201)

    async def list(self, request: web.Request) -> web.Response:
        try:
            voices = await self._engine.list_voices()
        except CLIENT_ERRORS as exc:
            return error_response_for(exc)
        return web.json_response({"object": "list", "data": [voice_json(v) for v in voices]})

    async def delete(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        try:
            await self._engine.delete_voice(name)
        except CLIENT_ERRORS as exc:
            return error_response_for(exc)
        return web.json_response({"object": "voice.deleted", "name": name, "deleted": True})
