"""AR stages in their own processes (decoder_svc.stage): the same outputs
as the stages in the decoder's process, on both output paths and through a
real materializer; a stage process that dies costs only its requests and
comes back; an engine's refusal crosses the process unchanged; the stages'
forward passes overlap. Real processes, real pipes, real shared memory; the
engines are the fake engine's (a test double), the real engine's stage
processes run in tests/test_vllm_e2e.py and tests/test_up.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from decoder_svc.backend import RequestSpec
from decoder_svc.busy import BUSY
from decoder_svc.pipeline import Pipeline
from decoder_svc.profile import load_profile
from decoder_svc.stage.launch import launch_stages, stage_specs
from decoder_svc.stage.proxy import StageProcess
from decoder_svc.testing.fake_engine import fake_vocoder
from materializer_svc.reference import ReferenceMaterializer
from materializer_svc.registry import MaterializerConfig
from omni_common.errors import InvalidArgumentError, UnavailableError
from omni_common.modality import OutputModality
from omni_common.shm_arena import list_segments
from tests.fakes.stage_backends import REFUSED_MARKER, TALKER_REFUSES_MARKER
from tests.test_pipeline import Collector, ServerThread, run_batch

PREFIX = f"omni-stagetest{os.getpid()}"  # per process: two runs (or xdist workers) at once must not share arenas


def start(profile_name: str, *, materializer_target: str | None = None, in_process_builder: bool = False,
          fake_factory: str = "", fake_kwargs: dict | None = None, **spec_kw) -> Pipeline:
    profile = load_profile(profile_name)
    stages = launch_stages(stage_specs(
        profile, engine="fake", shm_prefix=PREFIX, materializer_target=materializer_target or "",
        in_process_builder=in_process_builder, fake_factory=fake_factory, fake_kwargs=fake_kwargs or {},
        **spec_kw), start_timeout_s=120)
    try:
        pipeline = Pipeline(profile, stages, vocoder=fake_vocoder(profile, stages[profile.ar_stages[-1].name]),
                            shm_prefix=PREFIX, materializer_target=materializer_target,
                            arena=None, in_process_builder=in_process_builder)
    except BaseException:
        for s in stages.values():
            s.stop()
        raise
    pipeline.start()
    return pipeline


def submit(pipeline: Pipeline, col: Collector, i: int, modality: str = "audio", prompt: str = "") -> str:
    rid = f"r{i}"
    pipeline.submit(RequestSpec(request_id=rid, prompt=prompt or f"request number {i} says hello", seed=100 + i,
                                modality=OutputModality.from_string(modality)), col.sink_for(rid))
    return rid


def run(pipeline: Pipeline, n: int = 8, modality: str = "audio") -> dict:
    col = Collector()
    try:
        for i in range(n):
            submit(pipeline, col, i, modality)
        col.wait(n)
    finally:
        pipeline.stop()
    return col.digests()


@pytest.fixture(autouse=True)
def no_segments_left():
    yield
    assert list_segments(PREFIX) == [], "a stage process left its arena behind"


@pytest.mark.parametrize("path", ["sync", "async"])
@pytest.mark.parametrize(("profile", "modality"), [("tts", "audio"), ("omni", "text+audio"), ("omni", "text")])
def test_stage_processes_equal_the_stages_in_process(profile, modality, path):
    want, _ = run_batch(profile, modality=modality, materializer_target=None, arena=None)
    pipeline = start(profile, in_process_builder=path == "async")
    stages = pipeline.stage_processes
    assert set(stages) == {s.name for s in pipeline.ar_configs}
    pids = {s.pid for s in stages.values()}
    assert None not in pids and os.getpid() not in pids and len(pids) == len(stages), pids
    assert all(d.use_async == (path == "async") for d in pipeline.decisions.values())
    if path == "async":  # each stage process has its own arena, under the deployment's prefix
        assert len(list_segments(PREFIX)) == len(stages)
    got = run(pipeline, modality=modality)
    assert got == want
    assert all(not s.ready and s.pid is None for s in stages.values()), "a stage process outlived stop()"


def test_stage_processes_through_a_real_materializer(tmp_path):
    want, _ = run_batch("omni", modality="text+audio", materializer_target=None, arena=None)
    with ServerThread(f"unix://{tmp_path}/m.sock", ReferenceMaterializer(MaterializerConfig(shm_prefix=PREFIX))) as srv:
        pipeline = start("omni", materializer_target=srv.target)
        deadline = time.monotonic() + 30
        while not pipeline.materializer_connected and time.monotonic() < deadline:
            time.sleep(0.05)  # each stage process reports its link's state
        assert pipeline.materializer_connected
        assert pipeline.link is None, "the decoder keeps no link of its own: each stage has one"
        col = Collector()
        for i in range(8):
            submit(pipeline, col, i, "text+audio")
        col.wait(8)
        time.sleep(0.5)  # a status or two
        arena = pipeline.arena_info()
        attachment = pipeline.materializer_attachment()
        fallback = pipeline.fallback_steps
        steps = {i.name: i.steps for i in pipeline.stage_infos()}
        pipeline.stop()
    assert col.digests() == want
    assert arena is not None and arena[0].startswith(f"{PREFIX}-arena-") and arena[4] >= 1, arena
    assert attachment is not None and attachment.transport == "shm", attachment
    assert fallback == 0, "steps were built in the stage processes instead of by the materializer"
    assert steps["thinker"] > 0 and steps["talker"] > 0, steps


def wait_for(cond, timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {why}"
        time.sleep(0.02)


def test_a_killed_stage_process_fails_its_requests_only_and_comes_back():
    """SIGKILL the talker's process while requests speak: those requests end
    with UNAVAILABLE; text-only requests (thinker only) finish; the talker
    comes back as a new process and serves new requests; its arena is swept."""
    pipeline = start("omni", in_process_builder=True, fake_factory="tests.fakes.stage_backends:SlowFakeBackend",
                     fake_kwargs={"step_s": 0.05})
    talker = pipeline.stage_processes["talker"]
    col = Collector()
    errors: dict[str, BaseException] = {}
    lock = threading.Lock()

    def sink_for(rid):
        inner = col.sink_for(rid)

        def sink(resp):
            if isinstance(resp, BaseException):
                with lock:
                    errors[rid] = resp
                with col.done:
                    col.finish[rid] = "error"
                    col.done.notify_all()
                return
            inner(resp)

        return sink

    try:
        audio = [f"a{i}" for i in range(4)]
        for i, rid in enumerate(audio):
            pipeline.submit(RequestSpec(request_id=rid, prompt=f"speak number {i} please", seed=i,
                                        modality=OutputModality.TEXT | OutputModality.AUDIO), sink_for(rid))
        wait_for(talker.has_unfinished, 60, "no request reached the talker")
        old_pid = talker.pid
        segments_before = list_segments(PREFIX)
        text = [f"t{i}" for i in range(4)]
        for i, rid in enumerate(text):
            pipeline.submit(RequestSpec(request_id=rid, prompt=f"write number {i} please", seed=10 + i,
                                        modality=OutputModality.TEXT), sink_for(rid))
        os.kill(old_pid, signal.SIGKILL)
        col.wait(8, timeout=120)
        lost = [rid for rid in audio if rid in errors]
        assert lost, "no request was on the killed talker"
        assert all(isinstance(errors[rid], UnavailableError) for rid in lost), errors
        assert all("talker" in str(errors[rid]) for rid in lost), errors
        assert all(col.finish[rid] != "error" and col.text.get(rid) for rid in text), (col.finish, errors)
        # it comes back: a new process, serving
        wait_for(lambda: talker.ready, 120, "the talker did not come back")
        assert talker.pid not in (None, old_pid) and talker.restarts >= 1
        dead_arena = [n for n in segments_before if f"-arena-{old_pid}-" in n]
        assert dead_arena and not set(dead_arena) & set(list_segments(PREFIX)), "the dead process's arena stayed"
        pipeline.submit(RequestSpec(request_id="after", prompt="speak again please", seed=7,
                                    modality=OutputModality.TEXT | OutputModality.AUDIO), sink_for("after"))
        col.wait(9, timeout=120)
        assert col.finish["after"] not in ("error",) and col.audio.get("after"), (col.finish, errors)
    finally:
        pipeline.stop()


def test_an_engine_refusal_crosses_the_process_unchanged():
    pipeline = start("omni", fake_factory="tests.fakes.stage_backends:RefusingFakeBackend")
    try:
        col = Collector()
        with pytest.raises(InvalidArgumentError) as info:
            submit(pipeline, col, 0, "text+audio", prompt=f"please {REFUSED_MARKER} now")
        assert info.value.field == "prompt" and "refuses" in str(info.value)
        assert pipeline.active_requests == 0, "a refused request stayed"
        assert not pipeline.stage_processes["thinker"].has_unfinished()
        submit(pipeline, col, 1, "text+audio")
        col.wait(1)
    finally:
        pipeline.stop()


class ErrorCollector(Collector):
    """Collector that also keeps the errors requests end with."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: dict[str, BaseException] = {}

    def sink_for(self, rid: str):
        inner = super().sink_for(rid)

        def sink(resp) -> None:
            if isinstance(resp, BaseException):
                with self.done:
                    self.errors[rid] = resp
                    self.finish[rid] = "error"
                    self.done.notify_all()
                return
            inner(resp)

        return sink


def test_a_refused_hand_over_fails_that_request_only():
    """The talker refuses a request the thinker hands over (without the
    routing waiting for the answer): that request ends with the talker's
    error, field and all; the others speak."""
    pipeline = start("omni", fake_factory="tests.fakes.stage_backends:RefusingFakeBackend")
    try:
        col = ErrorCollector()
        submit(pipeline, col, 0, "text+audio", prompt=f"please {TALKER_REFUSES_MARKER} now")
        for i in range(1, 4):
            submit(pipeline, col, i, "text+audio")
        col.wait(4)
        err = col.errors.get("r0")
        assert isinstance(err, InvalidArgumentError) and err.field == "prompt" and "talker refuses" in str(err), err
        assert all(col.finish[f"r{i}"] != "error" and col.audio.get(f"r{i}") for i in range(1, 4)), col.errors
        assert pipeline.active_requests == 0
    finally:
        pipeline.stop()


def steps_settle(stage: StageProcess, quiet_s: float = 1.0, timeout: float = 30.0) -> int:
    """Wait until the stage process's step count stops growing; return it."""
    deadline = time.monotonic() + timeout
    last, since = stage.steps, time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, "the stage process keeps stepping"
        time.sleep(0.1)
        if stage.steps != last:
            last, since = stage.steps, time.monotonic()
    return last


def test_aborted_and_failed_requests_stop_in_the_stage_process():
    """An abort, and a failed step, stop the requests in the stage's engine
    (not only in the decoder's books): its decode loop goes quiet."""
    pipeline = start("omni", in_process_builder=True, fake_factory="tests.fakes.stage_backends:SlowFakeBackend",
                     fake_kwargs={"step_s": 0.02})
    talker = pipeline.stage_processes["talker"]
    try:
        col = ErrorCollector()
        for i in range(4):
            submit(pipeline, col, i, "text+audio", prompt=f"a long request number {i} " + "word " * 40)
        wait_for(talker.has_unfinished, 60, "no request reached the talker")
        time.sleep(0.5)
        for i in range(4):
            pipeline.abort(f"r{i}")
        at_abort = talker.steps
        after = steps_settle(talker)  # a status or two late: a few steps more, not the hundreds left
        assert after - at_abort < 40, f"the talker's engine still ran aborted requests: {at_abort} -> {after}"
    finally:
        pipeline.stop()
    pipeline = start("omni", in_process_builder=True, fake_factory="tests.fakes.stage_backends:FailingStepFakeBackend",
                     fake_kwargs={"fail_step": 3, "step_s": 0.02})
    try:
        col = ErrorCollector()
        for i in range(4):
            submit(pipeline, col, i, "text")
        col.wait(4)
        assert col.errors and all("decode step failed" in str(e) for e in col.errors.values()), col.errors
        thinker = pipeline.stage_processes["thinker"]
        assert not thinker.has_unfinished()
        # the failed requests had ~20 steps left (20 ms each); the aborts reach
        # the engine within a step or two
        after = steps_settle(thinker)
        assert after < 8, f"the thinker's engine still ran failed requests: {after} steps"
        submit(pipeline, col, 9, "text")  # and it serves the next ones
        col.wait(5)
        assert col.finish["r9"] != "error" and col.text.get("r9")
    finally:
        pipeline.stop()


def test_a_stage_that_cannot_start_says_why_and_leaves_nothing():
    profile = load_profile("omni")
    specs = stage_specs(profile, engine="fake", shm_prefix=PREFIX,
                        fake_factory="tests.fakes.stage_backends:failing_fake_backend")
    before = set(p.pid for p in __import__("multiprocessing").active_children())
    with pytest.raises(UnavailableError, match="could not start: RuntimeError: this engine cannot be built"):
        launch_stages(specs, start_timeout_s=120)
    time.sleep(0.2)
    left = set(p.pid for p in __import__("multiprocessing").active_children()) - before
    assert not left, f"stage processes left running: {left}"


def test_stage_forward_passes_overlap():
    """With each stage in its own process (and on its own CPUs), the
    thinker's and the talker's forward passes run at the same time: the
    decoder's overlap metric, from the intervals the processes report, grows."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: nothing can run side by side")
    busy0, overlap0 = dict(BUSY.busy_s), BUSY.overlap_s
    pipeline = start("omni", fake_kwargs={"work_per_step": 512})
    try:
        col = Collector()
        for i in range(16):  # a stream of requests: the thinker answers new ones while the talker speaks
            submit(pipeline, col, i, "text+audio")
            time.sleep(0.1)
        col.wait(16, timeout=120)
        time.sleep(0.5)  # the last statuses
    finally:
        pipeline.stop()
    busy = {k: v - busy0.get(k, 0.0) for k, v in BUSY.busy_s.items()}
    overlap = BUSY.overlap_s - overlap0
    assert busy.get("thinker", 0) > 0 and busy.get("talker", 0) > 0, busy
    assert overlap > 0.1 * min(busy["thinker"], busy["talker"]), (overlap, busy)


def test_a_stage_process_is_not_used_before_it_is_ready():
    profile = load_profile("tts")
    (spec,) = stage_specs(profile, engine="fake", shm_prefix=PREFIX)
    stage = StageProcess(spec)
    with pytest.raises(UnavailableError, match="restarting"):
        stage.add_request(RequestSpec(request_id="x", prompt="hello"))
    assert not stage.has_unfinished()


@pytest.mark.parametrize("one_by_one", [False, True])
def test_stages_sharing_a_device_start_one_after_another(monkeypatch, one_by_one):
    """one_by_one (stages on one GPU): a stage process starts only once the
    one before is ready; otherwise they start side by side."""
    from decoder_svc.engine_settings import share_a_device
    from decoder_svc.stage import launch as launch_mod

    seen: list[tuple[str, list[bool]]] = []
    started: list = []
    real_launch = launch_mod.StageProcess.launch

    def launch(self):
        seen.append((self.spec.stage, [s.ready for s in started]))
        started.append(self)
        return real_launch(self)

    monkeypatch.setattr(launch_mod.StageProcess, "launch", launch)
    specs = stage_specs(load_profile("omni"), engine="fake", shm_prefix=PREFIX)
    stages = launch_stages(specs, start_timeout_s=120, one_by_one=one_by_one)
    try:
        assert [name for name, _ in seen] == ["thinker", "talker"]
        assert seen[1][1] == [one_by_one], seen
        assert all(s.ready for s in stages.values())
    finally:
        for s in stages.values():
            s.stop()
    assert share_a_device(["auto", "cuda"], "cuda") and share_a_device(["cuda:1", "cuda:1"], "cuda")
    assert not share_a_device(["cuda:0", "cuda:1"], "cuda") and not share_a_device(["auto", "auto"], "cpu")
