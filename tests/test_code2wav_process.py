"""code2wav in worker processes (decoder_svc.code2wav.pool): the same audio as
the in-thread worker, frames by arena slots, failure of one worker costs only
its requests, the caller never waits on a busy worker, nothing left in
/dev/shm. Real processes, real shared memory; the vocoders are the fake
engine's (a test double) unless named otherwise."""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import torch

from decoder_svc import metrics
from decoder_svc.code2wav.chunking import ChunkState
from decoder_svc.code2wav.core import PendingRequest, next_request
from decoder_svc.code2wav.pool import Code2WavProcessPool, _Worker
from decoder_svc.code2wav.thread import Code2WavWorker
from decoder_svc.profile import load_profile
from decoder_svc.testing.fake_engine import FakeVocoderFactory
from omni_common.shm_arena import list_segments
from tests.fakes.code2wav_vocoders import FakeGatedVocoderFactory

Q, V = 16, 2048
READY_S = 120.0  # a worker imports torch and builds its vocoder: slow on a loaded host


def gen_config():
    return load_profile("tts").stages[-1]


def fake_vocoder():
    return FakeVocoderFactory(num_codebooks=Q, codec_vocab=V, left_context=gen_config().codec_left_context_frames)


class Collector:
    """emit/on_error of a code2wav stage: chunks per request, in arrival order;
    `order`: (request, its chunk index, the queue gauge then) of every chunk."""

    def __init__(self) -> None:
        self.chunks: dict[str, list[tuple[bytes, bool, str]]] = {}
        self.order: list[tuple[str, int, float]] = []
        self.errors: dict[str, BaseException] = {}
        self.error_calls = 0
        self.cond = threading.Condition()

    def emit(self, rid: str, audio: np.ndarray, last: bool, reason: str) -> None:
        assert audio.dtype == np.float32
        with self.cond:
            self.order.append((rid, len(self.chunks.get(rid, ())), metrics.CODE2WAV_QUEUE_CHUNKS._value.get()))
            self.chunks.setdefault(rid, []).append((audio.tobytes(), last, reason))
            self.cond.notify_all()

    def on_error(self, rid: str, exc: BaseException) -> None:
        with self.cond:
            self.errors[rid] = exc
            self.error_calls += 1
            self.cond.notify_all()

    def ended(self, rid: str) -> bool:
        return rid in self.errors or any(last for _, last, _ in self.chunks.get(rid, ()))

    def wait(self, what, timeout: float = 60.0, why: str = "") -> None:
        with self.cond:
            assert self.cond.wait_for(what, timeout), f"timed out waiting: {why}"

    def audio(self, rid: str) -> np.ndarray:
        return np.frombuffer(b"".join(c for c, _, _ in self.chunks.get(rid, ())), dtype=np.float32)


def plan(seed: int, requests: dict[str, tuple[str, int]]) -> list[tuple]:
    """Interleaved frames()/finish() calls for requests {rid: (voice, frames)}:
    1-7 frames per call (ramps and chunk edges crossed at varied offsets),
    now and then an end-of-speech row, then finish."""
    rng = np.random.default_rng(seed)
    left = {rid: n for rid, (_, n) in requests.items()}
    calls = []
    while left:
        rid = list(left)[int(rng.integers(len(left)))]
        voice = requests[rid][0]
        n = int(min(left[rid], rng.integers(1, 8)))
        codes = rng.integers(0, V, size=(n, Q), dtype=np.int64)
        if rng.random() < 0.1:  # an end-of-speech row is no frame
            codes = np.concatenate([codes, np.full((1, Q), V + 1, dtype=np.int64)])
        calls.append(("frames", rid, voice, codes))
        left[rid] -= n
        if not left[rid]:
            del left[rid]
            calls.append(("finish", rid, voice, "stop" if rng.random() < 0.5 else "length"))
    return calls


def drive(stage, calls) -> None:
    for kind, rid, voice, value in calls:
        getattr(stage, kind)(rid, voice, value)


def thread_reference(calls, vocoder=None, config=None) -> tuple[dict, int]:
    col = Collector()
    worker = Code2WavWorker(config or gen_config(), col.emit, vocoder=vocoder or fake_vocoder(),
                            on_error=col.on_error)
    worker.start()
    try:
        drive(worker, calls)
        rids = {c[1] for c in calls}
        col.wait(lambda: all(col.ended(r) for r in rids), 120, "thread worker")
    finally:
        worker.stop()
    return col.chunks, worker.chunks


def in_order(calls, vocoder=None) -> dict:
    """The chunks of `calls` decoded at once, call by call (no scheduling):
    per request the same chunks, last flags and bytes any order must give."""
    voc = vocoder or fake_vocoder()
    cfg = gen_config()
    states: dict[str, ChunkState] = {}
    out: dict[str, list[tuple[bytes, bool, str]]] = {}
    for kind, rid, voice, value in calls:
        st = states.get(rid)
        if st is None:
            st = states[rid] = ChunkState(cfg.initial_chunk_ramp, cfg.codec_chunk_frames, voc.new_stream(voice), Q)
        final = kind == "finish"
        if not final:
            st.add(value[value[:, 0] < V])
        chunks = st.ready_chunks(final)
        for i, (start, end) in enumerate(chunks):
            last = final and i == len(chunks) - 1
            out.setdefault(rid, []).append((st.decode(start, end).tobytes(), last, value if last else ""))
        if final:
            if not chunks:
                out.setdefault(rid, []).append((b"", True, value))
            del states[rid]
    return out


def pool(col: Collector, prefix: str, config=None, **kw) -> Code2WavProcessPool:
    kw.setdefault("vocoder", fake_vocoder())
    return Code2WavProcessPool(config or gen_config(), col.emit, shm_prefix=prefix, on_error=col.on_error, **kw)


def ps_has(pid: int) -> bool:
    out = subprocess.run(["ps", "-o", "pid=", "-p", str(pid)], capture_output=True, text=True).stdout
    return out.strip() == str(pid)


@pytest.fixture
def prefix():
    name = f"omni-c2wtest{os.getpid()}-{time.monotonic_ns() % 10**9}"
    yield name
    assert list_segments(name) == [], "a code2wav arena segment was left behind"


REQUESTS = {
    "a": ("default", 3),  # inside the first ramp chunk
    "b": ("alloy", 40),
    "c": ("echo", 61),
    "d": ("nova", 15),  # exactly the ramp
    "e": ("shimmer", 0),  # finish without a frame
    "f": ("alloy", 27),
}


def test_worker_processes_give_the_thread_workers_audio_byte_for_byte(prefix):
    calls = plan(1, REQUESTS)
    want, want_chunks = thread_reference(calls)
    col = Collector()
    p = pool(col, prefix, workers=2)
    p.start()
    try:
        assert p.wait_ready(READY_S), "workers did not come up"
        pids = p.pids
        assert len(pids) == 2 and os.getpid() not in pids
        assert all(ps_has(pid) for pid in pids), pids
        drive(p, calls)
        col.wait(lambda: all(col.ended(r) for r in REQUESTS), 60, "pool")
        assert p.arena.in_use == 0, "slots not given back"
    finally:
        p.stop()
    assert not col.errors
    assert col.chunks == want  # same chunks, same order, same bytes, same endings
    assert want == in_order(calls)  # and both the chunks of decoding each call at once
    assert p.chunks == want_chunks
    assert p.inline_fallbacks == 0, "default slots hold a step's frames"
    # and what both produce is the vocoder's whole-sequence decode
    voc = fake_vocoder().vocoder
    for rid, (voice, _) in REQUESTS.items():
        frames = [c for k, r, _, c in calls if k == "frames" and r == rid]
        codes = np.concatenate(frames) if frames else np.zeros((0, Q), dtype=np.int64)
        codes = codes[codes[:, 0] < V]
        whole = voc.decode(codes, 0, voice) if len(codes) else np.zeros(0, np.float32)
        assert np.array_equal(col.audio(rid), whole), rid
    assert not any(ps_has(pid) for pid in pids), "workers still running after stop"


def test_frames_fall_back_to_bytes_when_no_slot_fits_or_is_free(prefix):
    calls = plan(2, {"x": ("fable", 30), "y": ("onyx", 22)})
    want, _ = thread_reference(calls)
    col = Collector()
    too_large = metrics.CODE2WAV_INLINE_FALLBACKS.labels("too_large")
    no_slot = metrics.CODE2WAV_INLINE_FALLBACKS.labels("no_slot")
    before = (too_large._value.get(), no_slot._value.get())
    # a slot holds one frame (16 x int64): calls with more go inline
    p = pool(col, prefix, workers=1, slots=4, slot_bytes=Q * 8, slot_wait_s=0.005)
    p.start()
    try:
        assert p.wait_ready(READY_S)
        held = [p.arena.acquire(0) for _ in range(4)]  # every slot taken
        t0 = time.monotonic()
        p.frames("z", "default", np.zeros((1, Q), dtype=np.int64))
        assert time.monotonic() - t0 < 1.0, "frames() waited for a slot"
        assert no_slot._value.get() == before[1] + 1
        for lease in held:
            p.arena.release(lease.slot, lease.generation)
        p.abort("z")
        drive(p, calls)
        col.wait(lambda: col.ended("x") and col.ended("y"), 60, "pool")
    finally:
        p.stop()
    multi = sum(1 for k, _, _, c in calls if k == "frames" and c.nbytes > Q * 8)
    assert multi and too_large._value.get() == before[0] + multi
    assert p.inline_fallbacks == multi + 1
    assert {r: col.chunks[r] for r in ("x", "y")} == want


def test_sigkill_of_a_worker_fails_only_its_requests_and_it_comes_back(prefix):
    col = Collector()
    restarts = metrics.CODE2WAV_RESTARTS._value.get()
    # as in the pipeline: a request that failed is no longer live
    p = pool(col, prefix, workers=2, live=lambda rid: rid not in col.errors)
    p.start()
    rng = np.random.default_rng(3)
    try:
        assert p.wait_ready(READY_S)
        first = rng.integers(0, V, size=(20, Q), dtype=np.int64)
        p.frames("on0", "default", first)  # pinned to worker 0 (least loaded, first)
        p.frames("on1", "alloy", first)  # pinned to worker 1
        col.wait(lambda: "on0" in col.chunks and "on1" in col.chunks, 60, "first chunks")
        victim = p._pins["on0"].worker.process.pid
        survivor = p._pins["on1"].worker.process.pid
        assert victim != survivor
        os.kill(victim, signal.SIGKILL)
        col.wait(lambda: "on0" in col.errors, 30, "the killed worker's request failed")
        assert "ended" in str(col.errors["on0"])
        p.abort("on0")  # what the pipeline does when it ends a request
        # the survivor's request goes on and completes
        rest = rng.integers(0, V, size=(17, Q), dtype=np.int64)
        p.frames("on1", "alloy", rest)
        p.finish("on1", "alloy", "stop")
        col.wait(lambda: col.ended("on1"), 60, "survivor")
        assert "on1" not in col.errors
        want, _ = thread_reference([("frames", "on1", "alloy", first), ("frames", "on1", "alloy", rest),
                                    ("finish", "on1", "alloy", "stop")])
        assert col.chunks["on1"] == want["on1"]
        # frames for the failed request after the failure start nothing
        p.frames("on0", "default", rest)
        # the worker is back (a new process) and serves a new request
        assert p.wait_ready(READY_S), "the killed worker was not restarted"
        pids = p.pids
        assert len(pids) == 2 and victim not in pids and survivor in pids
        assert not ps_has(victim)
        assert p.restarts == 1 and metrics.CODE2WAV_RESTARTS._value.get() == restarts + 1
        calls = [("frames", "new", "echo", first), ("finish", "new", "echo", "stop")]
        drive(p, calls)
        col.wait(lambda: col.ended("new"), 60, "a request after the restart")
        assert "new" not in col.errors
        assert col.chunks["new"] == thread_reference(calls)[0]["new"]
        assert p._pins.get("new") is None
        assert set(col.errors) == {"on0"}
        assert p.arena.in_use == 0, "the killed worker's slots were not reclaimed"
    finally:
        p.stop()
    assert not any(ps_has(pid) for pid in pids)


def test_a_vocoder_error_fails_only_that_request(prefix):
    from tests.fakes.code2wav_vocoders import FakeFailingVocoderFactory

    col = Collector()
    voc = FakeFailingVocoderFactory(fail_voice="fable", num_codebooks=Q, codec_vocab=V)
    p = pool(col, prefix, workers=1, vocoder=voc)
    p.start()
    try:
        assert p.wait_ready(READY_S)
        calls = plan(4, {"bad": ("fable", 20), "good": ("echo", 20)})
        drive(p, calls)
        col.wait(lambda: col.ended("bad") and col.ended("good"), 60, "both ended")
        pid = p.pids
    finally:
        p.stop()
    assert set(col.errors) == {"bad"} and "fake vocoder failure" in str(col.errors["bad"])
    assert col.error_calls == 1, "a failed request's later frames start nothing"
    assert col.chunks["good"] == thread_reference(calls)[0]["good"]
    assert p.restarts == 0 and len(pid) == 1
    assert "bad" not in col.chunks


def test_aborting_a_failed_request_clears_it_in_its_worker(prefix):
    """The worker drops a failed request's later items until the decoder
    aborts it; the abort reaches it, so it forgets the id (no growing set):
    the id used again is served."""
    from tests.fakes.code2wav_vocoders import FakeFailingVocoderFactory

    col = Collector()
    voc = FakeFailingVocoderFactory(fail_voice="fable", num_codebooks=Q, codec_vocab=V)
    p = pool(col, prefix, workers=1, vocoder=voc)
    p.start()
    rng = np.random.default_rng(9)
    again = [("frames", "bad", "echo", rng.integers(0, V, size=(12, Q), dtype=np.int64)),
             ("finish", "bad", "echo", "stop")]
    try:
        assert p.wait_ready(READY_S)
        p.frames("bad", "fable", rng.integers(0, V, size=(8, Q), dtype=np.int64))
        col.wait(lambda: "bad" in col.errors, 60, "the request failed in its worker")
        p.abort("bad")  # what the pipeline does when it ends a request
        drive(p, again)
        # its error stays recorded (ended() is true already): wait for its last chunk
        col.wait(lambda: any(last for _, last, _ in col.chunks.get("bad", ())), 60, "the id used again")
    finally:
        p.stop()
    assert col.error_calls == 1
    assert col.chunks["bad"] == thread_reference(again)[0]["bad"]


def test_frames_return_at_once_while_the_worker_is_stopped(prefix):
    """SIGSTOP: the worker reads nothing; its pipe fills, its slots stay held.
    The AR stage's calls still return at once; after SIGCONT the audio is whole."""
    calls = plan(5, {f"s{i}": ("default", 300) for i in range(8)})
    col = Collector()
    p = pool(col, prefix, workers=1, slots=32)
    p.start()
    try:
        assert p.wait_ready(READY_S)
        (pid,) = p.pids
        os.kill(pid, signal.SIGSTOP)
        try:
            worst = 0.0
            for kind, rid, voice, value in calls:
                t0 = time.perf_counter()
                getattr(p, kind)(rid, voice, value)
                worst = max(worst, time.perf_counter() - t0)
            assert p.arena.in_use == 32, "the stopped worker should hold every slot"
            assert p.inline_fallbacks > 0
        finally:
            os.kill(pid, signal.SIGCONT)
        print(f"slowest frames()/finish() with the worker stopped: {worst * 1e3:.1f} ms over {len(calls)} calls")
        assert worst < 0.25, f"a call waited {worst:.3f}s on a stopped worker"
        col.wait(lambda: all(col.ended(f"s{i}") for i in range(8)), 120, "after SIGCONT")
    finally:
        p.stop()
    assert not col.errors
    assert col.chunks == thread_reference(calls)[0]


def test_a_restart_that_cannot_start_fails_its_requests_and_is_tried_again(prefix):
    """The worker dies and its restart cannot spawn (no file descriptors): the
    request pinned to the restart meanwhile fails (never waits forever), its
    slot and pipe ends come back, and the next try serves new requests."""
    col = Collector()
    p = pool(col, prefix, workers=1, live=lambda rid: rid not in col.errors)
    codes = np.random.default_rng(10).integers(0, V, size=(12, Q), dtype=np.int64)
    p.start()
    try:
        assert p.wait_ready(READY_S)
        ctx, pipes, tries = p._ctx, [], []

        class FailingOnce:
            """The pool's process context, except that the first process
            started fails to start."""

            def Pipe(self, duplex):
                ends = ctx.Pipe(duplex=duplex)
                pipes.extend(ends)
                return ends

            def Process(self, **kwargs):
                proc = ctx.Process(**kwargs)
                tries.append(proc)
                if len(tries) == 1:
                    def start():
                        p.frames("early", "default", codes)  # arrives while the restart is under way
                        raise OSError(errno.EMFILE, "Too many open files")

                    proc.start = start
                return proc

        p._ctx = FailingOnce()
        (victim,) = p.pids
        os.kill(victim, signal.SIGKILL)
        col.wait(lambda: "early" in col.errors, 60, "the request of the failed restart failed")
        assert "could not be started" in str(col.errors["early"])
        assert len(pipes) >= 4 and all(end.closed for end in pipes[:4]), "the failed try's pipe ends are open"
        p.abort("early")
        calls = [("frames", "new", "echo", codes), ("finish", "new", "echo", "stop")]
        drive(p, calls)
        col.wait(lambda: col.ended("new"), 120, "a request after the failed restart")
        assert "new" not in col.errors
        assert col.chunks["new"] == thread_reference(calls)[0]["new"]
        assert len(tries) == 2 and p.wait_ready(READY_S)
        assert len(p.pids) == 1 and victim not in p.pids
        assert p.arena.in_use == 0, "the failed try's slot was not reclaimed"
    finally:
        p.stop()
    assert set(col.errors) == {"early"}


def test_a_new_request_goes_to_a_ready_worker_before_an_idle_starting_one():
    """A restarted worker has no load but may be seconds away from its
    vocoder: new requests go to the least-loaded ready worker; only when none
    is ready, to the least-loaded one."""
    p = Code2WavProcessPool(gen_config(), lambda *a: None, vocoder=fake_vocoder(), shm_prefix="omni-c2wunused",
                            workers=2)
    up, starting = _Worker(0, 0, load=3), _Worker(1, 1)
    up.ready.set()
    p._workers = [up, starting]
    assert p._route("a") is up and p._route("b") is up
    assert (up.load, starting.load) == (5, 0)
    starting.ready.set()
    assert p._route("c") is starting
    up.ready.clear()
    starting.ready.clear()
    assert p._route("d") is starting  # none ready: the least loaded
    assert p._route("a") is up  # pinned stays pinned


def test_frames_racing_stop_never_write_into_the_closed_arena(prefix):
    """stop() unmaps the arena; a frames() call between taking a slot and
    writing it finishes first (stop waits for it), and frames() after stop()
    drops its frames without touching the arena."""
    col = Collector()
    p = pool(col, prefix, workers=1)
    codes = np.random.default_rng(11).integers(0, V, size=(2, Q), dtype=np.int64)
    p.start()
    stopper = threading.Thread(target=p.stop)
    try:
        assert p.wait_ready(READY_S)
        p.frames("s", "default", codes)  # pinned
        arena = p.arena
        acquire, close = arena.acquire, arena.close
        stopping = threading.Event()  # stop() waits for the write, or has closed the arena
        closed_at_write = []

        class Observed(threading.Condition):
            def wait_for(self, predicate, timeout=None):
                if not predicate():
                    stopping.set()
                return super().wait_for(predicate, timeout)

        def closing():
            stopping.set()
            close()

        def acquire_then_stop(timeout=None):
            lease = acquire(timeout)
            stopper.start()
            assert stopping.wait(60), "stop() neither waited for the write nor closed the arena"
            closed_at_write.append(arena.closed)
            if arena.closed:  # the write would be a memmove into unmapped memory
                raise RuntimeError("arena closed under a write")
            return lease

        p._staged = Observed(p._lock)
        arena.close = closing
        arena.acquire = acquire_then_stop
        p.frames("s", "default", codes)
        stopper.join(60)
        assert not stopper.is_alive()
    finally:
        if stopper.is_alive():
            stopper.join(60)
        p.stop()
    assert closed_at_write == [False], "stop() closed the arena under a write"
    assert arena.closed and arena.in_use == 0

    def refuse(timeout=None):
        raise AssertionError("frames() after stop() used the arena")

    arena.acquire = refuse
    fallbacks = p.inline_fallbacks
    p.frames("s", "default", codes)
    p.frames("t", "default", codes)
    p.finish("s", "default", "stop")
    p.abort("s")
    assert p.inline_fallbacks == fallbacks and not col.errors and not p.pids


def test_stop_kills_a_worker_that_does_not_stop_and_leaves_no_segment(prefix):
    col = Collector()
    p = pool(col, prefix, workers=2, stop_timeout_s=0.5)
    p.start()
    assert p.wait_ready(READY_S)
    pids = p.pids
    assert len(list_segments(prefix)) == 1
    os.kill(pids[0], signal.SIGSTOP)  # cannot read its stop message
    t0 = time.monotonic()
    p.stop()
    assert time.monotonic() - t0 < 5.0
    assert not any(ps_has(pid) for pid in pids)
    assert list_segments(prefix) == []


def run_pipeline(prefix: str, code2wav_workers: int, n: int = 6) -> tuple[dict, list[int]]:
    """A tts batch through the whole pipeline (fake engine, in-process builder)."""
    from decoder_svc.backend import RequestSpec
    from decoder_svc.pipeline import Pipeline
    from decoder_svc.testing.fake_engine import FakeBackend, fake_vocoder
    from omni_common.materialize import payload_tensors
    from omni_common.modality import OutputModality

    profile = load_profile("tts")
    pipeline = Pipeline(profile, {s.name: FakeBackend(role=s.engine_role) for s in profile.ar_stages},
                        vocoder=fake_vocoder(profile), materializer_target=None, shm_prefix=prefix, arena=None,
                        code2wav_workers=code2wav_workers)
    audio: dict[str, list[bytes]] = {}
    finish: dict[str, str] = {}
    cond = threading.Condition()

    def sink_for(rid):
        def sink(resp):
            assert not isinstance(resp, Exception), resp
            if resp.multimodal_output.tensors:
                audio.setdefault(rid, []).append(payload_tensors(resp.multimodal_output)["audio"].numpy().tobytes())
            if resp.finished:
                with cond:
                    finish[rid] = resp.finish_reason
                    cond.notify_all()
        return sink

    pipeline.start()
    try:
        assert code2wav_workers == 0 or pipeline.code2wav.wait_ready(READY_S)
        pids = list(pipeline.code2wav.pids)
        for i in range(n):
            pipeline.submit(RequestSpec(request_id=f"r{i}", prompt=f"request {i} says hello", seed=7 + i,
                                        voice=("default", "alloy", "echo")[i % 3],
                                        modality=OutputModality.from_string("audio")), sink_for(f"r{i}"))
        with cond:
            assert cond.wait_for(lambda: len(finish) == n, 120), finish
    finally:
        pipeline.stop()
    return {rid: (b"".join(audio.get(rid, [])), finish[rid]) for rid in finish}, pids


def test_the_pipeline_speaks_the_same_with_worker_processes(prefix):
    want, none = run_pipeline(prefix, 0)
    got, pids = run_pipeline(prefix, 2)
    assert none == [] and len(pids) == 2
    assert all(len(a) > 0 for a, _ in want.values())
    assert got == want


@pytest.mark.parametrize("threads", [1, 0], ids=["one_thread", "parents_threads"])
def test_neural_code2wav_in_a_worker_gives_the_engines_audio_byte_for_byte(prefix, tiny_checkpoint, threads):
    """The checkpoint's Code2Wav, rebuilt in the worker from the directory
    alone, against the engine's vocoder on the decoder's thread, both with
    the same intra-op thread count (1: the workers' default; or the
    parent's): a different count may round differently in the last bits."""
    pytest.importorskip("vllm")
    from decoder_svc.qwen3_omni.checkpoint import OmniCheckpoint
    from decoder_svc.qwen3_omni.engine import NeuralVocoder
    from decoder_svc.qwen3_omni.vocoder import worker_spec

    ckpt = OmniCheckpoint.open(tiny_checkpoint)
    engine_vocoder = NeuralVocoder(str(ckpt.path), ("ethan", "chelsie"), checkpoint=ckpt)
    stamp = sorted((f.name, f.stat().st_mtime_ns) for f in tiny_checkpoint.iterdir())
    rng = np.random.default_rng(6)
    q, v = engine_vocoder.num_codebooks, engine_vocoder.codebook_size
    calls = []
    for rid, n in (("n0", 9), ("n1", 33)):
        codes = rng.integers(0, v, size=(n, q), dtype=np.int64)
        calls += [("frames", rid, "ethan", codes[:4]), ("frames", rid, "ethan", codes[4:])]
    calls.insert(2, ("frames", "n2", "chelsie", rng.integers(0, v, size=(16, q), dtype=np.int64)))
    calls += [("finish", r, "ethan", "stop") for r in ("n0", "n1", "n2")]
    parents = torch.get_num_threads()
    threads = threads or parents
    torch.set_num_threads(threads)
    try:
        want, _ = thread_reference(calls, engine_vocoder)
    finally:
        torch.set_num_threads(parents)
    col = Collector()
    p = pool(col, prefix, workers=2, vocoder=engine_vocoder, torch_threads=threads,
             spec=worker_spec(tiny_checkpoint, engine_vocoder.voices))
    p.start()
    try:
        assert p.wait_ready(READY_S)
        drive(p, calls)
        col.wait(lambda: all(col.ended(r) for r in ("n0", "n1", "n2")), 120, "neural pool")
    finally:
        p.stop()
    assert not col.errors
    assert all(col.audio(r).size for r in ("n0", "n1", "n2"))
    assert col.chunks == want
    assert sorted((f.name, f.stat().st_mtime_ns) for f in tiny_checkpoint.iterdir()) == stamp, "checkpoint written"


def _batch_calls() -> float:
    return sum(s.value for m in metrics.CODE2WAV_BATCH_CHUNKS.collect() for s in m.samples
               if s.name.endswith("_count"))


def _batched_in_thread(calls, vocoder, config) -> tuple[dict, float]:
    """The chunks of `calls` on the decoder's thread, and the vocoder calls
    made: all queued before the loop starts, so its first turns batch them."""
    col = Collector()
    worker = Code2WavWorker(config, col.emit, vocoder=vocoder, on_error=col.on_error)
    drive(worker, calls)
    before = _batch_calls()
    worker.start()
    try:
        rids = {c[1] for c in calls}
        col.wait(lambda: all(col.ended(r) for r in rids), 120, "batched thread")
    finally:
        worker.stop()
    assert not col.errors
    return col.chunks, _batch_calls() - before


def test_neural_code2wav_batched_across_requests_matches_one_at_a_time(prefix, tiny_checkpoint):
    """code2wav_max_batch 4: the requests' ready chunks go through the
    checkpoint's Code2Wav together (one forward), on the decoder's thread and
    in a worker process. Every request gets the same chunks (boundaries, last,
    reason) as decoded one at a time, its PCM within 1e-4 (the batch changes
    the kernels' shapes, so the last bits may differ: docs/decoder.md)."""
    pytest.importorskip("vllm")
    from decoder_svc.qwen3_omni.checkpoint import OmniCheckpoint
    from decoder_svc.qwen3_omni.engine import NeuralVocoder
    from decoder_svc.qwen3_omni.vocoder import worker_spec

    ckpt = OmniCheckpoint.open(tiny_checkpoint)
    vocoder = NeuralVocoder(str(ckpt.path), ("ethan",), checkpoint=ckpt)
    rng = np.random.default_rng(8)
    q, v = vocoder.num_codebooks, vocoder.codebook_size
    calls = []
    for i, n in enumerate((9, 33, 16, 40)):
        codes = rng.integers(0, v, size=(n, q), dtype=np.int64)
        calls += [("frames", f"b{i}", "ethan", codes[:5]), ("frames", f"b{i}", "ethan", codes[5:])]
    calls += [("finish", f"b{i}", "ethan", "stop") for i in range(4)]
    batched = dataclasses.replace(gen_config(), code2wav_max_batch=4)
    parents = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the worker process
    try:
        want, _ = thread_reference(calls, vocoder)
        got = _batched_in_thread(calls, vocoder, batched)
    finally:
        torch.set_num_threads(parents)

    def check(got: dict, where: str) -> None:
        assert sorted(got) == sorted(want), where
        for rid, chunks in want.items():
            assert [(len(a), last, why) for a, last, why in got[rid]] == [
                (len(a), last, why) for a, last, why in chunks
            ], (where, rid)
            a = np.frombuffer(b"".join(c[0] for c in got[rid]), np.float32)
            b = np.frombuffer(b"".join(c[0] for c in chunks), np.float32)
            assert np.abs(a - b).max() <= 1e-4, (where, rid, float(np.abs(a - b).max()))

    chunks, calls_made = got
    check(chunks, "thread")
    n = sum(len(c) for c in want.values())
    assert 0 < calls_made < n, f"{calls_made} vocoder calls for {n} chunks: nothing batched"

    col = Collector()
    p = pool(col, prefix, config=batched, workers=1, vocoder=vocoder, torch_threads=1,
             spec=worker_spec(tiny_checkpoint, vocoder.voices))
    p.start()
    try:
        assert p.wait_ready(READY_S)
        drive(p, calls)
        col.wait(lambda: all(col.ended(f"b{i}") for i in range(4)), 120, "batched pool")
    finally:
        p.stop()
    assert not col.errors
    check(col.chunks, "worker process")


def _children(pid: int) -> set[int]:
    """The decoder's code2wav workers (spawned children; not the stdlib's resource tracker)."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line}


def _speak_at_decoder(target: str, rid: str) -> tuple[bytes, str]:
    import grpc

    from omni_common.materialize import payload_tensors
    from omni_serving.v1 import common_pb2, decoder_pb2, decoder_pb2_grpc, payload_pb2

    req = decoder_pb2.GenerateRequest(request_id=rid, prompt="the workers speak for the decoder", voice="echo",
                                      sampling_params=common_pb2.SamplingParams(seed=11),
                                      output_modalities=[payload_pb2.OUTPUT_MODALITY_AUDIO])
    audio, reason = [], ""
    with grpc.insecure_channel(target) as ch:
        for resp in decoder_pb2_grpc.DecoderServiceStub(ch).Generate(req, timeout=120):
            if resp.multimodal_output.tensors:
                audio.append(payload_tensors(resp.multimodal_output)["audio"].numpy().tobytes())
            if resp.finished:
                reason = resp.finish_reason
    return b"".join(audio), reason


@pytest.mark.e2e
def test_decoder_with_code2wav_workers_survives_a_killed_worker_and_stops_clean(tmp_path):
    import sys

    from omni_common.server import wait_for_health_sync

    deployment = f"c2we2e{os.getpid()}"
    target = f"unix://{tmp_path / 'd.sock'}"
    log = (tmp_path / "decoder.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "decoder_svc", "--listen", target, "--engine", "fake", "--profile", "tts",
         "--deployment", deployment, "--in-process-builder", "--code2wav-workers", "2", "--log-level", "INFO"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        wait_for_health_sync(target, 120)
        first, reason = _speak_at_decoder(target, "e1")
        assert first and reason, "no audio"
        workers = _children(proc.pid)
        assert len(workers) == 2, f"code2wav workers of the decoder: {workers}"
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline and len(_children(proc.pid) - {victim}) < 2:
            time.sleep(0.2)
        now = _children(proc.pid)
        assert len(now) == 2 and victim not in now, f"not restarted: {now}"
        again, reason2 = _speak_at_decoder(target, "e2")
        assert (again, reason2) == (first, reason), "audio differs after the restart"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not any(ps_has(pid) for pid in now), "workers outlived the decoder"
        assert list_segments(f"omni-{deployment}") == []
        assert b"code2wav worker 0" in (tmp_path / "decoder.log").read_bytes() or b"code2wav worker 1" in (
            tmp_path / "decoder.log").read_bytes()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()


def wait_until(what, timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, f"timed out waiting: {why}"
        time.sleep(0.01)


def first_waits() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("omni_decoder_code2wav_first_chunk_wait_seconds_count") or 0.0


def gated_stage(where: str, prefix: str, tmp_path, **pool_kw):  # noqa: ANN001, ANN201
    """A code2wav stage (a thread worker, or a pool of one worker process) on
    the gated fake vocoder: a chunk of the voice "fable" holds the worker
    until the file `gate` exists (it creates `entered` first). Returns
    (stage, collector, gate, entered); not started."""
    gate, entered = tmp_path / "gate", tmp_path / "entered"
    voc = FakeGatedVocoderFactory(str(gate), str(entered), num_codebooks=Q, codec_vocab=V,
                                  left_context=gen_config().codec_left_context_frames)
    col = Collector()
    if where == "thread":
        return Code2WavWorker(gen_config(), col.emit, vocoder=voc, on_error=col.on_error), col, gate, entered
    return pool(col, prefix, workers=1, vocoder=voc, **pool_kw), col, gate, entered


@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_new_requests_first_chunk_goes_before_the_queued_later_chunks_of_others(prefix, tmp_path, where):
    """The worker is busy (a gated chunk); meanwhile later chunks of running
    requests queue up, then a new request's first frames arrive and a running
    request is aborted. Once the worker is free, the new request's first chunk
    goes first (in arrival order it would be last), the aborted request's
    queued chunks never; each request's audio is the in-order decode's."""
    stage, col, gate, entered = gated_stage(where, prefix, tmp_path)
    rng = np.random.default_rng(8)
    calls = []

    def call(kind, rid, voice, value):
        if not isinstance(value, str):
            value = rng.integers(0, V, size=(value, Q), dtype=np.int64)
        calls.append((kind, rid, voice, value))
        getattr(stage, kind)(rid, voice, value)

    gauge, waits = metrics.CODE2WAV_QUEUE_CHUNKS._value.get(), first_waits()
    running = ("r0", "r1", "r2", "r3")
    stage.start()
    try:
        assert where == "thread" or stage.wait_ready(READY_S), "worker did not come up"
        for rid in running:
            call("frames", rid, "default", 5)  # the first ramp chunk
        col.wait(lambda: all(rid in col.chunks for rid in running), 60, "first chunks of the running requests")
        call("frames", "busy", "fable", 5)
        wait_until(entered.exists, 60, "the worker is in the gated chunk")
        for rid in running:  # their second and third chunks
            call("frames", rid, "default", 10)
            call("frames", rid, "default", 25)
        call("frames", "new", "echo", 5)
        stage.abort("r3")
        if where == "process":  # every frame is in the worker (its slot came back)
            wait_until(lambda: stage.arena.in_use == 0, 60, "the worker took the frames")
            assert stage.inline_fallbacks == 0
        gate.touch()
        for rid, voice in (("r0", "default"), ("r1", "default"), ("r2", "default"), ("busy", "fable"),
                           ("new", "echo")):
            call("finish", rid, voice, "stop")
        col.wait(lambda: all(col.ended(r) for r in ("r0", "r1", "r2", "busy", "new")), 60, "all ended")
    finally:
        stage.stop()
    assert not col.errors
    order = [(rid, i) for rid, i, _ in col.order]
    after = order[order.index(("busy", 0)) + 1:]
    assert after[0] == ("new", 0), f"not the new request's first chunk first: {after}"
    assert all(("r" + str(i), 1) in after for i in range(3))
    # the queued later chunks were there when it went: the gauge counted them
    assert col.order[order.index(("new", 0))][2] >= gauge + 6
    assert len(col.chunks["r3"]) == 1, "an aborted request's queued chunks were decoded"
    want = in_order([c for c in calls if c[1] != "r3"])
    assert {r: c for r, c in col.chunks.items() if r != "r3"} == want
    assert col.chunks["r3"] == in_order([c for c in calls if c[1] == "r3"])["r3"][:1]
    assert metrics.CODE2WAV_QUEUE_CHUNKS._value.get() == gauge
    assert first_waits() == waits + 6  # r0-r3, busy, new


def test_after_first_chunks_the_request_closest_to_running_dry_goes_next():
    """next_request: a first chunk before all else (the oldest first), then
    the least slack (audio emitted - seconds since the first audio), then age."""

    def req(seq, ready=1, audio_s=0.0, first_audio_at=None):
        r = PendingRequest(f"q{seq}", seq, state=None, audio_s=audio_s, first_audio_at=first_audio_at)
        r.ready.extend([(0, 1, False, "", 0.0)] * ready)
        return r

    old = req(0, audio_s=6.0, first_audio_at=100.0)  # 6 s emitted since 100: at 103, 3 s buffered
    young = req(1, audio_s=2.0, first_audio_at=102.0)  # at 103, 1 s buffered
    assert next_request([old, young], now=103.0) is young
    assert young.slack(103.0) == 1.0 and old.slack(103.0) == 3.0
    # ran dry: negative slack, still the least
    assert next_request([old, young], now=110.0) is young
    # equal slack: the older request
    even = req(2, audio_s=5.0, first_audio_at=101.0)
    assert even.slack(103.0) == old.slack(103.0)
    assert next_request([even, old], now=103.0) is old
    # nothing ready: not a candidate, however dry
    dry_idle = req(4, ready=0, audio_s=0.1, first_audio_at=100.0)
    assert next_request([old, dry_idle], now=103.0) is old
    # a first chunk (no audio yet) goes before the driest; the oldest first chunk first
    newest, newer = req(9), req(8)
    assert next_request([old, young, newest], now=103.0) is newest
    assert next_request([newest, young, newer], now=103.0) is newer
    assert next_request([dry_idle], now=103.0) is None


@pytest.mark.parametrize("where", ["thread", "process"])
def test_stop_drops_the_queued_chunks_and_ends_after_the_one_being_decoded(prefix, tmp_path, where):
    """Stop while the worker is busy (a gated chunk) with chunks of other
    requests queued behind it: once the gated chunk is done the worker ends,
    without decoding the queued ones (the decoder's stop ends their requests
    with "shutdown": their audio would go nowhere). A worker process exits by
    itself (exit code 0), not killed at the stop timeout."""
    stage, col, gate, entered = gated_stage(where, prefix, tmp_path, stop_timeout_s=60.0)
    stage.start()
    rng = np.random.default_rng(11)
    try:
        if where == "process":
            assert stage.wait_ready(READY_S), "the worker did not come up"
        stage.frames("gated", "fable", rng.integers(0, V, size=(8, Q), dtype=np.int64))
        deadline = time.monotonic() + 60
        while not entered.exists():
            assert time.monotonic() < deadline, "the gated chunk never started"
            time.sleep(0.01)
        queued = [f"q{i}" for i in range(12)]
        for rid in queued:
            stage.frames(rid, "echo", rng.integers(0, V, size=(8, Q), dtype=np.int64))
            stage.finish(rid, "echo", "stop")
        time.sleep(0.2)  # the queued chunks have reached the worker (the process's receive thread)
    finally:
        stopper = threading.Thread(target=stage.stop)
        stopper.start()
        time.sleep(0.2)
        gate.touch()  # the chunk being decoded finishes; the stop goes on
        stopper.join(60)
        assert not stopper.is_alive(), "stop did not return"
    assert not any(rid in col.chunks for rid in queued), "queued chunks were decoded after the stop"
    if where == "process":
        assert all(w.process.exitcode == 0 for w in stage._workers), [w.process.exitcode for w in stage._workers]
