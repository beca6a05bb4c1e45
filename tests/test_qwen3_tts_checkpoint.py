"""The Qwen3-TTS checkpoint layout (decoder_svc/qwen3_tts/layout.py) and the tiny checkpoints (tiny.py)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from decoder_svc.qwen3_tts.layout import (
    speaker_encoder_tensors,
    speech_decoder_tensors,
    talker_tensors,
)

GOLDEN = Path(__file__).parent / "golden" / "qwen3_tts"

# The released 12 Hz checkpoints' settings (the shapes that matter for the counts).
_CP = dict(vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
           num_key_value_heads=8, head_dim=128)
_TALKER_0B6 = dict(code_predictor_config=_CP, vocab_size=3072, hidden_size=1024, intermediate_size=3072,
                   num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                   text_hidden_size=2048, text_vocab_size=151936, num_code_groups=16)
_DECODER = dict(codebook_dim=512, latent_dim=1024, hidden_size=512, codebook_size=2048, decoder_dim=1536,
                num_quantizers=16, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, head_dim=64,
                intermediate_size=1024, upsampling_ratios=[2, 2], upsample_rates=[8, 5, 4, 3])


def _params(shapes: dict) -> int:
    return sum(math.prod(s) for s in shapes.values())


def test_layout_gives_the_released_counts() -> None:
    """0.6B CustomVoice: 402 tensors, 905,788,672 parameters (the released file's counts); the speech
    tokenizer's decoder 271 tensors; 1.7B Base (a narrower code predictor behind small_to_mtp_projection,
    the speaker encoder at 2048) 1,928,677,440 parameters."""
    small = talker_tensors(_TALKER_0B6)
    assert (len(small), _params(small)) == (402, 905_788_672)
    assert "talker.code_predictor.small_to_mtp_projection.weight" not in small
    assert len(speech_decoder_tensors(_DECODER)) == 271
    big = talker_tensors(dict(_TALKER_0B6, hidden_size=2048, intermediate_size=6144))
    assert big["talker.code_predictor.small_to_mtp_projection.weight"] == (1024, 2048)
    assert big["talker.code_predictor.model.codec_embedding.0.weight"] == (2048, 2048)
    assert _params(big) + _params(speaker_encoder_tensors({"enc_dim": 2048})) == 1_928_677_440


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_checkpoints_are_the_ones_the_golden_files_came_from(tts_checkpoints) -> None:
    """The tiny checkpoints are written the same on every host (numpy's seeded generator): the golden
    files' weight digests match, so the parity tests compare runs on the same weights."""
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    for kind, digests in manifest["checkpoints"].items():
        for rel, digest in digests.items():
            assert _sha256(tts_checkpoints[kind] / rel) == digest, (
                f"{kind}/{rel} differs from the golden files' checkpoint: regenerate them "
                "(scripts/gen_golden_qwen3_tts.py)")


def test_tiny_checkpoint_layout(tts_checkpoints) -> None:
    from safetensors import safe_open

    for kind, path in tts_checkpoints.items():
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["architectures"] == ["Qwen3TTSForConditionalGeneration"] and cfg["tts_model_type"] == kind
        expected = talker_tensors(cfg["talker_config"])
        if kind == "base":
            expected.update(speaker_encoder_tensors(cfg["speaker_encoder_config"]))
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert got == expected
        assert not (path / "tokenizer.json").exists()  # as released: vocab.json + merges.txt
        for name in ("generation_config.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                     "speech_tokenizer/config.json", "speech_tokenizer/preprocessor_config.json"):
            assert (path / name).is_file(), name


def test_tiny_checkpoint_refuses_an_existing_directory(tmp_path) -> None:
    from decoder_svc.qwen3_tts.tiny import create_tiny_checkpoint

    (tmp_path / "x").mkdir()
    with pytest.raises(FileExistsError):
        create_tiny_checkpoint(tmp_path / "x")
    with pytest.raises(ValueError, match="kind"):
        create_tiny_checkpoint(tmp_path / "y", kind="nope")
    assert not (tmp_path / "y").exists()
