"""The realtime session's parts without a server: voice activity detection on
synthetic signals, the transcript kept by a truncation, and the checks of
session settings, items and response options (every refusal names the field
as a client spells it)."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from gateway.realtime_protocol import (
    SessionConfig,
    item_from_json,
    response_options,
    session_update,
    truncated_transcript,
)
from gateway.realtime_vad import (
    SpeechStarted,
    SpeechStopped,
    VadOptions,
    VoiceActivity,
    frame_levels,
)
from omni_common.errors import InvalidArgumentError

RATE = 24_000


def burst(ms: int, dbfs: float) -> np.ndarray:
    """A 300 Hz tone of `ms` milliseconds at an RMS of `dbfs`."""
    t = np.arange(RATE * ms // 1000) / RATE
    return (np.sin(2 * np.pi * 300 * t) * np.sqrt(2) * 10 ** (dbfs / 20) * 32767).astype(np.int16)


def silence(ms: int) -> np.ndarray:
    return np.zeros(RATE * ms // 1000, dtype=np.int16)


def test_levels_map_dbfs_onto_0_to_1() -> None:
    levels = frame_levels(np.concatenate([silence(10), burst(10, -35.0), burst(10, -10.0), burst(10, -60.0)]))
    assert levels[0] == 0.0 and levels[2] == pytest.approx(1.0, abs=0.01)
    assert levels[1] == pytest.approx(0.5, abs=0.01) and levels[3] == pytest.approx(0.0, abs=0.01)


@pytest.mark.parametrize("piece", [240, 1000, 4800, 100_000])
def test_a_burst_is_one_turn_whatever_the_append_sizes(piece: int) -> None:
    """Start at the burst's first frame, stop once the silence lasted its
    duration, the turn padded before; the same events however the audio is cut."""
    signal = np.concatenate([silence(1000), burst(700, -20.0), silence(900)])
    vad = VoiceActivity(VadOptions(prefix_padding_ms=300, silence_duration_ms=500))
    events = [e for i in range(0, len(signal), piece) for e in vad.feed(signal[i:i + piece])]
    assert events == [SpeechStarted(1000), SpeechStopped(2200, turn_start_sample=RATE * 700 // 1000,
                                                         turn_end_sample=RATE * 2200 // 1000)], events
    assert not vad.speaking


def test_clicks_quiet_sound_and_short_pauses_are_not_turns() -> None:
    vad = VoiceActivity(VadOptions(threshold=0.5, silence_duration_ms=500))
    assert vad.feed(np.concatenate([silence(200), burst(20, -10.0), silence(200)])) == []  # a 20 ms click
    assert vad.feed(burst(2000, -40.0)) == []  # below the threshold (-35 dBFS at 0.5)
    # a pause shorter than silence_duration_ms keeps the turn going
    events = vad.feed(np.concatenate([burst(300, -20.0), silence(400), burst(300, -20.0), silence(600)]))
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped], events
    # a higher threshold ignores what the default takes for speech
    assert VoiceActivity(VadOptions(threshold=0.9)).feed(np.concatenate([burst(500, -20.0), silence(600)])) == []


def test_reset_forgets_a_turn_in_progress() -> None:
    vad = VoiceActivity(VadOptions())
    assert [type(e) for e in vad.feed(burst(200, -20.0))] == [SpeechStarted]
    vad.reset(RATE // 5)
    assert not vad.speaking and vad.feed(silence(1000)) == []
    assert vad.feed(burst(100, -20.0)) == [SpeechStarted(1200)]  # times go on from where the session is


@pytest.mark.parametrize("kept, want", [
    (1.0, "The quick brown fox jumps."),
    (0.5, "The quick brown"),  # 13 characters heard: to the end of "brown"
    (0.3, "The quick"),
    (0.01, "The"),
    (0.0, ""),
])
def test_a_truncated_transcript_keeps_the_words_heard(kept: float, want: str) -> None:
    assert truncated_transcript("The quick brown fox jumps.", kept) == want


@pytest.mark.parametrize("session, field", [
    ({"type": "transcription"}, "session.type"),
    ({"type": "realtime", "voice": "alloy"}, "session.voice"),  # the beta's place for it
    ({"type": "realtime", "output_modalities": ["audio", "text"]}, "session.output_modalities"),
    ({"type": "realtime", "max_output_tokens": 0}, "session.max_output_tokens"),
    ({"type": "realtime", "max_output_tokens": True}, "session.max_output_tokens"),
    ({"type": "realtime", "instructions": 5}, "session.instructions"),
    ({"type": "realtime", "tools": [{"type": "function", "name": "f"}]}, "session.tools"),
    ({"type": "realtime", "truncation": "sometimes"}, "session.truncation"),
    ({"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
     "session.audio.input.format.rate"),
    ({"type": "realtime", "audio": {"input": {"noise_reduction": {"type": "near_field"}}}},
     "session.audio.input.noise_reduction"),
    ({"type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 1.5}}}},
     "session.audio.input.turn_detection.threshold"),
    ({"type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 0}}}},
     "session.audio.input.turn_detection.silence_duration_ms"),
    ({"type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 5000}}}},
     "session.audio.input.turn_detection.idle_timeout_ms"),
    ({"type": "realtime", "audio": {"output": {"speed": 1.5}}}, "session.audio.output.speed"),
    ({"type": "realtime", "audio": {"output": {"format": {"type": "audio/pcma"}}}},
     "session.audio.output.format.type"),
    ("realtime", "session"),
])
def test_session_settings_are_checked(session: object, field: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        session_update(SessionConfig(), session)
    assert info.value.field == field, info.value


def test_session_updates_change_only_what_they_name() -> None:
    config = session_update(SessionConfig(), {"type": "realtime", "instructions": "Be brief.", "audio": {
        "input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 800}},
        "output": {"voice": {"id": "ethan"}}}})
    assert config.instructions == "Be brief." and config.voice == "ethan" and config.output_modalities == ("audio",)
    assert config.vad == VadOptions(silence_duration_ms=800)
    config = session_update(config, {"type": "realtime", "max_output_tokens": "inf", "audio": {
        "input": {"turn_detection": None}}})
    assert config.vad is None and config.instructions == "Be brief." and config.max_output_tokens is None
    again = session_update(config, {"type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad"}}}})
    assert again.vad == VadOptions()


def test_items_and_response_options_are_checked() -> None:
    pcm = base64.b64encode(bytes(4800)).decode()
    item = item_from_json({"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "hi"}, {"type": "input_audio", "audio": pcm}]}, "item", RATE)
    assert [p.type for p in item.content] == ["input_text", "input_audio"] and len(item.content[1].audio) == 4800
    for bad, field in [
        ({"type": "message", "role": "tool", "content": []}, "item.role"),
        ({"type": "message", "role": "user", "content": []}, "item.content"),
        ({"type": "message", "role": "system", "content": [{"type": "input_audio", "audio": pcm}]},
         "item.content[0].type"),
        ({"type": "message", "role": "assistant", "content": [{"type": "output_audio"}]},
         "item.content[0].transcript"),
        ({"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": pcm * 20}]},
         "item.content[0].audio"),  # longer than the 0.1 s allowed here
        ({"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]},
         "item.content[0].image_url"),
        ({"type": "message", "role": "user", "id": "x" * 65, "content": [{"type": "input_text", "text": "a"}]},
         "item.id"),
    ]:
        with pytest.raises(InvalidArgumentError) as info:
            item_from_json(bad, "item", RATE // 10)
        assert info.value.field == field, (bad, info.value)
    config = SessionConfig(instructions="Be brief.", voice="chelsie")
    options = response_options(config, {"output_modalities": ["text"], "conversation": "none",
                                        "metadata": {"topic": "weather"}})
    assert (options.output_modalities, options.instructions, options.voice, options.in_conversation) == (
        ("text",), "Be brief.", "chelsie", False)
    for bad, field in [({"conversation": "thread_1"}, "response.conversation"),
                       ({"metadata": {"k": 1}}, "response.metadata"),
                       ({"audio": {"output": {"voice": ""}}}, "response.audio.output.voice"),
                       ({"temperature": 0.8}, "response.temperature")]:
        with pytest.raises(InvalidArgumentError) as info:
            response_options(config, bad)
        assert info.value.field == field, (bad, info.value)
