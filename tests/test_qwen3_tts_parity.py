"""Parity of the Qwen3-TTS talker on vLLM with the reference implementation (qwen-tts 0.1.1).

The reference's greedy codes for every case of the golden files (tests/golden/qwen3_tts/, written
by scripts/gen_golden_qwen3_tts.py in the reference's own environment) are reproduced exactly, all
16 codebooks of every frame: each case's requests alone, and all of a kind's requests at once (a
batch). Cloned voices take the reference's x-vector and reference codes as recorded in encode.npz
(the speaker and speech-tokenizer encoders are compared on their own in test_qwen3_tts_voices.py).

The reference drops the frame of its last step (a frame's residual codes come a step later), so its
run with max_new_tokens 16 is compared with a served run capped at 15 frames.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.speech_helpers import talker_codes

pytest.importorskip("vllm")
pytestmark = [pytest.mark.parity, pytest.mark.vllm]

GOLDEN = Path(__file__).parent / "golden" / "qwen3_tts"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())


def _items(args: dict) -> list[dict]:
    """A case's arguments, one dict per request."""
    n = len(args["text"]) if isinstance(args["text"], list) else 1
    return [{k: (v[i] if isinstance(v, list) else v) for k, v in args.items()} for i in range(n)]


def _spec(engine, rid: str, item: dict, frames: int):
    from decoder_svc.backend import RequestSpec
    from decoder_svc.qwen3_tts.backend import REF_CODES, REF_TEXT_IDS, TEXT_STREAMING, XVECTOR
    from decoder_svc.qwen3_tts.prompt import reference_text

    cond: dict[str, torch.Tensor] = {}
    if "non_streaming_mode" in item:
        cond[TEXT_STREAMING] = torch.tensor(not item["non_streaming_mode"])
    if "x_vector_only_mode" in item or "ref_text" in item:  # a clone: the x-vector, and codes in context
        encoded = np.load(GOLDEN / "encode.npz")
        cond[XVECTOR] = torch.from_numpy(encoded["xvector"])
        if item.get("ref_text") and not item.get("x_vector_only_mode"):
            cond[REF_CODES] = torch.from_numpy(encoded["codes"])
            cond[REF_TEXT_IDS] = torch.tensor(engine.prompts.tokens(reference_text(item["ref_text"])))
    return RequestSpec(request_id=rid, prompt=item["text"], voice=item.get("speaker", "default"),
                       language=item["language"], instructions=item.get("instruct") or "", max_tokens=frames,
                       conditioning=cond)


_run = talker_codes


@pytest.mark.parametrize("kind", ["custom_voice", "voice_design", "base"])
def test_greedy_codes_equal_the_reference(tts_checkpoints, kind) -> None:
    from decoder_svc.profile import load_profile
    from decoder_svc.qwen3_tts.checkpoint import TTSCheckpoint
    from decoder_svc.qwen3_tts.engine import build_engine

    frames = MANIFEST["max_new_tokens"] - 1
    engine = build_engine(load_profile("tts"), TTSCheckpoint.open(tts_checkpoints[kind]), max_num_seqs=8)
    try:
        cases = {name: case for name, case in MANIFEST["cases"].items() if name.startswith(kind + "/")}
        assert cases
        everything, want = [], {}
        for name, case in cases.items():
            golden = np.load(GOLDEN / case["file"])
            items = _items(case["args"])
            alone = [_spec(engine, f"{name}/{i}", item, frames) for i, item in enumerate(items)]
            got = _run(engine, alone)  # the case as the reference ran it (alone, or its batch)
            for i, spec in enumerate(alone):
                ref = torch.from_numpy(golden[f"codes_{i}"])
                want[spec.request_id] = ref
                assert torch.equal(got[spec.request_id], ref), f"{name} item {i}: codes differ from the reference"
            everything += [_spec(engine, f"all/{s.request_id}", item, frames) for s, item in zip(alone, items, strict=True)]
        together = _run(engine, everything)  # every request of the kind at once
        for spec in everything:
            assert torch.equal(together[spec.request_id], want[spec.request_id.removeprefix("all/")]), spec.request_id
        assert engine.backends["talker"]._model.slots.live() == [], "per-request talker state left behind"
    finally:
        engine.close()
