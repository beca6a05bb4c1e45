"""Qwen3-TTS's 12 Hz speech decoder (decoder_svc/qwen3_tts/speech_decoder.py) against the reference.

The golden files (tests/golden/qwen3_tts/, scripts/gen_golden_qwen3_tts.py) hold the reference's
waveforms: seeded codes through its speech tokenizer, and every generation case's decoded audio.
The stated tolerance of a stream against the whole decode: 1e-5 (float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

GOLDEN = Path(__file__).parent / "golden" / "qwen3_tts"
STREAM_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def decoder(tts_checkpoints):
    from safetensors.torch import load_file

    from decoder_svc.qwen3_tts.speech_decoder import SpeechDecoder

    folder = tts_checkpoints["custom_voice"] / "speech_tokenizer"
    config = json.loads((folder / "config.json").read_text())["decoder_config"]
    return SpeechDecoder.from_config_and_tensors(config, load_file(str(folder / "model.safetensors")),
                                                 prefix="decoder.")


def test_decode_equals_the_reference(decoder) -> None:
    golden = np.load(GOLDEN / "decode.npz")
    wav = decoder.decode(torch.from_numpy(golden["codes"])).numpy()
    assert wav.shape == golden["wav"].shape == (30 * 1920,)
    np.testing.assert_allclose(wav, golden["wav"], atol=1e-5, rtol=0)
    assert float(np.abs(wav).mean()) > 1e-3  # audible, not silence


@pytest.mark.parametrize("splits", [(1,), (1, 3, 4), (7, 7, 7), (2, 11, 5, 1)])
def test_a_stream_equals_the_whole_decode(decoder, splits) -> None:
    codes = torch.from_numpy(np.load(GOLDEN / "decode.npz")["codes"])
    whole = decoder.decode(codes).numpy()
    stream, pieces, at = decoder.new_stream(), [], 0
    for n in (*splits, codes.shape[0]):
        end = min(at + n, codes.shape[0])
        if end > at:
            piece = stream.push(codes[at:end]).numpy()
            assert piece.shape[0] == (end - at) * 1920  # every frame's samples as soon as it arrives
            pieces.append(piece)
        at = end
    np.testing.assert_allclose(np.concatenate(pieces), whole, atol=STREAM_TOLERANCE, rtol=0)


def test_push_many_equals_pushing_alone(decoder) -> None:
    from decoder_svc.qwen3_omni.code2wav_batch import push_many

    codes = torch.from_numpy(np.load(GOLDEN / "decode.npz")["codes"])
    alone = [decoder.new_stream() for _ in range(3)]
    together = [decoder.new_stream() for _ in range(3)]
    for lo, sizes in ((0, (3, 1, 5)), (5, (4, 4, 2))):
        blocks = [codes[lo : lo + n] for n in sizes]
        want = [s.push(b).numpy() for s, b in zip(alone, blocks, strict=True)]
        got = [p.numpy() for p in push_many(together, blocks)]
        for w, g in zip(want, got, strict=True):
            np.testing.assert_allclose(g, w, atol=STREAM_TOLERANCE, rtol=0)


def test_every_generation_case_decodes_to_the_reference_audio(decoder) -> None:
    """The reference decodes voice-clone (ICL) codes after the reference clip's codes and cuts that
    part off: a stream fed the clip's codes first and the generated codes after gives the same audio."""
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    ref_codes = torch.from_numpy(np.load(GOLDEN / "encode.npz")["codes"])
    checked = 0
    for name, case in manifest["cases"].items():
        arrays = np.load(GOLDEN / case["file"])
        args = case["args"]
        for i in range(len(case["frames"])):
            icl = args.get("ref_text") if not isinstance(args.get("ref_text"), list) else args["ref_text"][i]
            stream = decoder.new_stream()
            if icl:
                stream.push(ref_codes)
            wav = stream.push(torch.from_numpy(arrays[f"codes_{i}"])).numpy()
            np.testing.assert_allclose(wav, arrays[f"wav_{i}"], atol=STREAM_TOLERANCE, rtol=0, err_msg=name)
            checked += 1
    assert checked == 12


def test_bad_codes_are_refused(decoder) -> None:
    with pytest.raises(ValueError, match=r"\[frames >= 1, 16\]"):
        decoder.decode(torch.zeros((3, 15), dtype=torch.long))
    with pytest.raises(ValueError, match="2048"):
        decoder.decode(torch.full((3, 16), 2048, dtype=torch.long))
