"""The thinker stage with tensor parallelism (``tensor_parallel_size: 2``).

With TP 2 vLLM runs the model runner in two worker processes; the decoder
captures each step in TP rank 0's worker (step hook, and the thinker's layer
hooks for the talker's input rows) and fetches it after ``engine.step()``
(decoder_svc/vllm_engine/capture.py, "Worker processes"). On the tiny
Qwen3-Omni checkpoint, greedy, the TP 2 thinker must give what TP 1 gives:
the same steps (request ids, rows per request), the same tokens, and the same
captured rows up to the reduction order TP changes (the all-reduce sums the
ranks' partial products): ``thinker_embed`` / ``thinker_hidden`` /
``hidden_states`` within ``atol=rtol=1e-4`` on CPU (measured on a 2-core
CPU: 0, 4.5e-8 and 1.4e-6; 1e-3 on CUDA). An omni request through the decoder's pipeline (TP 2
thinker, TP 1 talker, code2wav) yields its text and audio. The generic
VLLMBackend (the stand-in thinker, last-layer rows captured) is checked the
same way.

TP 2 on a 2-core CPU costs a worker start (~10-40 s) and ~0.15-0.75 s per
step (3 processes on 2 cores, one core per rank), so the prompts are few and
short. On a GPU host with 2 GPUs scripts/gpu_check.sh runs this file.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = ["Hello world, this is a test.", "Good morning!"]
MAX_TOKENS = 5
MAX_MODEL_LEN = 512
# TP changes the reduction order only: CPU float32 rows differ by <= 1.4e-6
# (measured); CUDA kernels differ between TP 1 and 2 by more.
ATOL = RTOL = 1e-4 if not torch.cuda.is_available() else 1e-3


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    from omni_common import torchvision_compat

    torchvision_compat.install()  # the torchvision shim, before transformers loads
    return tiny_checkpoint


def _omni_profile(tmp_path: Path, **thinker_keys):
    from decoder_svc.profile import PROFILE_DIR, load_profile

    raw = yaml.safe_load((PROFILE_DIR / "omni.yaml").read_text())
    raw["stages"][0].update(thinker_keys)
    path = tmp_path / "omni-thinker.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_profile(str(path))


def _run_thinker(backend, prompts) -> dict:
    """Greedy requests through one ThinkerBackend: per-step layout and, per
    request, tokens and the captured rows (concatenated over steps)."""
    from decoder_svc.backend import RequestSpec
    from decoder_svc.qwen3_omni.checkpoint import OmniCheckpoint
    from decoder_svc.qwen3_omni.engine import ChatPrompts

    chat = ChatPrompts(OmniCheckpoint.open(backend.checkpoint.path), max_model_len=MAX_MODEL_LEN)
    rows: dict[str, dict[str, list]] = {}
    for i, text in enumerate(prompts):
        spec = chat.chat(
            RequestSpec(request_id=f"r{i}", prompt=text, max_tokens=MAX_TOKENS, temperature=0.0)
        )
        backend.add_request(spec)
        rows[spec.request_id] = {
            "tokens": [],
            "thinker_embed": [],
            "thinker_hidden": [],
            "hidden_states": [],
        }
    layout = []
    while backend.has_unfinished():
        out = backend.step()
        if out is None:
            continue
        layout.append((list(out.request_ids), list(out.num_scheduled_tokens), dict(out.finished)))
        qsl = out.query_start_loc.tolist()
        for j, rid in enumerate(out.request_ids):
            a, z = qsl[j], qsl[j + 1]
            r = rows[rid]
            r["tokens"].append(int(out.sampled_token_ids[j, 0]))
            for name in ("thinker_embed", "thinker_hidden"):
                r[name].append(out.mm_outputs[name][0][a:z])
            if out.hidden_states is not None:
                r["hidden_states"].append(out.hidden_states[a:z])
    got = {
        rid: {k: (v if k == "tokens" else torch.cat(v).cpu() if v else None) for k, v in r.items()}
        for rid, r in rows.items()
    }
    return {"layout": layout, "rows": got}


def _thinker(checkpoint: Path, tp: int, *, capture_hidden: bool):
    from decoder_svc.qwen3_omni.backends import ThinkerBackend
    from decoder_svc.qwen3_omni.checkpoint import OmniCheckpoint

    return ThinkerBackend(
        OmniCheckpoint.open(checkpoint),
        name="thinker",
        capture_talker_inputs=True,
        capture_hidden=capture_hidden,
        async_scheduling=True,  # as the omni profile runs it
        max_num_seqs=4,
        max_model_len=MAX_MODEL_LEN,
        tensor_parallel_size=tp,
    )


@pytest.fixture(scope="module")
def tp1(checkpoint):
    backend = _thinker(checkpoint, 1, capture_hidden=True)
    try:
        return _run_thinker(backend, PROMPTS)
    finally:
        backend.close()


def test_thinker_tp2_steps_tokens_and_rows_match_tp1(checkpoint, tp1):
    from decoder_svc.vllm_engine import engine_factory as rh

    backend = _thinker(checkpoint, 2, capture_hidden=True)
    try:
        pc = backend.engine.vllm_config.parallel_config
        assert (pc.tensor_parallel_size, pc.world_size) == (2, 2)
        assert not rh.runs_in_process(backend.engine)  # the runners are in worker processes
        assert backend.engine_facts()["runner"].endswith("ModelRunner")  # fetched from a worker
        tp2 = _run_thinker(backend, PROMPTS)
    finally:
        backend.close()
    assert tp2["layout"] == tp1["layout"]  # same steps, same request order and rows per step
    for rid, want in tp1["rows"].items():
        got = tp2["rows"][rid]
        assert len(want["tokens"]) == MAX_TOKENS
        assert got["tokens"] == want["tokens"], rid
        for name in ("thinker_embed", "thinker_hidden", "hidden_states"):
            assert got[name].shape == want[name].shape, (rid, name)
            torch.testing.assert_close(
                got[name], want[name], atol=ATOL, rtol=RTOL, msg=f"{rid} {name}"
            )
        # the prompt's rows and one per generated token but the last (its step samples the end)
        assert want["thinker_embed"].shape[0] > MAX_TOKENS


def test_omni_request_through_the_decoder_with_thinker_tp2(checkpoint, tmp_path, tp1):
    """Pipeline(omni) on build_engine's backends: thinker TP 2, talker TP 1."""
    from decoder_svc.backend import RequestSpec
    from decoder_svc.pipeline import Pipeline
    from decoder_svc.qwen3_omni.engine import build_engine
    from omni_common.materialize import payload_tensors
    from omni_common.modality import OutputModality

    profile = _omni_profile(tmp_path, tensor_parallel_size=2)
    assert profile.stage("thinker").engine_args()["tensor_parallel_size"] == 2
    engine = build_engine(profile, checkpoint, max_num_seqs=4, max_model_len=MAX_MODEL_LEN)
    try:
        thinker = engine.backends["thinker"]
        assert thinker.engine.vllm_config.parallel_config.tensor_parallel_size == 2
        assert (
            engine.backends["talker"].engine.vllm_config.parallel_config.tensor_parallel_size == 1
        )
        pipeline = Pipeline(
            profile,
            engine.backends,
            vocoder=engine.vocoder,
            prepare=engine.prepare,
            materializer_target=None,
            shm_prefix="omni-tp-test",
            arena=None,
        )
        ids: list[int] = []
        samples: list[torch.Tensor] = []
        final: dict[str, str] = {}
        done = threading.Event()

        def sink(resp) -> None:
            ids.extend(resp.new_token_ids)
            if resp.multimodal_output.tensors:
                samples.append(payload_tensors(resp.multimodal_output)["audio"].reshape(-1))
            if resp.finished:
                final["reason"] = resp.finish_reason
                done.set()

        spec = RequestSpec(
            request_id="r0",
            prompt=PROMPTS[0],
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            voice="ethan",
            modality=OutputModality.TEXT | OutputModality.AUDIO,
        )
        pipeline.start()
        try:
            pipeline.submit(spec, sink)
            assert done.wait(600), "the omni request did not finish"
        finally:
            pipeline.stop()
    finally:
        engine.close()
    assert final["reason"] in ("length", "stop"), final
    assert ids == tp1["rows"]["r0"]["tokens"]  # the TP 1 thinker's greedy reply
    audio = torch.cat(samples) if samples else torch.zeros(0)
    assert audio.numel() > 0 and bool(torch.isfinite(audio).all()), "no audio"


def test_standin_thinker_tp2_hidden_rows_match_tp1(tmp_path):
    """The generic VLLMBackend (stand-in Qwen3 thinker, ``hidden_states``
    captured): the same steps, tokens and last-layer rows with TP 2."""
    from decoder_svc.backend import RequestSpec
    from decoder_svc.testing.standin_backend import StandinBackend
    from decoder_svc.testing.standin_models import create_model

    model = create_model("thinker", tmp_path / "thinker")
    runs = {}
    for tp in (1, 2):
        backend = StandinBackend(model, role="thinker", max_num_seqs=4, tensor_parallel_size=tp)
        try:
            assert backend.capture_hidden
            for i, text in enumerate(PROMPTS):
                backend.add_request(
                    RequestSpec(
                        request_id=f"s{i}", prompt=text, max_tokens=MAX_TOKENS, temperature=0.0
                    )
                )
            steps = []
            while backend.has_unfinished():
                out = backend.step()
                if out is not None:
                    steps.append(out)
        finally:
            backend.close()
        runs[tp] = steps
    assert len(runs[2]) == len(runs[1]) > 0
    for a, b in zip(runs[1], runs[2], strict=True):
        assert (a.request_ids, a.num_scheduled_tokens) == (b.request_ids, b.num_scheduled_tokens)
        assert torch.equal(a.sampled_token_ids, b.sampled_token_ids)
        torch.testing.assert_close(
            b.hidden_states.cpu(), a.hidden_states.cpu(), atol=ATOL, rtol=RTOL
        )
