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


def _broken_copy(tmp_path: Path, src: Path, edit) -> Path:  # noqa: ANN001
    """A copy of a checkpoint with its config.json edited by `edit(config)`."""
    import shutil

    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    ("edit", "key", "says"),
    [
        (lambda c: c["talker_config"].update(hidden_size=256), "talker.model.layers.0.self_attn.q_proj.weight",
         "shape"),
        (lambda c: c["talker_config"].update(codec_eos_token_id=5000), "talker_config.codec_eos_token_id",
         "codec vocabulary"),
        (lambda c: c["talker_config"]["spk_is_dialect"].pop("eric"), "talker_config.spk_is_dialect.eric",
         "every speaker"),
        (lambda c: c["talker_config"]["code_predictor_config"].update(num_code_groups=8),
         "talker_config.code_predictor_config.num_code_groups", "the talker has 16"),
        (lambda c: c.update(tts_model_type="karaoke"), "tts_model_type", "one of"),
        (lambda c: c["talker_config"].pop("text_vocab_size"), "talker_config.text_vocab_size", "integer"),
    ],
    ids=["shape", "codec-id", "dialect", "groups", "kind", "text-vocab"],
)
def test_a_bad_checkpoint_is_refused_naming_file_and_key(tmp_path, tts_checkpoints, edit, key, says) -> None:
    from decoder_svc.qwen3_tts.checkpoint import CheckpointError, TTSCheckpoint

    path = _broken_copy(tmp_path, tts_checkpoints["custom_voice"], edit)
    with pytest.raises(CheckpointError) as err:
        TTSCheckpoint.open(path)
    assert err.value.key == key and says in err.value.message, str(err.value)


def test_the_speech_tokenizer_is_checked(tmp_path, tts_checkpoints) -> None:
    import shutil

    from decoder_svc.qwen3_tts.checkpoint import CheckpointError, TTSCheckpoint

    dst = tmp_path / "no-speech"
    shutil.copytree(tts_checkpoints["voice_design"], dst)
    cfg = json.loads((dst / "speech_tokenizer" / "config.json").read_text())
    cfg["decoder_config"]["num_quantizers"] = 8
    (dst / "speech_tokenizer" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="decoder_config.num_quantizers: 8 but the talker makes 16"):
        TTSCheckpoint.open(dst)
    (dst / "speech_tokenizer" / "config.json").unlink()
    with pytest.raises(CheckpointError, match="speech_tokenizer/config.json"):
        TTSCheckpoint.open(dst)


def test_cli_creates_and_checks_a_tts_checkpoint(tmp_path, capsys) -> None:
    from omni_cli.main import main

    out = tmp_path / "vd"
    assert main(["models", "create", "--family", "qwen3-tts", "--kind", "voice_design", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert main(["models", "check", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "Qwen3TTSForConditionalGeneration (voice_design)" in summary
    assert "none (described by instructions)" in summary and "auto, chinese, english" in summary
    assert main(["models", "create", "--family", "qwen3-tts", "--out", str(out)]) == 2  # exists: untouched
    assert main(["models", "create", "--family", "qwen3-tts"]) == 2  # needs --out
    assert "--out" in capsys.readouterr().err


def test_a_tts_model_serves_the_tts_profile(tts_checkpoints) -> None:
    """--profile auto gives the model's own profile; an explicit omni is refused with the fix named."""
    from decoder_svc.families import UnservableModel, family_for
    from decoder_svc.profile import load_profile
    from decoder_svc.qwen3_tts.family import build_engine

    path = str(tts_checkpoints["custom_voice"])
    assert family_for("vllm", path).name == "qwen3_tts" and family_for("vllm", path).default_profile == "tts"
    assert family_for("vllm", "").default_profile == "omni"
    with pytest.raises(UnservableModel, match="tts profile"):
        build_engine(load_profile("omni"), path, max_num_seqs=None)
    with pytest.raises(UnservableModel, match="--model"):
        build_engine(load_profile("tts"), "", max_num_seqs=None)
