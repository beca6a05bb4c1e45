"""OutputModality parsing, proto conversion and predicates."""

from __future__ import annotations

import grpc
import pytest

from omni_common.errors import InvalidArgumentError, grpc_code_for
from omni_common.modality import OutputModality, UnknownModalityError
from omni_serving.v1 import payload_pb2

M = OutputModality


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("text", M.TEXT),
        ("speech", M.AUDIO),
        ("audio", M.AUDIO),
        ("audios", M.AUDIO),
        ("images", M.IMAGE),
        ("latents", M.LATENT),
        ("LATENT", M.LATENT),
        ("text+image", M.TEXT | M.IMAGE),
        ("image,text", M.TEXT | M.IMAGE),
        ("image+text", M.TEXT | M.IMAGE),
        (" Text + Audio ", M.TEXT | M.AUDIO),
        ("speech,images+latents", M.AUDIO | M.IMAGE | M.LATENT),
        ("audio+speech", M.AUDIO),
        ("", M.TEXT),
        ("   ", M.TEXT),
        (None, M.TEXT),
    ],
)
def test_from_string(text: str | None, want: OutputModality) -> None:
    got = M.from_string(text)
    assert got == want, f"{text=}: {got=}, {want=}"


@pytest.mark.parametrize(
    "text", ["smell", "text+smell", "text+", "+audio", "text,,audio", "au dio"]
)
def test_from_string_refuses_unknown_or_empty_parts(text: str) -> None:
    with pytest.raises(UnknownModalityError) as info:
        M.from_string(text)
    message = str(info.value)
    assert message.startswith("output_modalities: unknown modality "), message
    assert "supported: text, image, audio, latent" in message, message
    for alias in ("speech", "images", "latents"):
        assert alias in message, message
    assert info.value.field == "output_modalities"


def test_unknown_message_matches_documented_form() -> None:
    with pytest.raises(UnknownModalityError) as info:
        M.from_string("smell")
    got = str(info.value)
    want = (
        "output_modalities: unknown modality 'smell'; supported: text, image, audio, latent "
        "(aliases: speech, audios, images, latents)"
    )
    assert got == want, f"{got=}, {want=}"


def test_unknown_modality_error_is_invalid_argument_with_custom_field() -> None:
    with pytest.raises(UnknownModalityError) as info:
        M.from_string("smell", field="stages[1].output_modality")
    err = info.value
    assert isinstance(err, InvalidArgumentError)
    assert not isinstance(err, ValueError), "a client error must not double as a plain ValueError"
    assert err.field == "stages[1].output_modality"
    assert str(err).startswith("stages[1].output_modality: "), str(err)
    assert grpc_code_for(err) == grpc.StatusCode.INVALID_ARGUMENT


def test_values_match_proto_enum() -> None:
    for member in M:
        want = payload_pb2.OutputModality.Value(f"OUTPUT_MODALITY_{member.name}")
        assert member.value == want, f"{member=}: got={member.value}, {want=}"


@pytest.mark.parametrize(
    "modality",
    [
        M.TEXT,
        M.AUDIO,
        M.TEXT | M.AUDIO,
        M.IMAGE | M.LATENT,
        M.TEXT | M.IMAGE | M.AUDIO | M.LATENT,
    ],
)
def test_proto_and_string_round_trip(modality: OutputModality) -> None:
    values = modality.to_proto()
    assert values == sorted(values), f"{values=} not ascending"
    got = M.from_proto(values)
    assert got == modality, f"{got=}, want={modality}"
    assert M.from_string(modality.to_string()) == modality


def test_to_proto_and_names_are_in_value_order() -> None:
    m = M.LATENT | M.TEXT | M.AUDIO
    assert m.to_proto() == [1, 4, 8], f"got={m.to_proto()}"
    assert m.names() == ["text", "audio", "latent"], f"got={m.names()}"
    assert m.to_string() == "text+audio+latent"
    assert str(M.TEXT | M.AUDIO) == "text+audio"


def test_from_proto_accepts_generated_enum_values_and_duplicates() -> None:
    msg = [payload_pb2.OUTPUT_MODALITY_AUDIO, payload_pb2.OUTPUT_MODALITY_TEXT]
    assert M.from_proto(msg) == M.TEXT | M.AUDIO
    assert M.from_proto([4, 4]) == M.AUDIO


def test_from_proto_empty_is_text() -> None:
    assert M.from_proto([]) == M.TEXT


@pytest.mark.parametrize("values", [[0], [1, 0], [16], [3]])
def test_from_proto_refuses_unspecified_and_unknown(values: list[int]) -> None:
    with pytest.raises(UnknownModalityError) as info:
        M.from_proto(values, field="request.output_modalities")
    assert info.value.field == "request.output_modalities"
    assert "supported: text, image, audio, latent" in str(info.value)


@pytest.mark.parametrize(
    ("modality", "has_text", "has_multimodal"),
    [
        (M.TEXT, True, False),
        (M.AUDIO, False, True),
        (M.TEXT | M.AUDIO, True, True),
        (M.IMAGE | M.LATENT, False, True),
        (M(0), False, False),
    ],
)
def test_predicates(modality: OutputModality, has_text: bool, has_multimodal: bool) -> None:
    assert modality.has_text is has_text, f"{modality=}: got={modality.has_text}, want={has_text}"
    got = modality.has_multimodal
    assert got is has_multimodal, f"{modality=}: {got=}, want={has_multimodal}"
