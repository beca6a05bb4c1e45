"""A stuck code2wav worker process is caught, and a worker's metrics reach the decoder's /metrics.

- The pool's progress bookkeeping (``decoder_svc.code2wav.pool``), one piece
  with a fake clock: a worker with nothing sent is idle; items sent and not
  handled, or a loop that was not waiting at its last report, are work; a
  count that stays put with work waiting is stuck past the floor, and the
  watchdog's verdict kills the worker through ``kill_stuck`` (its process a
  test double that records the kill); the stall reaches its requests'
  error. No process is started.
- What a worker forwards (``worker_metrics``): the series it sets, not the
  decoder's families it never sets nor those the decoder records itself.
- A serving decoder (``python -m decoder_svc``, fake engine, one code2wav
  worker process, a real gRPC server and /metrics): the worker's own
  ``omni_decoder_code2wav_chunk_seconds`` shows on the decoder's /metrics
  labelled ``stage="code2wav",worker="0"``; SIGSTOP the worker while speech
  requests are in flight: they end with UNAVAILABLE naming the stall, the
  decoder's health goes NOT_SERVING then SERVING (seen on a health Watch
  stream: events, not clocks), the worker is restarted, requests afterwards
  succeed and the forwarded counter stays monotonic.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from types import SimpleNamespace

import pytest

from decoder_svc import metrics
from decoder_svc.code2wav.messages import Abort, Finish, Status
from decoder_svc.code2wav.pool import Code2WavProcessPool, _Worker
from decoder_svc.code2wav.worker import PARENT_RECORDED, worker_metrics
from decoder_svc.stage.liveness import watch_stages
from omni_common.errors import UnavailableError
from omni_common.liveness import StallLimits, Watchdog
from omni_common.metrics_forward import Forwarded
from tests.test_code2wav_process import Collector, fake_vocoder, gen_config
from tests.test_stage_liveness import check_caught, check_ended_by_stall

# -- the pool's bookkeeping, with a fake clock ---------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeWorkerProcess:
    """Stands in for a worker's process (a test double): records kill()."""

    pid = 4242

    def __init__(self) -> None:
        self.killed = 0
        self.exitcode: int | None = None

    def kill(self) -> None:
        self.killed += 1
        self.exitcode = -signal.SIGKILL

    def join(self, timeout: float | None = None) -> None:
        pass


def bookkept_pool(forwarded: Forwarded) -> tuple[Code2WavProcessPool, _Worker, Collector]:
    """A pool that was never started, with one ready worker whose process is a
    test double: its bookkeeping alone (nothing reads its queue)."""
    col = Collector()
    pool = Code2WavProcessPool(gen_config(), col.emit, vocoder=fake_vocoder(), shm_prefix="omni-c2wlive-unit",
                               workers=1, on_error=col.on_error, forwarded=forwarded)
    w = _Worker(0, 0, process=FakeWorkerProcess())
    w.ready.set()
    pool._workers.append(w)
    return pool, w, col


def test_the_pools_progress_bookkeeping_judges_a_worker_by_its_loop():
    clock = FakeClock()
    forwarded = Forwarded()
    pool, w, _ = bookkept_pool(forwarded)
    watchdog = Watchdog(StallLimits(floor_s=2.0, grace_s=10.0), clock=clock)
    parts = watch_stages(SimpleNamespace(runners={}, link=None, code2wav=pool), watchdog)
    assert [p.name for p in parts] == ["code2wav:0"], f"watched parts: {[p.name for p in parts]}"
    progress = pool.progress[0]

    def look(after_s: float) -> list[str]:
        clock.now += after_s
        return [s.name for s in watchdog.look()]

    # nothing sent: idle however long the count stays put
    assert look(60.0) == [] and watchdog.ready, "a worker with nothing sent was judged stuck"

    # two items sent (a request pinned to it, its finish; then its abort): work
    pool.finish("r1", "default", "stop")
    pool.abort("r1")
    assert (w.sent, w.taken) == (2, 0), f"sent/taken: {(w.sent, w.taken)}"
    assert [type(m) for m in (w.sendq.get_nowait(), w.sendq.get_nowait())] == [Finish, Abort]
    assert progress.has_work(), "items sent and not handled are no work"
    assert look(1.0) == [], "stuck before the floor"

    # the loop reports chunks decoded: it moves, never stuck
    pool._take_status(w, Status(turns=3, taken=1, waiting=False, pace_s=0.01))
    assert progress.count == 3, f"count: {progress.count}"
    assert progress.pace_s == 0.01, f"pace: {progress.pace_s}"
    assert look(1.5) == [], "a worker that moved was judged stuck"

    # everything handled and the loop waits: idle again (its count may stay put)
    pool._take_status(w, Status(turns=3, taken=2, waiting=True, pace_s=0.01))
    assert not progress.has_work(), "a waiting loop with every item handled has work"
    assert look(30.0) == [], "an idle worker was judged stuck"

    # the loop stopped waiting (a chunk to decode) and never reports a chunk: stuck past the floor
    pool._take_status(w, Status(turns=3, taken=2, waiting=False, pace_s=0.01))
    assert progress.has_work(), "a loop busy decoding has no work"
    assert look(1.0) == [], "stuck before the floor"
    assert look(1.5) == ["code2wav:0"], "a worker that made no progress with work waiting was not caught"
    assert not watchdog.ready, "a stuck worker left the decoder ready"
    assert w.process.killed == 1, f"kills: {w.process.killed}"
    assert w.stalled.startswith("made no progress for 2.5 s with work waiting (limit 2.0 s)"), w.stalled
    assert look(1.0) == ["code2wav:0"] and w.process.killed == 1, "killed again in the same episode"

    # a reported count of a new process adds to the index's count (restarts keep it monotonic)
    new = _Worker(0, 1, process=FakeWorkerProcess())
    new.ready.set()
    pool._workers[0] = new
    assert look(0.1) == [] and watchdog.ready, "the restarted (idle) worker is still judged stuck"
    pool._take_status(new, Status(turns=2, taken=0, waiting=True, pace_s=None))
    assert progress.count == 5, f"count after the restart: {progress.count}"
    assert progress.pace_s == 0.01, "a report without a pace cleared the pace"
    # a worker still starting (not ready) has no work: its start is judged elsewhere
    new.ready.clear()
    pool._take_status(new, Status(turns=2, taken=0, waiting=False, pace_s=None))
    assert not progress.has_work(), "a worker still starting has work"


def test_a_stuck_workers_requests_end_unavailable_naming_the_stall():
    """The crash path with the verdict: the pinned requests fail with
    UnavailableError saying the worker made no progress; its metrics retire."""
    forwarded = Forwarded()
    pool, w, col = bookkept_pool(forwarded)
    pool.finish("r1", "default", "stop")
    forwarded.update("code2wav:0", {"stage": "code2wav", "worker": "0"},
                     [("omni_decoder_code2wav_chunk_seconds", "histogram", "doc",
                       [("omni_decoder_code2wav_chunk_seconds_count", {}, 7.0)])])
    pool.kill_stuck(0, 2.5, 2.0)
    assert w.process.killed == 1, "kill_stuck did not kill the worker's process"
    relaunched = []
    pool._relaunch = lambda new, backoff: relaunched.append(new)  # no process is started here
    w.ready.clear()  # (so the global gauge of ready workers, never raised here, is not lowered)
    pool._exited(w)
    assert list(col.errors) == ["r1"], f"failed: {col.errors}"
    err = col.errors["r1"]
    assert isinstance(err, UnavailableError), f"{type(err).__name__}: {err}"
    assert str(err).startswith("code2wav worker 0 of the request made no progress for 2.5 s"), str(err)
    check_caught(str(err), 2.0)
    assert [x.index for x in relaunched] == [0], f"relaunched: {relaunched}"
    fam = forwarded.families()["omni_decoder_code2wav_chunk_seconds"]
    assert [(s.labels, s.value) for s in fam.samples] == [({"stage": "code2wav", "worker": "0"}, 7.0)], (
        f"the retired worker's count did not carry over: {fam.samples}"
    )


def test_a_worker_forwards_the_series_it_sets_and_nothing_the_decoder_has():
    metrics.CODE2WAV_CHUNK_SECONDS.observe(0.01)
    names = {f[0] for f in worker_metrics()}
    assert "omni_decoder_code2wav_chunk_seconds" in names, f"forwarded: {sorted(names)}"
    assert not names & PARENT_RECORDED, f"forwarded what the decoder records: {sorted(names & PARENT_RECORDED)}"
    others = {n for n in names if n.startswith("omni_decoder_") and not n.startswith("omni_decoder_code2wav_")}
    assert not others, f"forwarded the decoder's own families: {sorted(others)}"


# -- a serving decoder ---------------------------------------------------------------------

WORKER = {"stage": "code2wav", "worker": "0"}


def _worker_pids(log: str) -> list[int]:
    return [int(p) for p in re.findall(r"code2wav worker 0 started \(pid (\d+)\)", log)]


class HealthWatch:
    """The statuses a health Watch stream of `target` reports, in order."""

    def __init__(self, target: str) -> None:
        import grpc

        self.channel = grpc.insecure_channel(target)
        self.statuses: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            for resp in health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest(service="")):
                self.statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
        except grpc.RpcError:  # closed at the end of the test
            pass

    def saw(self, *sequence: str) -> bool:
        """Whether `sequence` occurred in order (other statuses between allowed)."""
        it = iter(self.statuses)
        return all(any(s == want for s in it) for want in sequence)

    def close(self) -> None:
        self.channel.close()
        self.thread.join(5)


@pytest.mark.e2e
def test_a_stopped_code2wav_worker_of_a_serving_decoder_is_killed_and_restarted(tmp_path):
    from tests.test_link_faults import batch, check_outputs, decoder, wait_for
    from tests.test_stage_liveness import _health

    deployment = f"c2wl{os.getpid()}"
    dec = decoder(tmp_path, deployment, "")
    dec.argv += ["--code2wav-workers", "1", "--stall-after-s", "2", "--liveness-grace-s", "60"]
    watch = None
    stopped = None
    try:
        dec.start(timeout_s=180)
        # the worker is ready once the decoder serves; its pid from the decoder's log
        wait_for(lambda: len(_worker_pids(dec.log_text())) == 1, 60, "the code2wav worker's start in the log")
        (old_pid,) = _worker_pids(dec.log_text())

        # a series the worker sets, on the decoder's /metrics with the worker's labels
        check_outputs(batch(dec.target, "warm", 1, 60))
        wait_for(lambda: dec.metric("omni_decoder_code2wav_chunk_seconds_count", **WORKER) > 0, 30,
                 "the worker's chunk time on the decoder's /metrics")
        before = dec.metric("omni_decoder_code2wav_chunk_seconds_count", **WORKER)
        # idle after decoding: the worker handed its freed heap back (counted on the decoder's /metrics)
        wait_for(lambda: dec.metric("omni_decoder_code2wav_heap_trims_total", **WORKER) >= 1, 30,
                 "the idle worker's heap trim on the decoder's /metrics")

        watch = HealthWatch(dec.target)
        wait_for(lambda: watch.statuses[:1] == ["SERVING"], 10, "the health Watch's first status")
        # long requests (thousands of frames): in flight until their worker decodes them all
        calls = batch(dec.target, "s", 2, 6000, max_audio_seconds=300.0, slow=True)
        wait_for(lambda: any(c.pieces for c in calls) or any(c.thread and not c.thread.is_alive() for c in calls),
                 60, "no audio came")
        os.kill(old_pid, signal.SIGSTOP)
        stopped = old_pid
        check_ended_by_stall(calls, 90, "code2wav worker 0 of the request made no progress for", 2.0)

        # not ready while stuck, ready again once the worker was restarted
        wait_for(lambda: watch.saw("SERVING", "NOT_SERVING", "SERVING"), 60,
                 f"health never went NOT_SERVING then SERVING: {watch.statuses}")
        wait_for(lambda: len(_worker_pids(dec.log_text())) == 2, 120, "the worker was not restarted")
        stopped = None  # killed by the decoder
        assert _worker_pids(dec.log_text())[-1] != old_pid, "the restarted worker has the stopped one's pid"
        log = dec.log_text()
        assert "not ready: code2wav:0 made no progress" in log, log[-3000:]
        assert "code2wav worker 0 made no progress for" in log, log[-3000:]

        check_outputs(batch(dec.target, "after", 2, 60))
        assert _health(dec.target, "") == "SERVING", "the decoder is not ready after the restart"
        assert _health(dec.target, "omni_serving.liveness") == "SERVING", "a restarted worker left it not live"
        # the dead worker's count carried over; the new one's adds to it
        wait_for(lambda: dec.metric("omni_decoder_code2wav_chunk_seconds_count", **WORKER) > before, 30,
                 f"the forwarded count did not grow past {before} after the restart")
        assert dec.metric("omni_decoder_code2wav_worker_restarts_total") == 1, "restarts on /metrics"
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if watch is not None:
            watch.close()
        dec.kill()
