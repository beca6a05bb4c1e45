"""The voice registry: reference clips registered once, used by name in every later request.

A voice-clone (``base``) model speaks in a voice cloned from a reference
clip (and, with the clip's transcript, continues the clip in context:
:mod:`.prompt`). Sending the clip with every request costs its upload,
decoding and encoding each time; a registered voice is encoded once.

On disk, in the directory the deployment names (``--voice-dir``, never the
model's directory)::

    voices/<name>/voice.json          name, transcript, seconds, the clip's SHA-256, when it was registered
    voices/<name>/reference.wav       the clip as registered (24 kHz mono, 16-bit PCM)
    features/<fingerprint>/<name>.safetensors
                                      the clip's features for one checkpoint: its x-vector and, with a
                                      transcript, its codes (tagged with the clip's SHA-256)

A voice belongs to no checkpoint: its features are computed per checkpoint
(keyed by the checkpoint's fingerprint) when first needed, and again if the
clip changed. Deleting a voice removes its folder and its features for
every checkpoint. Every file is written to a temporary name and renamed into
place, so several decoder replicas may share the directory (a shared
volume): a voice one registers, the others find at its next request (they
look the name up on disk, then keep its features in memory while the files
are unchanged); the last registration of a name wins.

Limits (:class:`VoiceLimits`): a clip's length, its bytes, a transcript's
length, how many voices; a name is 1-64 of ``a-z 0-9 _ -``, starting with a
letter or digit, and not one of the model's own voices.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import threading
import time
import wave
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omni_common.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)

__all__ = ["VoiceFeatures", "VoiceInfo", "VoiceLimits", "VoiceStore", "NAME_PATTERN"]

NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
SAMPLE_RATE = 24_000


@dataclass(frozen=True)
class VoiceLimits:
    max_seconds: float = 30.0  # a reference clip's length
    min_seconds: float = 0.5
    max_bytes: int = 16 * 2**20  # the clip as sent
    max_transcript_chars: int = 2000
    max_voices: int = 1000


@dataclass(frozen=True)
class VoiceInfo:
    name: str
    transcript: str
    seconds: float
    sha256: str
    created_unix: float

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "transcript": self.transcript, "seconds": self.seconds, "sha256": self.sha256,
                "created_unix": self.created_unix}


@dataclass(frozen=True)
class VoiceFeatures:
    """A clip's features for one checkpoint: the x-vector [H], and its codes [F, Q] when it has a transcript."""

    xvector: Any
    codes: Any | None
    transcript: str


def _wav_bytes(clip: np.ndarray) -> bytes:
    pcm = np.clip(np.round(clip * 32767.0), -32768, 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def _wav_samples(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data), "rb") as w:
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class VoiceStore:
    """Registered voices in ``root`` (module docstring). ``encode(clip, with_codes)``:
    the checkpoint's features of a 24 kHz clip -> (x-vector, codes or None)."""

    def __init__(self, root: str | Path, *, fingerprint: str, encode: Callable[[np.ndarray, bool], tuple[Any, Any]],
                 reserved: tuple[str, ...] = (), limits: VoiceLimits | None = None) -> None:
        self.root = Path(root).expanduser()
        self.fingerprint = fingerprint
        self.encode = encode
        self.reserved = frozenset(v.lower() for v in reserved)
        self.limits = limits or VoiceLimits()
        self._lock = threading.Lock()
        self._memo: dict[str, tuple[str, VoiceFeatures]] = {}  # name -> (sha256, features)
        (self.root / "voices").mkdir(parents=True, exist_ok=True)

    # -- paths
    def _dir(self, name: str) -> Path:
        return self.root / "voices" / name

    def _features_file(self, name: str) -> Path:
        return self.root / "features" / self.fingerprint / f"{name}.safetensors"

    def check_name(self, name: str, field: str = "name") -> str:
        if not NAME_PATTERN.match(name or ""):
            raise InvalidArgumentError(field, f"{name!r} is not a voice name: 1-64 of a-z 0-9 _ -, starting with a "
                                              "letter or digit")
        if name in self.reserved:
            raise InvalidArgumentError(field, f"{name!r} is one of the model's own voices")
        return name

    def check_clip(self, clip: np.ndarray, field: str) -> None:
        seconds = clip.shape[0] / SAMPLE_RATE
        lim = self.limits
        if not lim.min_seconds <= seconds <= lim.max_seconds:
            raise InvalidArgumentError(field, f"is {seconds:.2f} s of audio; a reference clip is "
                                              f"{lim.min_seconds:g}-{lim.max_seconds:g} s")
        if float(np.max(np.abs(clip))) < 1e-4:
            raise InvalidArgumentError(field, "is silent")

    def check_transcript(self, text: str, field: str = "reference_text") -> str:
        if len(text) > self.limits.max_transcript_chars:
            raise InvalidArgumentError(field, f"has {len(text)} characters; the limit is "
                                              f"{self.limits.max_transcript_chars}")
        return text.strip()

    # -- the registry
    def register(self, name: str, clip: np.ndarray, transcript: str = "", *, replace: bool = False,
                 field: str = "audio") -> VoiceInfo:
        """Register `clip` (24 kHz float32 mono, checked) as `name`; its features
        for this checkpoint are computed now (a clip the model cannot encode is refused)."""
        self.check_name(name)
        self.check_clip(clip, field)
        transcript = self.check_transcript(transcript, "transcript")
        wav = _wav_bytes(clip)
        samples = _wav_samples(wav)  # what a later load reads: the features are of these samples
        features = self._compute(samples, transcript)
        info = VoiceInfo(name, transcript, round(samples.shape[0] / SAMPLE_RATE, 3), hashlib.sha256(wav).hexdigest(),
                         round(time.time(), 3))
        with self._lock:
            exists = (self._dir(name) / "voice.json").exists()
            if exists and not replace:
                raise AlreadyExistsError(f"name: voice {name!r} exists; delete it first, or register it with replace")
            if not exists and len(self.names()) >= self.limits.max_voices:
                raise ResourceExhaustedError(f"the registry holds {self.limits.max_voices} voices, its limit; "
                                             "delete one first")
            _write_atomic(self._dir(name) / "reference.wav", wav)
            _write_atomic(self._dir(name) / "voice.json", json.dumps(info.to_json(), indent=2).encode())
            self._save_features(name, info.sha256, features)
            self._memo[name] = (info.sha256, features)
        return info

    def names(self) -> list[str]:
        voices = self.root / "voices"
        return sorted(p.name for p in voices.iterdir() if (p / "voice.json").is_file()) if voices.exists() else []

    def info(self, name: str) -> VoiceInfo | None:
        try:
            raw = json.loads((self._dir(name) / "voice.json").read_text())
            return VoiceInfo(str(raw["name"]), str(raw.get("transcript", "")), float(raw["seconds"]),
                             str(raw["sha256"]), float(raw["created_unix"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def list(self) -> list[VoiceInfo]:
        return [i for i in (self.info(n) for n in self.names()) if i is not None]

    def has(self, name: str) -> bool:
        return bool(NAME_PATTERN.match(name or "")) and (self._dir(name) / "voice.json").is_file()

    def delete(self, name: str) -> None:
        """Remove the voice: its folder (clip and description) and its features for every checkpoint."""
        self.check_name(name)
        with self._lock:
            folder = self._dir(name)
            if not (folder / "voice.json").exists():
                raise NotFoundError(f"name: no voice {name!r}")
            shutil.rmtree(folder, ignore_errors=True)
            for per_checkpoint in (self.root / "features").glob("*"):
                (per_checkpoint / f"{name}.safetensors").unlink(missing_ok=True)
            self._memo.pop(name, None)

    def features(self, name: str) -> VoiceFeatures:
        """A registered voice's features for this checkpoint (memory, disk, or computed now)."""
        info = self.info(name)
        if info is None:
            raise NotFoundError(f"voice: no voice {name!r}")
        memo = self._memo.get(name)
        if memo is not None and memo[0] == info.sha256:
            return memo[1]
        features = self._load_features(name, info.sha256)
        if features is None:
            samples = _wav_samples((self._dir(name) / "reference.wav").read_bytes())
            features = self._compute(samples, info.transcript)
            self._save_features(name, info.sha256, features)
        self._memo[name] = (info.sha256, features)
        return features

    # -- features
    def _compute(self, clip: np.ndarray, transcript: str) -> VoiceFeatures:
        xvector, codes = self.encode(clip, bool(transcript))
        return VoiceFeatures(xvector, codes, transcript)

    def _save_features(self, name: str, sha256: str, f: VoiceFeatures) -> None:
        from safetensors.torch import save

        tensors = {"xvector": f.xvector.contiguous()}
        if f.codes is not None:
            tensors["codes"] = f.codes.contiguous()
        _write_atomic(self._features_file(name), save(tensors, metadata={"sha256": sha256,
                                                                         "transcript": f.transcript}))

    def _load_features(self, name: str, sha256: str) -> VoiceFeatures | None:
        from safetensors import safe_open

        path = self._features_file(name)
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
                if meta.get("sha256") != sha256:
                    return None
                keys = set(fh.keys())
                return VoiceFeatures(fh.get_tensor("xvector"), fh.get_tensor("codes") if "codes" in keys else None,
                                     meta.get("transcript", ""))
        except Exception:  # noqa: BLE001 -- missing or unreadable: computed again
            return None
