"""Audio parts of a request, piece by piece: decoding and resampling
(``omni_common.media``), the conversation's parts (``omni_common.conversation``),
the deployment's limits (``decoder_svc.lengths``, ``decoder_svc.inputs``), the
chat prompt's audio tokens (``ChatPrompts``), the checkpoint's audio features
and the HTTP field names. The served path and its parity with the reference
are ``tests/test_omni_input.py``."""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf

from decoder_svc.backend import RequestSpec
from decoder_svc.inputs import decode_inputs
from decoder_svc.lengths import DeploymentSettings, EngineFacts, Options
from decoder_svc.servicer import spec_from_pb
from gateway.http_common import error_body, http_param
from omni_common.conversation import (
    audio_parts,
    conversation_from_pb,
    last_user_text,
    turn_text,
    turns_to_pb,
)
from omni_common.errors import InvalidArgumentError
from omni_common.media import AudioInput, decode_audio, resample
from omni_common.modality import OutputModality
from omni_serving.v1 import common_pb2, decoder_pb2

TONE_HZ = 440.0


def _tone(rate: int, seconds: float = 1.0, channels: int = 1) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    x = (0.5 * np.sin(2 * np.pi * TONE_HZ * t)).astype(np.float32)
    return np.stack([x] * channels, axis=1) if channels > 1 else x


def _file(samples: np.ndarray, rate: int, fmt: str, subtype: str) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _tone_error(y: np.ndarray, rate: int) -> float:
    """Largest difference from the ideal tone at `rate`, away from the edges (filter warm-up)."""
    ideal = 0.5 * np.sin(2 * np.pi * TONE_HZ * np.arange(len(y)) / rate)
    edge = rate // 50
    return float(np.abs(y[edge:-edge] - ideal[edge:-edge]).max())


# -- decoding ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,subtype,tolerance", [
    ("WAV", "PCM_16", 1e-3), ("WAV", "PCM_24", 1e-3), ("WAV", "FLOAT", 1e-3), ("FLAC", "PCM_16", 1e-3),
    ("OGG", "VORBIS", 0.05), ("MP3", "MPEG_LAYER_III", 0.1),
])
@pytest.mark.parametrize("rate", [16000, 24000, 44100, 48000, 8000])
def test_files_decode_to_the_models_rate(fmt, subtype, tolerance, rate):
    data = _file(_tone(rate), rate, fmt, subtype)
    y = decode_audio(AudioInput(data), rate=16000, max_seconds=10)
    assert y.dtype == np.float32 and y.ndim == 1
    assert abs(len(y) - 16000) <= 16000 * 0.08  # lossy codecs pad or trim a few frames
    if fmt in ("WAV", "FLAC"):
        assert len(y) == 16000
        assert _tone_error(y, 16000) <= tolerance + (2e-3 if rate != 16000 else 0)


def test_channels_are_mixed_and_pcm16_takes_its_rate():
    stereo = _tone(16000, channels=2)
    stereo[:, 1] = 0.0
    y = decode_audio(AudioInput(_file(stereo, 16000, "WAV", "FLOAT")), rate=16000, max_seconds=10)
    assert _tone_error(y * 2, 16000) < 1e-5
    pcm = (_tone(24000) * 32767).astype("<i2").tobytes()
    y = decode_audio(AudioInput(pcm, "pcm16", 24000), rate=16000, max_seconds=10)
    assert len(y) == 16000 and _tone_error(y, 16000) < 3e-3


def test_resample_keeps_a_tone_and_the_length_rule():
    for src in (8000, 22050, 24000, 44100, 48000):
        y = resample(_tone(src, 2.0), src, 16000)
        assert len(y) == 32000, src
        assert _tone_error(y, 16000) < 2e-3, src
    up = resample(_tone(16000), 16000, 24000)
    assert len(up) == 24000 and _tone_error(up, 24000) < 2e-3


WAV = _file(_tone(16000), 16000, "WAV", "PCM_16")


@pytest.mark.parametrize("part,field,words", [
    (AudioInput(b""), "a.data", "is empty"),
    (AudioInput(b"not audio at all" * 10), "a.data", "not an audio file"),
    (AudioInput(WAV[:44]), "a.data", "no audio samples"),
    (AudioInput(WAV[: len(WAV) // 2]), "a.data", "cut short"),
    (AudioInput(_file(_tone(16000), 16000, "FLAC", "PCM_16")[:3000]), "a.data", "cut short"),
    (AudioInput(_file(_tone(16000, 2.0), 16000, "MP3", "MPEG_LAYER_III")[:2500]), "a.data", "cut short"),
    (AudioInput(WAV, "flac"), "a.format", "the data is a WAV file"),
    (AudioInput(WAV, "aac"), "a.format", "unknown format"),
    (AudioInput(b"\0\0" * 8, "pcm16"), "a.sample_rate", "sample rate"),
    (AudioInput(b"\0" * 3, "pcm16", 16000), "a.data", "16-bit samples"),
    (AudioInput(_file(_tone(16000, 3.0), 16000, "WAV", "PCM_16")), "a.data", "at most 2 s"),
    (AudioInput(np.full(8, np.nan, "<f4").tobytes() and _file(np.full(1600, np.nan, np.float32), 16000, "WAV",
                                                              "FLOAT")), "a.data", "not finite"),
])
def test_bad_audio_is_refused_naming_the_field(part, field, words):
    with pytest.raises(InvalidArgumentError) as err:
        decode_audio(dataclasses.replace(part, field="a"), rate=16000, max_seconds=2.0)
    assert err.value.field == field and words in str(err.value), str(err.value)


# -- the conversation's parts --------------------------------------------------------------


def _msg(role: str, *parts) -> common_pb2.ChatMessage:  # noqa: ANN002
    def part(p):  # noqa: ANN001, ANN202
        if isinstance(p, str):
            return common_pb2.ContentPart(text=p)
        if isinstance(p, common_pb2.ImageContent):
            return common_pb2.ContentPart(image=p)
        return common_pb2.ContentPart(audio=p)

    return common_pb2.ChatMessage(role=role, content=[part(p) for p in parts])


CLIP = common_pb2.AudioContent(data=WAV, format="wav")


def test_audio_parts_keep_their_place_and_text_runs_join():
    turns = conversation_from_pb([_msg("system", "be brief"), _msg("user", "a", "b", CLIP, "c"), _msg("user", CLIP)],
                                 1000, max_audio_parts=4)
    assert turns[0] == ("system", "be brief")
    role, content = turns[1]
    assert role == "user" and content[0] == "a\nb" and content[2] == "c"
    assert content[1] == AudioInput(WAV, "wav", 0, "messages[1].content[2].audio")
    assert turn_text(content) == "a\nb\nc" and last_user_text(turns) == ""  # the last turn is audio only
    assert [p.field for p in audio_parts(turns)] == ["messages[1].content[2].audio", "messages[2].content[0].audio"]
    again = conversation_from_pb(turns_to_pb(turns), 1000, max_audio_parts=4)  # what the gateway sends on
    assert [(r, turn_text(c)) for r, c in again] == [(r, turn_text(c)) for r, c in turns]
    assert [(a.data, a.format) for a in audio_parts(again)] == [(a.data, a.format) for a in audio_parts(turns)]


@pytest.mark.parametrize("messages,limit,field,words", [
    ([_msg("user", "hi", CLIP)], 0, "messages[0].content[1].audio", "no audio input"),
    ([_msg("user", CLIP, CLIP, CLIP)], 2, "messages[0].content[2].audio", "at most 2"),
    ([_msg("user", CLIP), _msg("assistant", "ok"), _msg("user", CLIP, CLIP)], 2, "messages[2].content[1].audio",
     "audio part 3"),
    ([_msg("user", " ")], 4, "messages[0].content", "has no text"),
])
def test_audio_part_limits(messages, limit, field, words):
    with pytest.raises(InvalidArgumentError) as err:
        conversation_from_pb(messages, 1000, max_audio_parts=limit)
    assert err.value.field == field and words in str(err.value), str(err.value)


# -- the deployment's limits ---------------------------------------------------------------


def _settings_facts(rate: int = 16000) -> EngineFacts:
    return EngineFacts(frames_per_second=12.5, audio_context_tokens=4096, text_context_tokens=2048,
                       default_temperature=0.9, default_top_p=1.0, default_top_k=50, model="m",
                       audio_input_rate=rate)


def _settings(rate: int = 16000, **options) -> DeploymentSettings:  # noqa: ANN003
    facts = _settings_facts(rate)
    return DeploymentSettings.build(profile="omni", output_modalities=OutputModality.TEXT | OutputModality.AUDIO,
                                    supports_instructions=True, facts=facts, options=Options(**options))


def test_image_parts_have_their_own_limits():
    image = common_pb2.ImageContent(data=b"x")
    turns = conversation_from_pb([_msg("user", "look", image, CLIP)], 1000, max_audio_parts=1, max_image_parts=1)
    assert [type(p).__name__ for p in turns[0][1]] == ["str", "ImageInput", "AudioInput"]
    for limits, field, words in [((1, 0), "messages[0].content[1].image", "no image input"),
                                 ((0, 1), "messages[0].content[2].audio", "no audio input")]:
        with pytest.raises(InvalidArgumentError) as err:
            conversation_from_pb([_msg("user", "look", image, CLIP)], 1000, max_audio_parts=limits[0],
                                 max_image_parts=limits[1])
        assert err.value.field == field and words in str(err.value)
    s = _settings()
    assert (s.max_input_image_parts, s.max_input_image_pixels) == (0, 0)  # the facts say: no image input
    facts = dataclasses.replace(_settings_facts(), image_input=True)
    s = DeploymentSettings.build(profile="omni", output_modalities=OutputModality.TEXT, supports_instructions=True,
                                 facts=facts, options=Options(max_input_image_parts=2))
    assert (s.limits_pb().max_input_image_parts, s.limits_pb().max_input_image_pixels) == (2, 36_000_000)
    with pytest.raises(InvalidArgumentError) as err:
        DeploymentSettings.build(profile="omni", output_modalities=OutputModality.TEXT, supports_instructions=True,
                                 facts=facts, options=Options(max_input_image_pixels=0))
    assert err.value.field == "--max-input-image-pixels"


def test_limits_follow_the_first_stage_and_the_options():
    s = _settings()
    assert (s.max_input_audio_parts, s.max_input_audio_seconds, s.audio_input_rate) == (4, 60.0, 16000)
    limits = s.limits_pb()
    assert limits.max_input_audio_parts == 4 and limits.max_input_audio_seconds == 60.0
    assert _settings(rate=0).limits_pb().max_input_audio_parts == 0  # a first stage that reads no audio
    assert _settings(max_input_audio_parts=0).audio_input_rate == 0
    custom = _settings(max_input_audio_parts=1, max_input_audio_seconds=5.5)
    assert (custom.max_input_audio_parts, custom.max_input_audio_seconds) == (1, 5.5)
    for bad, field in [({"max_input_audio_parts": -1}, "--max-input-audio-parts"),
                       ({"max_input_audio_seconds": 0.0}, "--max-input-audio-seconds"),
                       ({"max_input_audio_seconds": float("inf")}, "--max-input-audio-seconds")]:
        with pytest.raises(InvalidArgumentError) as err:
            _settings(**bad)
        assert err.value.field == field


def test_decode_inputs_decodes_in_order_and_drops_the_bytes():
    settings = _settings(max_input_audio_seconds=2.0)
    req = decoder_pb2.GenerateRequest(request_id="r", messages=[
        _msg("user", CLIP, "and", common_pb2.AudioContent(data=_file(_tone(8000, 0.5), 8000, "WAV", "PCM_16")))])
    spec = decode_inputs(spec_from_pb(req, "text", settings), settings)
    assert [len(a) for a in spec.audio] == [16000, 8000]
    assert all(p.data == b"" for p in audio_parts(spec.messages))
    plain = RequestSpec(request_id="p", prompt="hi")
    assert decode_inputs(plain, settings) is plain
    with pytest.raises(InvalidArgumentError) as err:  # what the decoder's servicer checks first, checked again
        decode_inputs(dataclasses.replace(spec, messages=((("user", (AudioInput(WAV, field="f"),)),))),
                      _settings(rate=0))
    assert err.value.field == "f" and "no audio input" in str(err.value)
    long = decoder_pb2.GenerateRequest(request_id="r", messages=[
        _msg("user", common_pb2.AudioContent(data=_file(_tone(16000, 3.0), 16000, "WAV", "PCM_16")))])
    with pytest.raises(InvalidArgumentError) as err:
        decode_inputs(spec_from_pb(long, "text", settings), settings)
    assert err.value.field == "messages[0].content[0].audio.data" and "at most 2 s" in str(err.value)


# -- the chat prompt's audio tokens --------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    from types import SimpleNamespace

    from decoder_svc.qwen3_omni.engine import ChatPrompts
    from decoder_svc.qwen3_omni.media_features import AudioFeatures
    from decoder_svc.qwen3_omni.tiny import _ID, CHAT_TEMPLATE, _tokenizer

    d = tmp_path_factory.mktemp("tok")
    _tokenizer().save_pretrained(d)
    (d / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    ckpt = SimpleNamespace(path=d, config={"im_end_token_id": _ID["<|im_end|>"],
                                           "thinker_config": {"audio_token_id": _ID["<|audio_pad|>"]}},
                           audio_input=AudioFeatures(rate=16000, hop=160, n_window=50))
    return ChatPrompts(ckpt, max_model_len=2048), _ID


def test_each_clip_becomes_its_audio_tokens_where_the_template_put_it(prompts):
    chat, ids = prompts
    pad = ids["<|audio_pad|>"]
    clips = (np.zeros(32000, np.float32), np.zeros(16001, np.float32))
    spec = RequestSpec(request_id="r", prompt="", messages=(
        ("user", (AudioInput(b"", field="a"), "what is this?")), ("assistant", "a sound"),
        ("user", ("and this", AudioInput(b"", field="b")))), audio=clips)
    out = chat.chat(spec)
    got = out.prompt_token_ids
    runs = [(i, len(list(g))) for i, g in _runs(got, pad)]
    # 2 s: 200 frames, 26 tokens; 16001 samples padded to 16160 (101 frames): 13 + 1 tokens
    assert [n for _, n in runs] == [26, 14]
    assert [len(c) for c in out.audio] == [32000, 16160]
    assert got[runs[0][0] - 1] == ids["<|audio_start|>"] and got[runs[0][0] + 26] == ids["<|audio_end|>"]
    with pytest.raises(InvalidArgumentError) as err:  # a text part that spells the audio token
        chat.chat(dataclasses.replace(spec, messages=(("user", ("<|audio_pad|>", AudioInput(b""))),),
                                      audio=clips[:1]))
    assert err.value.field == "messages"


def _runs(ids: list[int], token: int):  # noqa: ANN202
    i = 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            yield i, range(j - i)
            i = j
        else:
            i += 1


# -- the checkpoint's audio features ---------------------------------------------------------


def test_the_checkpoint_reads_its_audio_features(tiny_checkpoint, tmp_path):
    from decoder_svc.qwen3_omni.checkpoint import CheckpointError, OmniCheckpoint

    features = OmniCheckpoint.open(tiny_checkpoint).audio_input
    assert (features.rate, features.hop, features.n_window) == (16000, 160, 50)
    d = tmp_path / "c"
    shutil.copytree(tiny_checkpoint, d)
    (d / "preprocessor_config.json").unlink()
    assert OmniCheckpoint.open(d).audio_input is None  # text input only
    (d / "preprocessor_config.json").write_text(json.dumps({"sampling_rate": "16k", "hop_length": 160}))
    with pytest.raises(CheckpointError) as err:
        OmniCheckpoint.open(d)
    assert err.value.key == "sampling_rate" and "positive integer" in err.value.message


# -- HTTP names ------------------------------------------------------------------------------


def test_http_names_a_part_as_the_client_did():
    params = {"prompt": "messages", ".audio": ".input_audio"}
    assert http_param("messages[0].content[1].audio.data", params) == "messages[0].content[1].input_audio.data"
    assert http_param("messages[0].content[1].audio", params) == "messages[0].content[1].input_audio"
    assert http_param("messages[0].content[1].audiobook", params) == "messages[0].content[1].audiobook"
    assert http_param("prompt", params) == "messages"
    status, body = error_body(InvalidArgumentError("messages[2].content[0].audio.data", "is cut short"), params)
    assert status == 400 and body["param"] == "messages[2].content[0].input_audio.data"
    assert body["message"] == "messages[2].content[0].input_audio.data: is cut short"


# -- images ----------------------------------------------------------------------------------


def _image_file(fmt: str, size=(80, 50), mode: str = "RGB") -> bytes:
    from PIL import Image

    rng = np.random.default_rng(0)
    img = Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)).convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def test_images_decode_to_rgb_pixels():
    from omni_common.media import ImageInput, decode_image

    for fmt, mode in (("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "L"), ("JPEG", "RGB")):
        pixels = decode_image(ImageInput(_image_file(fmt, mode=mode), "i"), max_pixels=10_000)
        assert pixels.shape == (50, 80, 3) and pixels.dtype == np.uint8, (fmt, mode)


@pytest.mark.parametrize("data,words", [
    (b"", "is empty"),
    (b"GIF89a not really" * 4, "not an image file"),
    (_image_file("GIF"), "GIF image"),
    (_image_file("BMP"), "BMP image"),
    (_image_file("PNG")[:300], "cut short"),
    (_image_file("JPEG")[: len(_image_file("JPEG")) * 2 // 3], "cut short"),
    (_image_file("PNG", size=(200, 100)), "at most 10000"),
])
def test_bad_images_are_refused_naming_the_field(data, words):
    from omni_common.media import ImageInput, decode_image

    with pytest.raises(InvalidArgumentError) as err:
        decode_image(ImageInput(data, "m[0].content[1].image"), max_pixels=10_000)
    assert err.value.field == "m[0].content[1].image.data" and words in str(err.value), str(err.value)


def test_image_sizes_follow_the_processors_resize():
    from omni_common import torchvision_compat

    torchvision_compat.install()
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    from decoder_svc.qwen3_omni.media_features import ImageFeatures

    f = ImageFeatures(patch=16, merge=2, min_pixels=3136, max_pixels=12845056)
    for h, w in [(1, 1), (20, 20), (50, 80), (64, 64), (120, 200), (999, 17), (4000, 3000), (5000, 6000)]:
        assert f.resized(h, w) == smart_resize(h, w, factor=32, min_pixels=3136, max_pixels=12845056), (h, w)
    assert f.grid(120, 200) == (1, 8, 12) and f.tokens(120, 200) == 24


def test_the_talkers_positions_are_the_references():
    """talker_positions against transformers' get_rope_index on a talker
    input: text, an image (grid 1 x 8 x 12 -> 4 x 6 tokens), text, a second
    image, the assistant head."""
    from omni_common import torchvision_compat

    torchvision_compat.install()
    import torch as t
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerForConditionalGeneration,
    )

    from decoder_svc.qwen3_omni.talker_rope import talker_positions
    from decoder_svc.qwen3_omni.tiny import _ID, _config

    cfg = _config().talker_config
    img, vs, ve, pad = _ID["<|image_pad|>"], _ID["<|vision_start|>"], _ID["<|vision_end|>"], _ID["<tts_pad>"]
    grids = [(1, 8, 12), (1, 4, 6)]
    ids = [1, 14, 20, vs] + [img] * 24 + [ve, 30, 31, vs] + [img] * 6 + [ve, 2] + [pad] * 9
    want, delta = Qwen3OmniMoeTalkerForConditionalGeneration.get_rope_index(
        SimpleNamespace(config=cfg, spatial_merge_size=2, get_llm_pos_ids_for_vision=functools.partial(
            Qwen3OmniMoeTalkerForConditionalGeneration.get_llm_pos_ids_for_vision, None)),
        t.tensor([ids]), t.tensor(grids), None, t.ones(1, len(ids), dtype=t.long))
    got, got_delta = talker_positions(ids, img, grids, 2, float(cfg.position_id_per_seconds))
    assert np.array_equal(got, want[:, 0].numpy().astype(np.int64)) and got_delta == int(delta), (got, want)
    plain, plain_delta = talker_positions([1, 2, 3], img, [], 2, 13.0)
    assert np.array_equal(plain, np.tile(np.arange(3), (3, 1))) and plain_delta == 0
