"""A stuck decode loop is caught (decoder_svc.stage.liveness, omni_common.liveness).

- In the decoder's process: a fake engine whose step blocks on an Event
  (``WedgingFakeBackend``, a test double) wedges the decode loop under load;
  the watchdog fails its requests with UNAVAILABLE naming the stall, reports
  not ready, then not live past the grace, and ready again once it moves;
  GetDecoderInfo names the stuck part meanwhile (stuck_parts, not_live).
- In a stage process: SIGSTOP the talker's process under load (real
  processes, pipes and shared memory; the fake engine): its requests end
  with UNAVAILABLE naming the stall, the process is killed and started
  again, new requests succeed.
- Readiness while a stage restarts: SIGKILL a serving decoder's talker
  process; its "" and DecoderService health entries go NOT_SERVING until the
  new process is ready, then SERVING again (a thread polls them meanwhile);
  GetDecoderInfo shows the stage restarting meanwhile.
- The options: validated, the option named.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import threading
import time

import pytest

from decoder_svc.backend import RequestSpec
from decoder_svc.pipeline import Pipeline
from decoder_svc.profile import load_profile
from decoder_svc.server import (
    add_arguments,
    code2wav_workers,
    materializer_stall_timeout,
    stall_limits,
)
from decoder_svc.servicer import DecoderServicer
from decoder_svc.stage.liveness import watch_stages
from decoder_svc.testing.fake_engine import FakeBackend, fake_vocoder
from omni_common.errors import InvalidArgumentError, UnavailableError
from omni_common.liveness import StallLimits, Watchdog
from omni_common.modality import OutputModality
from omni_common.shm_arena import list_segments
from omni_serving.v1 import decoder_pb2
from tests.test_pipeline import Collector
from tests.test_stage_processes import PREFIX, ErrorCollector, start


class WedgingFakeBackend(FakeBackend):
    """The fake engine (a test double) whose steps block on `release` from
    its `wedge_at`-th step on, like a device call that never returns."""

    def __init__(self, *, wedge_at: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.wedge_at = wedge_at
        self.calls = 0
        self.release = threading.Event()
        self.wedged = threading.Event()

    def step(self):
        self.calls += 1
        if self.calls >= self.wedge_at and not self.release.is_set():
            self.wedged.set()
            self.release.wait()
        time.sleep(0.005)
        return super().step()


def check_caught(message: str, floor_s: float) -> None:
    """The error names the stall ("made no progress for 2.3 s with work waiting
    (limit 2.0 s)"): at least the floor, caught at a look soon after the limit
    (the limit follows the loop's recent pace: 20 of its turns, on a loaded
    machine more than the floor)."""
    m = re.search(r"made no progress for ([0-9.]+) s with work waiting \(limit ([0-9.]+) s\)", message)
    assert m, f"no stall time and limit in {message!r}"
    seconds, limit = float(m.group(1)), float(m.group(2))
    assert limit >= floor_s and seconds >= limit, f"caught before the limit: {message}"
    assert seconds - limit < 3.0, f"caught late: {message}"


def start_speaking(pipeline: Pipeline, watchdog: Watchdog, col: ErrorCollector, prefix: str) -> None:
    """Watch the pipeline's parts (its talker's decode loop and code2wav, both
    on threads of this process), start both, and send three requests."""
    parts = watch_stages(pipeline, watchdog)
    assert [p.name for p in parts] == ["stage:talker", "code2wav"], f"watched parts: {[p.name for p in parts]}"
    pipeline.start()
    watchdog.start()
    for i in range(3):
        speak(pipeline, col, f"{prefix}{i}", i)


def check_ended_unavailable(col: ErrorCollector, rids: set[str], part: str, floor_s: float = 0.5) -> None:
    """Exactly `rids` ended, each with UNAVAILABLE naming `part`'s stall."""
    assert set(col.errors) == rids, f"finished: {col.finish}, errors: {col.errors}"
    for rid, err in col.errors.items():
        assert isinstance(err, UnavailableError), f"{rid}: {type(err).__name__}: {err}"
        assert f"{part} made no progress for" in str(err), f"{rid}: {err}"
        check_caught(str(err), floor_s)


def check_ended_by_stall(calls, timeout_s: float, naming: str, floor_s: float) -> list:
    """Wait for the gRPC `calls` (tests.test_link_faults.Call); at least one
    failed, and each that failed ended UNAVAILABLE with `naming` (a regular
    expression) and the stall (``check_caught``) in its message. The calls
    that failed."""
    import grpc

    for c in calls:
        c.wait(timeout_s)
    lost = [c for c in calls if c.error is not None]
    assert lost, f"every call finished with the part stopped: {[c.finish for c in calls]}"
    for c in lost:
        assert c.error.code() == grpc.StatusCode.UNAVAILABLE, f"{c.rid}: {c.error.code()} {c.error.details()}"
        assert re.search(naming, c.error.details()), f"{c.rid}: {naming!r} not in {c.error.details()!r}"
        check_caught(c.error.details(), floor_s)
    return lost


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def speak(pipeline: Pipeline, col: Collector, rid: str, seed: int) -> None:
    pipeline.submit(RequestSpec(request_id=rid, prompt=f"speak {rid} for a while please", seed=seed,
                                modality=OutputModality.AUDIO), col.sink_for(rid))


def decoder_info(pipeline: Pipeline, watchdog: Watchdog) -> decoder_pb2.GetDecoderInfoResponse:
    """GetDecoderInfo of a servicer over `pipeline` and `watchdog` (called directly: no server)."""
    servicer = DecoderServicer(pipeline, engine="fake", materializer_target="", watchdog=watchdog)
    return asyncio.run(servicer.GetDecoderInfo(decoder_pb2.GetDecoderInfoRequest(), None))


def test_a_wedged_decode_loop_in_process_fails_its_requests_and_is_reported():
    profile = load_profile("tts")
    backend = WedgingFakeBackend(wedge_at=5, role="talker")
    pipeline = Pipeline(profile, {"talker": backend}, vocoder=fake_vocoder(profile), shm_prefix="omni-livetest",
                        materializer_target=None, arena=None)
    changes: list[tuple[bool, bool]] = []
    watchdog = Watchdog(StallLimits(floor_s=0.5, grace_s=1.5), interval_s=0.05,
                        on_change=lambda ready, live, stuck: changes.append((ready, live)))
    col = ErrorCollector()
    try:
        start_speaking(pipeline, watchdog, col, "w")
        assert backend.wedged.wait(10), "the fake engine never wedged"
        col.wait(3, timeout=30)
        check_ended_unavailable(col, {"w0", "w1", "w2"}, "stage:talker")
        assert not watchdog.ready, "a stuck decode loop left the decoder ready"
        assert [s.name for s in watchdog.stuck()] == ["stage:talker"], f"stuck: {watchdog.stuck()}"
        info = decoder_info(pipeline, watchdog)
        assert [p.name for p in info.stuck_parts] == ["stage:talker"], f"GetDecoderInfo: {info.stuck_parts}"
        part = info.stuck_parts[0]
        assert part.seconds >= part.limit_s >= 0.5 and not part.restarting, f"stuck part: {part}"
        assert "stage:talker made no progress for" in part.description, f"stuck part: {part}"
        wait_for(lambda: not watchdog.live, 5, "stuck past the grace, the decoder stayed live")
        assert decoder_info(pipeline, watchdog).not_live, "GetDecoderInfo says live past the grace"
        # (a look delayed past the grace on a loaded machine reports both at once)
        wait_for(lambda: (False, False) in changes, 5, f"not live never reported: {changes}")
        assert changes[0][0] is False and changes[:2] in ([(False, True), (False, False)], [(False, False)]), (
            f"health changes: {changes}"
        )
        # it moves again: ready and live; a new request is served
        backend.release.set()
        wait_for(lambda: watchdog.ready and watchdog.live, 5, "the loop moved but the decoder stayed not ready")
        wait_for(lambda: changes[-1] == (True, True), 5, f"ready again never reported: {changes}")
        info = decoder_info(pipeline, watchdog)
        assert not info.stuck_parts and not info.not_live, f"after it moved again: {info}"
        speak(pipeline, col, "after", 9)
        col.wait(4, timeout=30)
        assert col.finish["after"] not in ("error",) and col.audio.get("after"), (col.finish, col.errors)
    finally:
        backend.release.set()
        watchdog.stop()
        pipeline.stop()


def test_a_wedged_code2wav_thread_fails_its_requests_and_is_reported(tmp_path):
    """code2wav on a thread of the decoder (no worker processes), its vocoder
    wedged: the running requests end with UNAVAILABLE naming the stall and
    the decoder reports not ready; once the vocoder moves again, ready again
    and a new request is served."""
    from tests.fakes.code2wav_vocoders import FakeGatedVocoderFactory

    profile = load_profile("tts")
    gate, entered = tmp_path / "gate", tmp_path / "entered"
    vocoder = FakeGatedVocoderFactory(str(gate), str(entered), gated_voice="default", num_codebooks=16,
                                      codec_vocab=2048, left_context=profile.stages[-1].codec_left_context_frames)
    pipeline = Pipeline(profile, {"talker": FakeBackend(role="talker")}, vocoder=vocoder,
                        shm_prefix="omni-livetest", materializer_target=None, arena=None)
    watchdog = Watchdog(StallLimits(floor_s=0.5, grace_s=1.5), interval_s=0.05)
    col = ErrorCollector()
    try:
        start_speaking(pipeline, watchdog, col, "c")
        wait_for(entered.exists, 30, "the vocoder never started a chunk")
        col.wait(3, timeout=30)
        check_ended_unavailable(col, {"c0", "c1", "c2"}, "code2wav")
        assert not watchdog.ready and [s.name for s in watchdog.stuck()] == ["code2wav"], watchdog.stuck()
        info = decoder_info(pipeline, watchdog)
        assert [p.name for p in info.stuck_parts] == ["code2wav"], f"GetDecoderInfo: {info.stuck_parts}"
        gate.touch()  # it moves again
        wait_for(lambda: watchdog.ready and watchdog.live, 10, "the vocoder moved but the decoder stayed not ready")
        speak(pipeline, col, "after", 9)
        col.wait(4, timeout=30)
        assert col.finish["after"] not in ("error",) and col.audio.get("after"), (col.finish, col.errors)
    finally:
        gate.touch()
        watchdog.stop()
        pipeline.stop()


@pytest.fixture
def no_segments_left():
    yield
    assert list_segments(PREFIX) == [], "a stage process left its arena behind"


def test_a_stopped_stage_process_is_killed_and_restarted(no_segments_left):
    """SIGSTOP the talker's process while requests speak: they end with
    UNAVAILABLE naming the stall, the process is killed and started again,
    a new request succeeds; the watchdog is ready again."""
    pipeline = start("tts", fake_factory="tests.fakes.stage_backends:SlowFakeBackend",
                     fake_kwargs={"step_s": 0.05})
    talker = pipeline.stage_processes["talker"]
    watchdog = Watchdog(StallLimits(floor_s=2.0, grace_s=60.0), interval_s=0.1)
    watch_stages(pipeline, watchdog)
    watchdog.start()
    col = ErrorCollector()
    old_pid = talker.pid
    stopped = False
    try:
        for i in range(4):
            speak(pipeline, col, f"s{i}", i)
        wait_for(lambda: talker.steps >= 3, 30, "the talker took no steps")
        os.kill(old_pid, signal.SIGSTOP)
        stopped = True
        col.wait(4, timeout=60)
        lost = sorted(col.errors)
        assert lost, f"no request was on the stopped talker: {col.finish}"
        for rid in lost:
            err = col.errors[rid]
            assert isinstance(err, UnavailableError), f"{rid}: {type(err).__name__}: {err}"
            assert "stage talker made no progress for" in str(err), f"{rid}: {err}"
            check_caught(str(err), 2.0)
        wait_for(lambda: talker.ready and talker.pid not in (None, old_pid), 120, "the talker did not come back")
        stopped = False
        assert talker.restarts >= 1, f"restarts: {talker.restarts}"
        speak(pipeline, col, "after", 9)
        col.wait(len(col.finish) + 1, timeout=60)
        assert col.finish["after"] not in ("error",) and col.audio.get("after"), (col.finish, col.errors)
        wait_for(lambda: watchdog.ready, 5, "the watchdog still judges the restarted stage stuck")
        assert watchdog.episodes == 1, f"stuck episodes: {watchdog.episodes}"
    finally:
        if stopped:
            try:
                os.kill(old_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        watchdog.stop()
        pipeline.stop()


def _options(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_the_stall_options_are_validated_naming_the_option():
    limits = stall_limits(_options("--stall-after-s", "2", "--liveness-grace-s", "10"))
    assert (limits.floor_s, limits.grace_s, limits.factor) == (2.0, 10.0, 20.0), f"limits: {limits}"
    assert stall_limits(_options()) == StallLimits(30.0, 20.0, 120.0), f"defaults: {stall_limits(_options())}"
    with pytest.raises(InvalidArgumentError) as err:
        stall_limits(_options("--stall-after-s", "0"))
    assert err.value.field == "--stall-after-s", f"field: {err.value.field}"
    with pytest.raises(InvalidArgumentError) as err:
        stall_limits(_options("--stall-after-s", "30", "--liveness-grace-s", "5"))
    assert err.value.field == "--liveness-grace-s", f"field: {err.value.field}"
    # the materializer link's own stall timeout (the link watchdog's; not the decode loops')
    assert materializer_stall_timeout(_options()) == 3.0
    assert materializer_stall_timeout(_options("--materializer-stall-timeout-s", "15")) == 15.0
    with pytest.raises(InvalidArgumentError) as err:
        materializer_stall_timeout(_options("--materializer-stall-timeout-s", "0"))
    assert err.value.field == "--materializer-stall-timeout-s", f"field: {err.value.field}"


def test_code2wav_workers_default_to_one_per_8_cores_from_1_to_4(monkeypatch):
    monkeypatch.delenv("OMNI_CODE2WAV_WORKERS", raising=False)
    auto = _options()
    got = {cores: code2wav_workers(auto, cores) for cores in (1, 2, 8, 16, 31, 32, 64, 256)}
    assert got == {1: 1, 2: 1, 8: 1, 16: 2, 31: 3, 32: 4, 64: 4, 256: 4}, got
    assert code2wav_workers(auto) >= 1  # this host's cores
    assert code2wav_workers(_options("--code2wav-workers", "0")) == 0
    assert code2wav_workers(_options("--code2wav-workers", "6")) == 6
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(InvalidArgumentError) as err:
            code2wav_workers(_options("--code2wav-workers", bad))
        assert err.value.field == "--code2wav-workers" and repr(bad) in str(err.value), str(err.value)


# -- the decoder as a process: gRPC health and statuses -------------------------------------


def _stage_pid(decoder_pid: int, stage: str) -> int | None:
    """The pid of `decoder_pid`'s stage process for `stage` (named in its title)."""
    for task in os.listdir(f"/proc/{decoder_pid}/task"):
        try:
            with open(f"/proc/{decoder_pid}/task/{task}/children") as f:
                children = [int(p) for p in f.read().split()]
        except OSError:
            continue
        for pid in children:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    title = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if f"decoder stage {stage} " in title:
                return pid
    return None


def _health(target: str, service: str) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def _decoder_info(target: str) -> decoder_pb2.GetDecoderInfoResponse:
    import grpc

    from omni_serving.v1 import decoder_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        return decoder_pb2_grpc.DecoderServiceStub(ch).GetDecoderInfo(decoder_pb2.GetDecoderInfoRequest(), timeout=5)


def stage_decoder(tmp, name: str, materializer_target: str, *extra: str):
    """A decoder process (fake engine, tts) with its stage in a process of its own."""
    from tests.test_link_faults import decoder

    dec = decoder(tmp, name, materializer_target)
    dec.argv += ["--stage-processes", "on", *extra]
    return dec


@pytest.mark.e2e
def test_a_stopped_stage_process_of_a_serving_decoder_ends_its_calls_unavailable(tmp_path):
    """Through gRPC: the liveness entry is SERVING; SIGSTOP the talker's
    process while calls stream: they end UNAVAILABLE naming the stall, the
    stage comes back (a new process), new calls succeed, the decoder stays live."""
    from tests.test_link_faults import batch, check_outputs, materializer

    deployment = f"live{os.getpid()}"
    mat = materializer(tmp_path, deployment).start()
    dec = stage_decoder(tmp_path, deployment, mat.target, "--stall-after-s", "2", "--liveness-grace-s", "60")
    try:
        dec.start(timeout_s=120)
        assert _health(dec.target, "omni_serving.liveness") == "SERVING", "the liveness entry is not SERVING"
        assert _health(dec.target, "") == "SERVING", "the decoder is not ready"
        talker = _stage_pid(dec.proc.pid, "talker")
        assert talker is not None, "no talker stage process under the decoder"
        calls = batch(dec.target, "s", 4, 2000, slow=True)  # still running seconds later
        wait_for(lambda: dec.steps() > 5, 60, "the talker took no steps")
        os.kill(talker, signal.SIGSTOP)
        # both of the stopped process's loops stall with it (its decode loop,
        # and its materializer link's when steps were waiting to go out):
        # whichever the watchdog catches first is named
        check_ended_by_stall(calls, 60, r"stage talker (\(materializer link\) )?made no progress for", 2.0)
        wait_for(lambda: "stage talker: restarted (pid" in dec.log_text(), 120, "the talker did not come back")
        assert _stage_pid(dec.proc.pid, "talker") not in (None, talker), "the talker's process is the stopped one"
        # ready again at the watchdog's next look after the restart
        wait_for(lambda: _health(dec.target, "") == "SERVING", 10, "the decoder is not ready after the restart")
        check_outputs(batch(dec.target, "after", 2, 60))
        assert _health(dec.target, "omni_serving.liveness") == "SERVING", "a restarted stage left it not live"
        assert re.search(r"(decode loop|materializer link) made no progress for", dec.log_text()), \
            dec.log_text()[-3000:]
    finally:
        dec.kill()
        mat.kill()


class HealthPoller:
    """Polls a decoder's readiness entries and GetDecoderInfo on a thread of
    its own, recording every answer (`seen`: (entry, status); `infos`) until `stop`."""

    ENTRIES = ("", "omni_serving.v1.DecoderService")

    def __init__(self, target: str) -> None:
        self.target = target
        self.seen: list[tuple[str, str]] = []
        self.infos: list[decoder_pb2.GetDecoderInfoResponse] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from omni_serving.v1 import decoder_pb2_grpc

        with grpc.insecure_channel(self.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            info_stub = decoder_pb2_grpc.DecoderServiceStub(ch)
            while not self._stop.is_set():
                for entry in self.ENTRIES:
                    try:
                        resp = stub.Check(health_pb2.HealthCheckRequest(service=entry), timeout=2)
                    except grpc.RpcError as exc:
                        self.seen.append((entry, f"error {exc.code()}"))
                        continue
                    self.seen.append((entry, health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)))
                try:
                    self.infos.append(info_stub.GetDecoderInfo(decoder_pb2.GetDecoderInfoRequest(), timeout=2))
                except grpc.RpcError:
                    pass
                self._stop.wait(0.02)

    def stop(self) -> list[tuple[str, str]]:
        self._stop.set()
        self._thread.join(10)
        return self.seen


@pytest.mark.e2e
def test_a_decoder_is_not_ready_while_its_stage_process_restarts(tmp_path):
    from tests.test_link_faults import batch, check_outputs, materializer

    deployment = f"rdy{os.getpid()}"
    mat = materializer(tmp_path, deployment).start()
    dec = stage_decoder(tmp_path, deployment, mat.target)
    poller = None
    try:
        dec.start(timeout_s=120)
        for entry in HealthPoller.ENTRIES:
            assert _health(dec.target, entry) == "SERVING", f"health entry {entry!r} is not SERVING at start"
        talker = _stage_pid(dec.proc.pid, "talker")
        assert talker is not None, "no talker stage process under the decoder"
        poller = HealthPoller(dec.target)
        wait_for(lambda: len(poller.seen) >= 2, 10, "the health poller got no answer")
        os.kill(talker, signal.SIGKILL)
        wait_for(lambda: "stage talker: restarted (pid" in dec.log_text(), 120, "the talker did not come back")
        wait_for(lambda: poller.seen[-2:] == [(e, "SERVING") for e in HealthPoller.ENTRIES], 10,
                 f"not SERVING again after the restart: {poller.seen[-4:]}")
        seen = poller.stop()
        for entry in HealthPoller.ENTRIES:
            statuses = [st for e, st in seen if e == entry]
            assert "NOT_SERVING" in statuses, f"{entry!r} never NOT_SERVING while the talker restarted: {statuses}"
            first_down = statuses.index("NOT_SERVING")
            assert set(statuses[:first_down]) == {"SERVING"}, f"{entry!r} before the kill: {statuses}"
        assert "not ready: stage:talker is restarting" in dec.log_text(), dec.log_text()[-3000:]
        restarting = [i for i in poller.infos if any(p.restarting for p in i.stuck_parts)]
        assert restarting, f"GetDecoderInfo never showed the restart ({len(poller.infos)} answers)"
        assert [p.name for p in restarting[0].stuck_parts] == ["stage:talker"], restarting[0].stuck_parts
        assert any(st.name == "talker" and st.restarting for i in poller.infos for st in i.stages), (
            "no StageInfo of the talker said restarting"
        )
        last = _decoder_info(dec.target)
        assert not last.stuck_parts and not any(st.restarting for st in last.stages), f"after the restart: {last}"
        assert _health(dec.target, "omni_serving.liveness") == "SERVING", "a restarting stage made it not live"
        check_outputs(batch(dec.target, "after", 2, 60))
    finally:
        if poller is not None:
            poller.stop()
        dec.kill()
        mat.kill()
