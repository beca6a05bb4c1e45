"""A stage process's metrics on the decoder's /metrics (omni_common.metrics_forward).

The default stack's shape: a decoder (`python -m decoder_svc`, fake engine)
whose talker runs in a stage process, and a materializer, both real
processes on Unix sockets. The talker's link switches to in-process building
when the materializer is killed and back when it returns; the series it sets
in its own process (mode, switches, fallback steps) are read from the
decoder's /metrics, labelled ``stage="talker"``; they stay monotonic across a
restart of the stage process.
"""

from __future__ import annotations

import os
import signal

import pytest

from decoder_svc import metrics
from decoder_svc.stage.host import metrics_snapshot
from tests.test_link_faults import batch, check_outputs, materializer, restart, wait_for
from tests.test_stage_liveness import _stage_pid, stage_decoder

TALKER = {"stage": "talker"}


@pytest.mark.e2e
def test_a_stage_process_fallback_and_switches_reach_the_decoders_metrics(tmp_path):
    deployment = f"smet{os.getpid()}"
    mat = materializer(tmp_path, deployment).start()
    dec = stage_decoder(tmp_path, deployment, mat.target)
    try:
        dec.start(timeout_s=120)

        def mode(m: str) -> float:
            return dec.metric("omni_decoder_materializer_mode", mode=m, **TALKER)

        def switches(direction: str, reason: str) -> float:
            return dec.metric("omni_decoder_materializer_switches_total", direction=direction, reason=reason,
                              **TALKER)

        wait_for(lambda: mode("remote") == 1, 30, "the talker's remote mode on the decoder's /metrics")
        assert switches("to_remote", "connected") == 1, "one connect at start"
        assert dec.metric("omni_decoder_materializer_mode", mode="remote") == 0, (
            "the decoder's own (unused) link should not report remote: the stage's series are labelled"
        )

        # the materializer dies under load: the talker builds in-process
        calls = batch(dec.target, "m", 3, 2000, slow=True)  # steps left once the materializer dies
        wait_for(lambda: dec.steps() > 20, 60, "the talker took no steps")
        mat.signal(signal.SIGKILL)
        mat.proc.wait(10)
        wait_for(lambda: mode("in_process") == 1 and mode("remote") == 0, 30, "in-process mode on /metrics")
        wait_for(lambda: dec.metric("omni_decoder_fallback_steps_total", reason="stream_broken", **TALKER) > 0,
                 30, "the talker's fallback steps on /metrics")
        assert switches("to_in_process", "stream_broken") == 1, "one switch to in-process"

        # it comes back: remote again
        restart(mat)
        wait_for(lambda: mode("remote") == 1 and mode("in_process") == 0, 30, "remote mode again on /metrics")
        wait_for(lambda: switches("to_remote", "connected") == 2, 30, "the reconnect on /metrics")
        check_outputs(calls)
        fallbacks = dec.metric("omni_decoder_fallback_steps_total", reason="stream_broken", **TALKER)

        # the stage process restarts: its counters carry over, its new connect adds one
        talker = _stage_pid(dec.proc.pid, "talker")
        assert talker is not None, "no talker stage process under the decoder"
        os.kill(talker, signal.SIGKILL)
        wait_for(lambda: (_stage_pid(dec.proc.pid, "talker") or talker) != talker, 60, "no new talker process")
        wait_for(lambda: switches("to_remote", "connected") == 3, 60, "the new process's connect on /metrics")
        assert switches("to_in_process", "stream_broken") == 1, "a counter went back across the restart"
        assert dec.metric("omni_decoder_fallback_steps_total", reason="stream_broken", **TALKER) == fallbacks, (
            "the fallback steps changed across the restart"
        )
        assert mode("remote") == 1, "the new process's mode"
    finally:
        dec.kill()
        mat.kill()


def test_a_stage_process_forwards_only_what_the_decoder_does_not_record():
    metrics.STEPS.labels("talker", "async").inc()
    metrics.CODE2WAV_RESTARTS.inc()
    metrics.FALLBACK_STEPS.labels("stall").inc()
    metrics.MATERIALIZER_MODE.labels("remote").set(1)
    names = {f[0] for f in metrics_snapshot()}
    assert {"omni_decoder_fallback_steps", "omni_decoder_materializer_mode"} <= names, f"forwarded: {names}"
    repeated = names & {"omni_decoder_steps", "omni_decoder_step_seconds", "omni_decoder_step_gap_seconds",
                        "omni_decoder_active_requests", "omni_decoder_code2wav_worker_restarts"}
    assert not repeated, f"forwarded what the decoder records itself: {repeated}"
