"""bench threads, as a tooling check on the fake engine: a results file the
report reads, one cell per setting and round; the table's figures are
computed from that file, and a bad setting is refused naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import threads

pytestmark = pytest.mark.e2e


def test_settings_are_parsed_and_a_bad_one_is_refused(capsys) -> None:
    assert threads.parse_setting("auto") == (0, "")
    assert threads.parse_setting("2/passive") == (2, "passive")
    assert threads.parse_setting("auto/active") == (0, "active")
    assert threads.decoder_args("1/passive") == ["--stage-threads", "1", "--omp-wait-policy", "passive"]
    for bad in ("0", "x/passive", "1/sleepy"):
        with pytest.raises(ValueError, match=bad.split("/")[0] if bad != "1/sleepy" else "wait policy"):
            threads.parse_setting(bad)
    with pytest.raises(SystemExit):
        threads.main(["--settings", "1,1"])
    assert "distinct settings" in capsys.readouterr().err


def test_threads_writes_a_results_file_the_report_renders(tmp_path: Path) -> None:
    from bench import record

    assert threads.main(["--engine", "fake", "--settings", "auto,1/passive", "--rounds", "2", "--concurrency", "2",
                         "--requests", "3", "--idle-s", "0.3", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-threads-*.json*")
    rec = record.load(path)
    assert rec["run"]["command"].startswith("omni-serving bench threads")
    rounds = rec["raw"]["rounds"]
    assert [[c["setting"] for c in r] for r in rounds] == [["auto", "1/passive"], ["1/passive", "auto"]]
    for cell in (c for r in rounds for c in r):
        assert cell["requests"] == 3 and len(cell["hashes"]) == 3 and cell["stop_problems"] == []
        assert cell["idle_cores"] >= 0 and cell["decoder_cpu_s"] > 0 and all(s > 0 for s in cell["first_audio_s"])
    res = threads.analyze(rec)
    rps = [c["requests"] / c["wall_s"] for r in rounds for c in r if c["setting"] == "1/passive"]
    assert min(rps) <= res["per_setting"]["1/passive"]["throughput_rps"]["median"] <= max(rps)
    assert res["per_setting"]["auto"]["vs_first"]["throughput_rps"] == 1.0
    assert res["hashes_total"] == 3  # seeded requests: the same text and audio under every setting
    table = threads.render(rec)
    assert "| `auto` |" in table and "| `1/passive` |" in table and "Medians of 2 rounds" in table, table
