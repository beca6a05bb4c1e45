"""bench media-input on the tiny checkpoint: a results file the report reads,
with every timed step, and shares that are fractions of the step."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def test_media_input_writes_a_results_file_the_report_renders(tmp_path: Path, capsys) -> None:
    from bench import media_input, record

    assert media_input.main(["--audio-seconds", "1", "--images", "64x48", "--repeats", "2",
                             "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-media-input-*.json*")
    rec = record.load(path)
    assert rec["run"]["command"].startswith("omni-serving bench media-input")
    rows = rec["raw"]["inputs"]
    assert [r["input"] for r in rows] == ["audio 1 s", "image 64x48"]
    assert [r["media_tokens"] for r in rows] == [13, 4]  # 1 s: 100 frames, 13 tokens; 64x48 -> 64x64: 4 tokens
    for r in rows:
        assert len(r["step_ms"]) == len(r["tower_ms"]) == 2
        assert all(0 < t < s for t, s in zip(r["tower_ms"], r["step_ms"], strict=True)), r
    table = media_input.render(rec)
    assert "| audio 1 s | 13 |" in table and "| image 64x48 | 4 |" in table
