"""Prefix caching in a profile: refused where it would lose the talker's input.

A stage that hands every prompt position's rows to the next AR stage (the
omni thinker: input embeddings, hidden states, token ids) cannot serve a
position from vLLM's prefix cache, which skips computing it
(docs/profiles.md, "What is cached between requests").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from decoder_svc.profile import PROFILE_DIR, load_profile
from omni_common.errors import InvalidArgumentError


def _omni_with(tmp_path: Path, stage: int, on: bool) -> Path:
    raw = yaml.safe_load((PROFILE_DIR / "omni.yaml").read_text())
    raw["stages"][stage]["enable_prefix_caching"] = on
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_prefix_caching_on_the_thinker_feeding_the_talker_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        load_profile(str(_omni_with(tmp_path, 0, True)))
    assert info.value.field == "stages[0].enable_prefix_caching"
    assert "stage thinker hands the rows of every prompt position" in str(info.value)
    assert "thinker_embed" in str(info.value) and "stage talker" in str(info.value)


def test_prefix_caching_where_no_rows_are_handed_on_is_taken(tmp_path: Path) -> None:
    # the talker hands codec frames to code2wav, not to an AR stage
    profile = load_profile(str(_omni_with(tmp_path, 1, True)))
    assert profile.stage("talker").enable_prefix_caching
    assert not any(s.enable_prefix_caching for s in load_profile("omni").ar_stages)
    assert not any(s.enable_prefix_caching for s in load_profile("tts").ar_stages)
