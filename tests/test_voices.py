"""omni_common.voices: the names a request may give for a voice, resolved the
same way by the decoder and the gateway; Qwen3-Omni's table of OpenAI's names."""

from __future__ import annotations

import pytest

from decoder_svc.qwen3_omni.vocoder import OPENAI_VOICES
from omni_common.errors import InvalidArgumentError
from omni_common.voices import resolve_voice, voice_aliases

QWEN = ("aiden", "chelsie", "ethan")


def test_aliases_keep_what_the_model_has_and_add_default():
    table = {"alloy": "chelsie", "echo": "ethan", "ghost": "nobody", "aiden": "ethan"}
    assert voice_aliases(QWEN, table) == {"alloy": "chelsie", "default": "aiden", "echo": "ethan"}
    # a model with a voice named "default" keeps it; no voices, no default
    assert voice_aliases(("default", "alloy"), {"alloy": "default"}) == {}
    assert voice_aliases((), {"alloy": "x"}) == {}


def test_resolve_voice():
    aliases = voice_aliases(QWEN, OPENAI_VOICES)
    assert resolve_voice("", QWEN, aliases) == "aiden"
    assert resolve_voice("default", QWEN, aliases) == "aiden"
    assert resolve_voice("ethan", QWEN, aliases) == "ethan"
    assert resolve_voice("alloy", QWEN, aliases) == "chelsie"
    assert resolve_voice("", (), {}) == ""
    with pytest.raises(InvalidArgumentError) as info:
        resolve_voice("zed", QWEN, aliases, field="audio.voice")
    assert info.value.field == "audio.voice"
    assert "unknown voice 'zed'; voices: aiden, chelsie, ethan; aliases: alloy, ash," in str(info.value)


def test_qwen3_omnis_table_covers_openais_voices_with_its_speakers():
    openai_voices = {"alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                     "shimmer", "verse"}
    assert set(OPENAI_VOICES) == openai_voices and set(OPENAI_VOICES.values()) == set(QWEN)
