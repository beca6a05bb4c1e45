"""``GET /v1/models`` and ``GET /v1/models/{id}``: the served model, OpenAI's list shape.

A deployment serves one model. Its card is OpenAI's model object (``id``,
``object``, ``created``, ``owned_by``) plus what a client needs to use it,
from the decoder's `DecoderInfo`: ``profile``, ``modalities``, ``voices``,
``sample_rate_hz``, ``limits`` (every `DeploymentLimits` field),
``supports_instructions`` and ``engine_settings`` (each AR stage's engine
settings as built, and code2wav's device and dtype, by stage name: `StageInfo.engine_settings`). ``created`` is when this gateway started. The id
is `gateway.http_common.model_id` (the decoder's model name, or
``omni-serving``), the one chat completions answer with.
"""

from __future__ import annotations

import time

from aiohttp import web
from google.protobuf.descriptor import FieldDescriptor

from gateway.decoder_client import DecoderInfo
from gateway.engine import GatewayEngine
from gateway.http_common import error_response, error_response_for, model_id
from gateway.servicer import CLIENT_ERRORS
from omni_common.errors import quote_value

OWNED_BY = "omni-serving"


def limits_json(info: DecoderInfo) -> dict[str, float | int]:
    """Every `DeploymentLimits` field by its proto name (floats as the float32 they are)."""
    out: dict[str, float | int] = {}
    for field in info.limits.DESCRIPTOR.fields:
        value = getattr(info.limits, field.name)
        if field.type == FieldDescriptor.TYPE_FLOAT:
            value = float(f"{value:.7g}")  # 0.1f is 0.1, not 0.10000000149011612
        out[field.name] = value
    return out


def model_card(info: DecoderInfo, created: int) -> dict[str, object]:
    """The served model as an OpenAI model object with this deployment's extensions."""
    return {
        "id": model_id(info),
        "object": "model",
        "created": created,
        "owned_by": OWNED_BY,
        "profile": info.profile,
        "modalities": list(info.output_modalities),
        "voices": list(info.voices),
        "voice_aliases": dict(info.voice_aliases),
        "sample_rate_hz": info.sample_rate_hz,
        "limits": limits_json(info),
        "supports_instructions": info.supports_instructions,
        "speech_instructions": info.speech_instructions,
        "voice_registry": info.voice_registry,
        "languages": list(info.languages),
        "engine_settings": info.engine_settings,
    }


class ModelsEndpoint:
    """The handlers of ``GET /v1/models`` and ``GET /v1/models/{model_id}``."""

    def __init__(self, engine: GatewayEngine) -> None:
        self._engine = engine
        self._created = int(time.time())

    async def list(self, request: web.Request) -> web.Response:
        try:
            info = await self._engine.decoder_info()
        except CLIENT_ERRORS as exc:
            return error_response_for(exc)
        return web.json_response({"object": "list", "data": [model_card(info, self._created)]})

    async def get(self, request: web.Request) -> web.Response:
        wanted = request.match_info["model_id"]
        try:
            info = await self._engine.decoder_info()
        except CLIENT_ERRORS as exc:
            return error_response_for(exc)
        if wanted != model_id(info):
            return error_response(
                404,
                f"model: {quote_value(wanted)} is not served here; served: {model_id(info)}",
                type_="invalid_request_error",
                param="model",
                code="model_not_found",
            )
        return web.json_response(model_card(info, self._created))


__all__ = ["OWNED_BY", "ModelsEndpoint", "limits_json", "model_card"]
