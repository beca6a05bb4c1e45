"""Invariant: a SIGKILLed decoder leaves its arenas behind (the step arena and
its code2wav workers' frame arena); the next start of the same deployment
removes them."""

from __future__ import annotations

import signal

import pytest

from omni_common.shm_arena import list_segments
from omni_stack.config import StackConfig
from omni_stack.stack import Stack
from tests.speech_helpers import check_chunks, speak_chunks

pytestmark = pytest.mark.e2e


def test_sigkill_then_restart_leaves_no_stale_segment(tmp_path):
    cfg = dict(engine="fake", deployment="killtest", port=0, http_port=0, log_level="WARNING")
    first = Stack(StackConfig(runtime_dir=str(tmp_path / "a"), **cfg))
    first.start()
    try:
        check_chunks(speak_chunks(first.gateway_target, "before the crash", 1))
        stale = list_segments(first.shm_prefix)
        assert len(stale) == 2, stale  # the step arena and the code2wav frames' arena
        decoder = next(s for s in first.services if s.name == "decoder")
        decoder.proc.send_signal(signal.SIGKILL)
        decoder.proc.wait(10)
        assert list_segments(first.shm_prefix) == stale, "a killed decoder cannot unlink its arenas"
    finally:
        for svc in first.services:  # stop the rest without the launcher's sweep
            if svc.proc and svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGTERM)
                svc.proc.wait(30)
    assert list_segments(first.shm_prefix) == stale
    second = Stack(StackConfig(runtime_dir=str(tmp_path / "b"), **cfg))
    second.start()
    try:
        live = list_segments(second.shm_prefix)
        assert set(stale).isdisjoint(live) and len(live) == 2, f"{stale=} {live=}"
        check_chunks(speak_chunks(second.gateway_target, "after the restart", 2))
    finally:
        assert second.stop() == []
