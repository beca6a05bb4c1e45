"""Voice cloning's parts: the clip encoders against the reference, and the voice registry on disk."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from decoder_svc.qwen3_tts.voices import VoiceLimits, VoiceStore
from omni_common.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)

GOLDEN = Path(__file__).parent / "golden" / "qwen3_tts"


def test_clip_features_equal_the_reference(tts_checkpoints) -> None:
    """The x-vector (our mel + ECAPA-TDNN) within float rounding, the codes (Mimi's encoder) exactly."""
    from decoder_svc.qwen3_tts.checkpoint import TTSCheckpoint
    from decoder_svc.qwen3_tts.voice_features import VoiceEncoder

    encoder = VoiceEncoder(TTSCheckpoint.open(tts_checkpoints["base"]))
    golden = np.load(GOLDEN / "encode.npz")
    xvector = encoder.x_vector(golden["clip"]).numpy()
    np.testing.assert_allclose(xvector, golden["xvector"], atol=1e-5, rtol=0)
    assert torch.equal(encoder.codes(golden["clip"]), torch.from_numpy(golden["codes"]))


class _CountingEncoder:
    """A fake clip encoder (test double): features from the clip's samples, calls counted."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, clip: np.ndarray, with_codes: bool):  # noqa: ANN204
        self.calls += 1
        x = torch.tensor([float(clip.mean()), float(clip.std()), float(clip.shape[0])])
        return x, torch.full((3, 16), int(clip.shape[0]) % 2048, dtype=torch.long) if with_codes else None


def _clip(seconds: float = 1.0, freq: float = 220.0) -> np.ndarray:
    t = np.arange(int(seconds * 24000)) / 24000
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _store(root: Path, encode=None, fingerprint: str = "fp1", **limits) -> VoiceStore:  # noqa: ANN001
    return VoiceStore(root, fingerprint=fingerprint, encode=encode or _CountingEncoder(), reserved=("default",),
                      limits=VoiceLimits(**limits))


def test_register_list_use_delete(tmp_path) -> None:
    enc = _CountingEncoder()
    store = _store(tmp_path, enc)
    info = store.register("alice", _clip(), "Hello world.")
    assert (info.name, info.transcript, info.seconds) == ("alice", "Hello world.", 1.0)
    assert [v.name for v in store.list()] == ["alice"] and store.has("alice") and not store.has("bob")
    f = store.features("alice")
    assert f.codes is not None and f.transcript == "Hello world." and enc.calls == 1  # computed once, at registration
    on_disk = json.loads((tmp_path / "voices" / "alice" / "voice.json").read_text())
    assert on_disk["sha256"] == info.sha256 and (tmp_path / "features" / "fp1" / "alice.safetensors").is_file()
    store.register("bob", _clip(2.0, 330.0))  # no transcript: the voice alone
    assert store.features("bob").codes is None
    store.delete("alice")
    assert [v.name for v in store.list()] == ["bob"]
    assert not (tmp_path / "voices" / "alice").exists()
    assert not (tmp_path / "features" / "fp1" / "alice.safetensors").exists()
    with pytest.raises(NotFoundError, match="alice"):
        store.delete("alice")
    with pytest.raises(NotFoundError, match="alice"):
        store.features("alice")


def test_voices_persist_and_are_computed_per_checkpoint(tmp_path) -> None:
    """Another process (a restart, a replica) finds the voice; another checkpoint computes its own
    features from the stored clip, once."""
    first = _store(tmp_path)
    first.register("alice", _clip(), "Hi.")
    same = _CountingEncoder()
    again = _store(tmp_path, same)
    assert [v.name for v in again.list()] == ["alice"]
    again.features("alice")
    assert same.calls == 0  # read from disk
    other = _CountingEncoder()
    elsewhere = _store(tmp_path, other, fingerprint="fp2")
    x1 = elsewhere.features("alice").xvector
    x2 = elsewhere.features("alice").xvector
    assert other.calls == 1 and torch.equal(x1, x2)
    assert (tmp_path / "features" / "fp2" / "alice.safetensors").is_file()


def test_names_clips_and_limits(tmp_path) -> None:
    store = _store(tmp_path, max_voices=2)
    for bad in ("", "Alice", "-x", "a" * 65, "a/b", "..", "default"):
        with pytest.raises(InvalidArgumentError, match="name"):
            store.register(bad, _clip())
    with pytest.raises(InvalidArgumentError, match=r"audio: is 0\.10 s of audio"):
        store.register("short", _clip(0.1))
    with pytest.raises(InvalidArgumentError, match="audio: is 31.00 s"):
        store.register("long", _clip(31.0))
    with pytest.raises(InvalidArgumentError, match="silent"):
        store.register("quiet", np.zeros(24000, np.float32))
    with pytest.raises(InvalidArgumentError, match="transcript"):
        store.register("chatty", _clip(), "x" * 2001)
    store.register("a1", _clip())
    with pytest.raises(AlreadyExistsError, match="a1"):
        store.register("a1", _clip())
    store.register("a1", _clip(1.5), replace=True)
    assert store.info("a1").seconds == 1.5  # type: ignore[union-attr]
    store.register("a2", _clip())
    with pytest.raises(ResourceExhaustedError, match="2 voices"):
        store.register("a3", _clip())
    assert store.names() == ["a1", "a2"]
    assert not list(tmp_path.rglob(".*"))  # no temporary file left behind


def test_the_registry_is_never_inside_the_model_directory(tts_checkpoints, tmp_path) -> None:
    from decoder_svc.qwen3_tts.checkpoint import TTSCheckpoint
    from decoder_svc.qwen3_tts.engine import make_prompts

    ckpt = TTSCheckpoint.open(tts_checkpoints["base"])
    for inside in (ckpt.path, ckpt.path / "voices"):
        with pytest.raises(InvalidArgumentError, match="voice_dir: .* inside the model's directory"):
            make_prompts(ckpt, max_model_len=0, voice_dir=inside)
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidArgumentError, match="voice_dir: cannot use"):
        make_prompts(ckpt, max_model_len=0, voice_dir=tmp_path / "file")
    prompts = make_prompts(ckpt, max_model_len=0, voice_dir=tmp_path / "voices")
    assert prompts.voices is not None and prompts.voices.root == tmp_path / "voices"
    assert make_prompts(TTSCheckpoint.open(tts_checkpoints["custom_voice"]), max_model_len=0).voices is None
