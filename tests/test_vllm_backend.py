"""VLLMBackend on the real (CPU) vLLM engine, with tiny random-weight models.

Run with `.venv/bin/python -m pytest -m vllm tests/test_vllm_backend.py`
(needs the `cpu` or `cuda` extra; skipped where vllm is not installed).
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from collections import defaultdict

import pytest

if importlib.util.find_spec("vllm") is None:  # cheap check; the import itself happens in the fixture
    pytest.skip("vllm is not installed", allow_module_level=True)

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from decoder_svc.backend import RequestSpec  # noqa: E402
from decoder_svc.pipeline import Pipeline  # noqa: E402
from decoder_svc.profile import load_profile  # noqa: E402
from decoder_svc.testing.fake_engine import fake_vocoder  # noqa: E402

STANDIN_OMNI = os.path.join(os.path.dirname(__file__), "fakes", "standin_omni.yaml")
from omni_common.errors import OmniError  # noqa: E402
from omni_common.materialize import (  # noqa: E402
    PER_REQUEST,
    PER_TOKEN,
    build_step,
    payload_tensors,
    view_from_tensors,
)
from omni_common.modality import OutputModality  # noqa: E402
from omni_common.shm_arena import ShmArena  # noqa: E402

PROMPTS = [
    "Hello world! This is",
    "The quick brown fox",
    "Once upon a time there was",
    "Numbers: 0 1 2 3",
    "How are you today?",
    "The engine schedules requests",
    "She sells sea shells",
    "Good morning, good afternoon",
    "Speech synthesis converts written text",
    "Please read the following sentence aloud",
]
# Extra talker stop ids (a stand-in for a codec end-of-speech token): with
# these seeds some requests stop early and others run to max_tokens.
TALKER_STOP_IDS = list(range(300, 316))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("vllm")
    from decoder_svc.testing.standin_profiles import create_profile_models

    root = tmp_path_factory.mktemp("vllm-models")
    dirs = create_profile_models(load_profile(STANDIN_OMNI), root)
    assert set(dirs) == {"thinker", "talker"}
    # idempotent: a second call keeps the files
    mtimes = {n: (d / "model.safetensors").stat().st_mtime_ns for n, d in dirs.items()}
    assert create_profile_models(load_profile(STANDIN_OMNI), root) == dirs
    assert {n: (d / "model.safetensors").stat().st_mtime_ns for n, d in dirs.items()} == mtimes
    return root


def record_engine_tokens(backend) -> dict[str, list[int]]:
    """Token ids as the engine reports them (RequestOutput, DELTA kind)."""
    reported: dict[str, list[int]] = defaultdict(list)
    orig = backend.engine.step

    def step():
        outs = orig()
        for o in outs:
            reported[o.request_id].extend(o.outputs[0].token_ids)
        return outs

    backend.engine.step = step
    return reported


def drive(backend, timeout_s: float = 30.0) -> list:
    """Step the backend in this thread until nothing is unfinished."""
    outs = []
    deadline = time.monotonic() + timeout_s
    while backend.has_unfinished():
        assert time.monotonic() < deadline, "backend did not finish in time"
        out = backend.step()
        if out is not None:
            outs.append(out)
    return outs


def check_step_invariants(out, hidden_size: int | None) -> None:
    n = len(out.request_ids)
    assert len(out.batch_indices) == n == len(out.num_scheduled_tokens)
    assert out.query_start_loc.dtype == torch.int32 and out.query_start_loc.shape == (n + 1,)
    assert out.query_start_loc.diff().tolist() == out.num_scheduled_tokens
    assert out.sampled_token_ids.dtype == torch.int64 and out.sampled_token_ids.shape == (n, 1)
    assert bool((out.sampled_token_ids >= 0).all())
    assert set(out.finished) <= set(out.request_ids)
    if hidden_size is not None:
        assert out.hidden_states is not None and out.hidden_states.dtype == torch.float32
        assert out.hidden_states.shape == (int(out.query_start_loc[-1]), hidden_size)


@pytest.mark.vllm
def test_hidden_capture_prefix_cache_and_embedding(models, monkeypatch):
    """argmax(hidden @ lm_head.T) == sampled token for greedy rows (async
    scheduling forced on, as a CUDA host runs it: a step's rows outlive the
    next forward; prefix caching on); spans describe exactly the rows present
    when cached prompt tokens have none; embed() == normalised last hidden."""
    from decoder_svc.testing.standin_backend import StandinBackend
    from decoder_svc.testing.standin_models import CORPUS
    from decoder_svc.vllm_engine import engine_factory as rh

    monkeypatch.setenv(rh.FORCE_ASYNC_ENV, "1")
    b = StandinBackend(models / "thinker", capture_hidden=True, enable_prefix_caching=True,
                    async_scheduling=True, max_num_seqs=16)
    try:
        facts = b.engine_facts()
        assert facts["async_scheduling"] is True and facts["enable_prefix_caching"] is True
        assert facts["speculative_decoding"] is False and facts["async_output_eligible"] is True
        reported = record_engine_tokens(b)
        lm_head = rh.get_lm_head_weight(b.engine).detach().float()
        greedy = {f"g{i}" for i in range(4)}
        for i in range(8):
            rid = f"g{i}" if i < 4 else f"s{i}"
            b.add_request(RequestSpec(request_id=rid, prompt=PROMPTS[i], max_tokens=16,
                                      temperature=0.0 if i < 4 else 0.9, top_p=0.95, seed=1000 + i))
        outs = drive(b)
        tokens: dict[str, list[int]] = defaultdict(list)
        finished: dict[str, str] = {}
        checked = 0
        for out in outs:
            check_step_invariants(out, b.hidden_size)
            last = out.hidden_states[out.query_start_loc[1:].long() - 1]
            pred = (last @ lm_head.T).argmax(-1)
            is_greedy = torch.tensor([r in greedy for r in out.request_ids], dtype=torch.bool)
            assert torch.equal(pred[is_greedy], out.sampled_token_ids[is_greedy, 0])
            checked += int(is_greedy.sum())
            assert set(out.text_deltas) == set(out.request_ids)
            for rid, tok in zip(out.request_ids, out.sampled_token_ids[:, 0].tolist(), strict=True):
                tokens[rid].append(tok)
                assert out.new_token_ids[rid] == [tok]
            for rid in out.finished:
                assert rid not in finished, "finished twice"
            finished.update(out.finished)
        assert checked >= 4 * 10
        assert set(finished) == greedy | {f"s{i}" for i in range(4, 8)}
        assert set(finished.values()) <= {"length", "stop"}
        assert dict(tokens) == dict(reported)
        assert any(any(out.text_deltas.values()) for out in outs)

        # Prefix caching: the same long prompt twice; the second prefill
        # schedules only the uncached tail (no hidden rows for cached tokens).
        long_prompt = " ".join(CORPUS[:8])  # ~220 tokens > one 128-token block
        first_rows = {}
        first_out = {}
        for rid in ("pc0", "pc1"):
            b.add_request(RequestSpec(request_id=rid, prompt=long_prompt, max_tokens=2, temperature=0.0))
            o = drive(b)
            for out in o:
                check_step_invariants(out, b.hidden_size)
            first = next(out for out in o if rid in out.request_ids)
            i = first.request_ids.index(rid)
            first_rows[rid] = first.num_scheduled_tokens[i]
            first_out[rid] = first
            last = first.hidden_states[int(first.query_start_loc[i + 1]) - 1]
            assert int((last @ lm_head.T).argmax()) == int(first.sampled_token_ids[i, 0])
        prompt_len = len(b.tokenizer(long_prompt, add_special_tokens=False)["input_ids"])
        assert first_rows["pc0"] == prompt_len
        assert first_rows["pc1"] < prompt_len
        # the snapshot (taken with that step's request list) slices exactly those rows
        plan = load_profile(STANDIN_OMNI).stage("thinker").plan()
        out = first_out["pc1"]
        view = view_from_tensors(
            step_id=1, stage_id=0, request_ids=out.request_ids, spans=out.spans,
            num_sampled_tokens=[1] * len(out.request_ids), finished_request_ids=list(out.finished),
            downstream_request_ids=list(out.request_ids),
            tensors={"hidden_states": (out.hidden_states, PER_TOKEN),
                     "sampled_token_ids": (out.sampled_token_ids, PER_REQUEST)})
        built = build_step(view, plan)
        req = next(r for r in built.requests if r.request_id == "pc1")
        payload = payload_tensors(req.inter_stage)
        assert tuple(payload["thinker_hidden"].shape) == (first_rows["pc1"], b.hidden_size)
        assert payload["thinker_token_ids"].tolist() == [int(out.sampled_token_ids[out.request_ids.index("pc1"), 0])]

        # Pooling: last-token, L2-normalised hidden state of the prompt.
        emb = b.embed(RequestSpec(request_id="e", prompt=long_prompt, task="embed"))
        i = first_out["pc0"].request_ids.index("pc0")
        ref = torch.nn.functional.normalize(
            first_out["pc0"].hidden_states[int(first_out["pc0"].query_start_loc[i + 1]) - 1], dim=-1)
        assert emb.shape == (b.hidden_size,) and emb.dtype == torch.float32
        assert float((emb - ref).abs().max()) < 1e-4
    finally:
        b.close()


def run_tts_pipeline(backend, specs, *, async_path: bool):
    """Run specs through a tts Pipeline; returns audio bytes, code2wav codes,
    engine-reported tokens and finish reasons, per request."""
    prefix = f"omni-vt-{os.getpid()}-{int(async_path)}"
    arena = ShmArena(prefix, 8, 1 << 20) if async_path else None
    pipeline = Pipeline(load_profile("tts"), {"talker": backend}, vocoder=fake_vocoder(load_profile("tts"), backend),
                        materializer_target=None, shm_prefix=prefix, arena=arena, in_process_builder=async_path)
    assert pipeline.decision.use_async is async_path
    reported = record_engine_tokens(backend)
    codes: dict[str, list[np.ndarray]] = defaultdict(list)
    orig_frames = pipeline.code2wav.frames

    def frames(rid, voice, c, first=0):
        codes[rid].append(np.array(c, copy=True))
        orig_frames(rid, voice, c, first)

    pipeline.code2wav.frames = frames
    audio: dict[str, list[bytes]] = defaultdict(list)
    finals: dict[str, str] = {}
    lock = threading.Lock()
    done = threading.Event()

    def sink_for(rid):
        def sink(resp):
            with lock:
                if isinstance(resp, OmniError):  # a failed request's error, in place of a response
                    finals[rid] = f"error: {resp}"
                    if len(finals) == len(specs):
                        done.set()
                    return
                if resp.multimodal_output.tensors:
                    audio[rid].append(payload_tensors(resp.multimodal_output)["audio"].numpy().tobytes())
                if resp.finished:
                    assert rid not in finals, "finished twice"
                    finals[rid] = resp.finish_reason
                    if len(finals) == len(specs):
                        done.set()
        return sink

    pipeline.start()
    try:
        # One request at a time: the results are compared for equality between
        # two pipelines, so each step must run the same batch in both. Submitted
        # together, the stage thread may start a step between two submits, and
        # where it does is timing: the batches (and so the bits of torch's CPU
        # linear, which differ for one row (GEMV) and several (GEMM)) could
        # differ between the runs and flip a sampled token.
        for n, spec in enumerate(specs, 1):
            pipeline.submit(spec, sink_for(spec.request_id))
            deadline = time.monotonic() + 60
            while len(finals) < n:
                assert time.monotonic() < deadline, f"{spec.request_id} did not finish in 60 s"
                time.sleep(0.005)
        assert done.wait(60), f"only {len(finals)}/{len(specs)} requests finished"
    finally:
        pipeline.stop()
        if arena is not None:
            arena.close()
    codes_cat = {rid: np.concatenate(v, axis=0) for rid, v in codes.items()}
    return {rid: b"".join(v) for rid, v in audio.items()}, codes_cat, dict(reported), finals


def speech_specs(n: int = 10) -> list[RequestSpec]:
    return [
        RequestSpec(request_id=f"tts{i}", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=16 + 2 * i,
                    temperature=0.9, top_p=0.95, top_k=50 if i % 2 else 0, seed=7 + i,
                    voice=("default", "alloy")[i % 2], modality=OutputModality.AUDIO)
        for i in range(n)
    ]


@pytest.mark.vllm
def test_pipeline_sync_and_async_paths_give_identical_audio(models, monkeypatch):
    """10 seeded requests (temperature > 0, one at a time: identical batches
    in every run, see run_tts_pipeline): the synchronous path (engine
    without async scheduling), the asynchronous path as the tts profile
    builds it on CPU (in-process builder over a shm arena; the profile asks
    for async scheduling, vLLM's CPU platform keeps it off) and the same
    with async scheduling forced on (OMNI_CPU_ASYNC_SCHEDULING=1, the
    behaviour before) give byte-identical audio and codes; code2wav's
    codebook 0 is exactly what the engine reported."""
    from prometheus_client import REGISTRY

    from decoder_svc.testing.standin_backend import StandinBackend
    from decoder_svc.testing.standin_profiles import build_backends
    from decoder_svc.vllm_engine.engine_factory import FORCE_ASYNC_ENV

    specs = speech_specs(10)
    sync_backend = StandinBackend(models / "talker", async_scheduling=False, stop_token_ids=TALKER_STOP_IDS,
                               pooling_engine="off")
    assert sync_backend.engine_facts()["async_scheduling"] is False

    def predictor(kind: str) -> float:  # the code predictor's time in the talker's steps
        got = REGISTRY.get_sample_value(f"omni_decoder_code_predictor_seconds_{kind}", {"stage": sync_backend.name})
        return got or 0.0

    calls, spent = predictor("count"), predictor("sum")
    sync = run_tts_pipeline(sync_backend, specs, async_path=False)
    assert predictor("count") > calls and predictor("sum") > spent, "the code predictor's time was not observed"

    monkeypatch.delenv(FORCE_ASYNC_ENV, raising=False)
    async_backend = build_backends("tts", models, max_num_seqs=32, stop_token_ids=TALKER_STOP_IDS,
                                   pooling_engine="off")["talker"]
    facts = async_backend.engine_facts()
    assert facts["async_scheduling"] is False, f"vLLM's CPU platform: async scheduling should stay off, {facts=}"
    assert facts["capture_hidden"] is False
    assert facts["postprocess"] == "eager" and facts["async_output_eligible"] is True
    asyn = run_tts_pipeline(async_backend, specs, async_path=True)
    # without async scheduling no step is scheduled past a stop: no row to drop
    assert async_backend.dropped_rows == 0, f"{async_backend.dropped_rows} rows dropped with async scheduling off"

    monkeypatch.setenv(FORCE_ASYNC_ENV, "1")
    forced_backend = build_backends("tts", models, max_num_seqs=32, stop_token_ids=TALKER_STOP_IDS,
                                    pooling_engine="off")["talker"]
    assert forced_backend.engine_facts()["async_scheduling"] is True, forced_backend.engine_facts()
    forced = run_tts_pipeline(forced_backend, specs, async_path=True)
    # async scheduling scheduled a step past some stops; those rows were dropped
    assert forced_backend.dropped_rows > 0

    for audio, codes, reported, finals in (sync, asyn, forced):
        assert set(finals) == {s.request_id for s in specs}
        assert set(finals.values()) <= {"length", "stop"}
        for s in specs:
            rid = s.request_id
            c = codes[rid]
            assert c.shape == (len(reported[rid]), 16) and c.dtype == np.int64
            assert c[:, 0].tolist() == reported[rid], rid
            assert len(audio[rid]) > 0
            if finals[rid] == "length":
                assert len(reported[rid]) == s.max_tokens
            else:
                assert reported[rid][-1] in TALKER_STOP_IDS or reported[rid][-1] == 0
    # both kinds of finish occur with these seeds
    assert {"length", "stop"} <= set(sync[3].values())
    for name, other in (("async path, scheduling off", asyn), ("async path, scheduling forced on", forced)):
        assert sync[3] == other[3], f"{name}: finish reasons differ"
        for rid in sync[0]:
            assert np.array_equal(sync[1][rid], other[1][rid]), f"{name}: codes differ for {rid}"
            assert sync[0][rid] == other[0][rid], f"{name}: audio differs for {rid}"


@pytest.mark.vllm
def test_pooling_beside_running_speech(models):
    """embed() while speech requests decode in the stage thread: it returns an
    embedding, and every speech request still finishes normally."""
    from decoder_svc.testing.standin_backend import StandinBackend

    backend = StandinBackend(models / "talker", async_scheduling=True, pooling_engine="lazy")
    specs = [RequestSpec(request_id=f"sp{i}", prompt=PROMPTS[i], max_tokens=32, temperature=0.8, seed=i)
             for i in range(6)]
    pipeline = Pipeline(load_profile("tts"), {"talker": backend}, vocoder=fake_vocoder(load_profile("tts"), backend),
                        materializer_target=None, shm_prefix="omni-vt", arena=None)
    finals: dict[str, str] = {}
    samples: dict[str, int] = defaultdict(int)
    done = threading.Event()
    lock = threading.Lock()

    def sink_for(rid):
        def sink(resp):
            with lock:
                if isinstance(resp, OmniError):  # a failed request's error, in place of a response
                    finals[rid] = f"error: {resp}"
                    if len(finals) == len(specs):
                        done.set()
                    return
                if resp.multimodal_output.tensors:
                    samples[rid] += int(payload_tensors(resp.multimodal_output)["audio"].numel())
                if resp.finished:
                    finals[rid] = resp.finish_reason
                    if len(finals) == len(specs):
                        done.set()
        return sink

    pipeline.start()
    try:
        for s in specs:
            pipeline.submit(s, sink_for(s.request_id))
        deadline = time.monotonic() + 30
        while pipeline.runner.steps < 2:  # the batch is decoding
            assert time.monotonic() < deadline
            time.sleep(0.001)
        active_before = pipeline.active_requests
        steps_before = pipeline.runner.steps
        e1 = backend.embed(RequestSpec(request_id="emb", prompt="Please embed this sentence.", task="embed"))
        assert pipeline.abort("sp5")  # an abort from another thread mid-decode
        e2 = backend.embed(RequestSpec(request_id="emb2", prompt="Please embed this sentence.", task="embed"))
        assert active_before > 0
        assert done.wait(60), f"only {len(finals)}/{len(specs)} speech requests finished"
        assert pipeline.runner.steps > steps_before
        assert not backend.abort("sp5")  # already gone
    finally:
        pipeline.stop()
    assert e1.shape == (backend.hidden_size,) and bool(torch.isfinite(e1).all())
    assert abs(float(e1.norm()) - 1.0) < 1e-4
    assert torch.equal(e1, e2)
    assert set(finals) == {s.request_id for s in specs}
    assert finals.pop("sp5") == "abort"
    assert set(finals.values()) <= {"length", "stop"}
    assert all(samples[rid] > 0 for rid in finals)


@pytest.mark.vllm
def test_omni_thinker_hands_hidden_states_to_talker(models):
    """omni profile via build_backends: the thinker streams text, its hidden
    rows become the talker's prompt embeds, and the talker's codes become audio."""
    from decoder_svc.testing.standin_profiles import build_backends

    backends = build_backends(load_profile(STANDIN_OMNI), models, max_num_seqs=8)
    assert set(backends) == {"thinker", "talker"}
    assert backends["thinker"].engine_facts()["capture_hidden"] is True
    assert backends["talker"].engine_facts()["enable_prompt_embeds"] is True
    thinker_tokens = record_engine_tokens(backends["thinker"])
    talker_tokens = record_engine_tokens(backends["talker"])
    profile = load_profile(STANDIN_OMNI)
    pipeline = Pipeline(profile, backends, vocoder=fake_vocoder(profile, backends["talker"]), materializer_target=None,
                        shm_prefix="omni-vt-omni", arena=None)
    text: dict[str, list[str]] = defaultdict(list)
    new_ids: dict[str, list[int]] = defaultdict(list)
    samples: dict[str, int] = defaultdict(int)
    finals: dict[str, str] = {}
    done = threading.Event()
    lock = threading.Lock()
    specs = [RequestSpec(request_id=f"om{i}", prompt=PROMPTS[i], max_tokens=12, temperature=0.7, seed=i,
                         max_audio_seconds=5.12,  # 64 talker frames
                         modality=OutputModality.TEXT | OutputModality.AUDIO) for i in range(3)]

    def sink_for(rid):
        def sink(resp):
            with lock:
                if isinstance(resp, OmniError):  # a failed request's error, in place of a response
                    finals[rid] = f"error: {resp}"
                    if len(finals) == len(specs):
                        done.set()
                    return
                if resp.text_delta:
                    text[rid].append(resp.text_delta)
                new_ids[rid].extend(resp.new_token_ids)
                if resp.multimodal_output.tensors:
                    samples[rid] += int(payload_tensors(resp.multimodal_output)["audio"].numel())
                if resp.finished:
                    finals[rid] = resp.finish_reason
                    if len(finals) == len(specs):
                        done.set()
        return sink

    pipeline.start()
    try:
        for s in specs:
            pipeline.submit(s, sink_for(s.request_id))
        assert done.wait(60), f"only {len(finals)}/{len(specs)} omni requests finished"
    finally:
        pipeline.stop()
    for s in specs:
        rid = s.request_id
        assert finals[rid] in ("length", "stop")
        assert new_ids[rid] == thinker_tokens[rid]
        assert "".join(text[rid])
        assert 0 < len(talker_tokens[rid]) <= 64  # max_audio_seconds 5.12: 64 frames
        assert samples[rid] > 0


@pytest.mark.vllm
def test_a_step_from_a_new_thread_runs_on_the_bound_thread_count(models):
    """ATen's process-wide intra-op count changed after the engine bound its
    threads (a library or an earlier test calling the real setter) must not
    reach a thread that steps the engine later: vLLM's CPU attention aborts a
    step whose plan and kernel see different counts."""
    from decoder_svc.testing.standin_backend import StandinBackend

    backend = StandinBackend(models / "talker")
    bound = torch.get_num_threads()
    torch._C.set_num_threads(1)  # the real setter (vLLM replaced torch.set_num_threads)
    outcome: dict[str, object] = {}

    def stepper():
        try:
            backend.add_request(RequestSpec(request_id="t0", prompt=PROMPTS[0], max_tokens=4))
            outcome["outs"] = drive(backend)
            outcome["threads"] = torch.get_num_threads()
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome["error"] = e

    try:
        t = threading.Thread(target=stepper)
        t.start()
        t.join(120)
        assert not t.is_alive(), "the step did not return"
        assert "error" not in outcome, outcome.get("error")
        assert outcome["outs"], "no step output"
        assert outcome["threads"] == bound
    finally:
        torch._C.set_num_threads(bound)
        backend.close()
