"""Golden outputs of the Qwen3-TTS reference implementation on the tiny checkpoints.

The reference package (``qwen-tts`` 0.1.1) pins transformers 4.57.3, older
than the project's, so it runs in an environment of its own and its outputs
are committed (``tests/golden/qwen3_tts/``); the parity tests compare the
project's Qwen3-TTS code with them. To regenerate:

    # 1. the tiny checkpoints, with the project's environment
    for kind in custom_voice voice_design base; do
        .venv/bin/omni-serving models create --family qwen3-tts --kind $kind --out /tmp/qwen3-tts/$kind
    done
    # 2. the reference environment (once)
    bash scripts/qwen3_tts_reference_env.sh /tmp/qwen3-tts-ref
    # 3. the golden files
    /tmp/qwen3-tts-ref/bin/python scripts/gen_golden_qwen3_tts.py --models /tmp/qwen3-tts

What is recorded, greedy throughout (``do_sample=False``,
``subtalker_dosample=False``; the other settings are the reference's
defaults, repetition penalty 1.05 included), each case through the
reference's public wrapper (``Qwen3TTSModel.generate_*``) with the codes it
decodes captured on the way:

- ``decode.npz``: seeded random codes and the speech tokenizer's waveform;
- ``encode.npz``: a synthetic reference clip, its codes (the speech
  tokenizer's encoder) and its x-vector (the speaker encoder);
- one ``<kind>_<case>.npz`` per generation case (``CASES``): each item's codes
  ``codes_<i>`` (frames x 16) and waveform ``wav_<i>``;
- ``manifest.json``: the cases' inputs, the versions that made them and the
  SHA-256 of the checkpoints' weight files (a test first checks that the
  project still writes the same tiny checkpoints).

The 25 Hz tokenizer (not used here) imports torchaudio, which has no wheel
for the torch this environment runs; an empty stand-in is installed for it
when torchaudio is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import types
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "tests" / "golden" / "qwen3_tts"
MAX_NEW_TOKENS = 16
SR = 24000

TEXT_A = "Hello world! This is a tiny model."
TEXT_B = "Good morning, how are you today?"
TEXT_C = "The quick brown fox jumps over the lazy dog."

# kind -> case -> the wrapper's arguments (lists: a batch)
CASES: dict[str, dict[str, dict[str, Any]]] = {
    "custom_voice": {
        "single": {"text": TEXT_A, "speaker": "vivian", "language": "English"},
        "streaming_text": {"text": TEXT_B, "speaker": "ryan", "language": "English", "non_streaming_mode": False},
        "batch": {
            "text": [TEXT_A, TEXT_B, TEXT_C],
            "speaker": ["vivian", "ryan", "eric"],
            "language": ["English", "Auto", "Chinese"],
            "instruct": ["", "Speak slowly and calmly.", ""],
        },
    },
    "voice_design": {
        "single": {"text": TEXT_A, "instruct": "A warm, low voice.", "language": "English"},
        "batch": {
            "text": [TEXT_B, TEXT_C],
            "instruct": ["A warm, low voice.", "A bright, fast voice."],
            "language": ["English", "Auto"],
        },
    },
    "base": {
        "xvector": {"text": TEXT_A, "language": "English", "x_vector_only_mode": True},
        "icl": {"text": TEXT_B, "language": "English", "ref_text": "Hello world."},
        "batch": {
            "text": [TEXT_A, TEXT_C],
            "language": ["English", "Auto"],
            "ref_text": [None, "Hello world."],
            "x_vector_only_mode": [True, False],
        },
    },
}


def reference_clip():  # noqa: ANN201
    """A 1.2 s synthetic clip at 24 kHz (a chirp under a slow envelope, seeded noise)."""
    import numpy as np

    t = np.arange(int(1.2 * SR)) / SR
    chirp = np.sin(2 * np.pi * (150 * t + 200 * t * t))
    noise = np.random.default_rng(7).standard_normal(t.shape) * 0.02
    return (0.4 * chirp * np.sin(np.pi * t / 1.2) + noise).astype(np.float32)


def decode_codes():  # noqa: ANN201
    import numpy as np

    return np.random.default_rng(11).integers(0, 2048, size=(30, 16), dtype=np.int64)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _torchaudio_stand_in() -> None:
    import transformers.utils.import_utils  # noqa: F401  (reads the installed packages before the stand-in)

    try:
        import torchaudio  # noqa: F401
    except Exception:  # noqa: BLE001  (no wheel, or one built for another torch)
        mod = types.ModuleType("torchaudio")
        compliance = types.ModuleType("torchaudio.compliance")
        kaldi = types.ModuleType("torchaudio.compliance.kaldi")
        mod.compliance, compliance.kaldi = compliance, kaldi  # type: ignore[attr-defined]
        sys.modules.update({"torchaudio": mod, "torchaudio.compliance": compliance,
                            "torchaudio.compliance.kaldi": kaldi})


def _generate(model: Any, kind: str, args: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """One case through the wrapper; the codes it decodes are captured from ``model.model.generate``."""
    captured: list[Any] = []
    inner = model.model.generate

    def recording(*a: Any, **kw: Any) -> Any:
        codes, hidden = inner(*a, **kw)
        captured.extend(c.detach().cpu().numpy() for c in codes)
        return codes, hidden

    model.model.generate = recording
    greedy = {"do_sample": False, "subtalker_dosample": False, "max_new_tokens": MAX_NEW_TOKENS}
    try:
        if kind == "custom_voice":
            wavs, sr = model.generate_custom_voice(**args, **greedy)
        elif kind == "voice_design":
            wavs, sr = model.generate_voice_design(**args, **greedy)
        else:
            n = len(args["text"]) if isinstance(args["text"], list) else 1
            clip = (reference_clip(), SR)
            wavs, sr = model.generate_voice_clone(ref_audio=[clip] * n if n > 1 else clip, **args, **greedy)
    finally:
        model.model.generate = inner
    assert sr == SR, sr
    return captured, list(wavs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, required=True, help="a folder with custom_voice/, voice_design/, base/")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    args = p.parse_args(argv)

    _torchaudio_stand_in()
    from importlib.metadata import version

    import numpy as np
    import torch
    import transformers
    from qwen_tts import Qwen3TTSModel

    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {
        "reference": {"qwen-tts": version("qwen-tts"), "transformers": transformers.__version__,
                      "torch": torch.__version__},
        "max_new_tokens": MAX_NEW_TOKENS,
        "checkpoints": {},
        "cases": {},
    }
    for kind, cases in CASES.items():
        path = args.models / kind
        manifest["checkpoints"][kind] = {
            "model.safetensors": sha256(path / "model.safetensors"),
            "speech_tokenizer/model.safetensors": sha256(path / "speech_tokenizer" / "model.safetensors"),
        }
        model = Qwen3TTSModel.from_pretrained(str(path), device_map="cpu", dtype=torch.float32,
                                              attn_implementation="eager")
        if kind == "custom_voice":
            codes = decode_codes()
            wavs, sr = model.model.speech_tokenizer.decode([{"audio_codes": torch.from_numpy(codes)}])
            np.savez(args.out / "decode.npz", codes=codes, wav=np.asarray(wavs[0], dtype=np.float32))
        if kind == "base":
            clip = reference_clip()
            enc = model.model.speech_tokenizer.encode([clip], sr=SR)
            xvec = model.model.extract_speaker_embedding(audio=clip, sr=SR)
            np.savez(args.out / "encode.npz", clip=clip, codes=enc.audio_codes[0].cpu().numpy(),
                     xvector=xvec.detach().cpu().numpy().astype(np.float32))
        for case, case_args in cases.items():
            codes_list, wavs = _generate(model, kind, case_args)
            arrays = {f"codes_{i}": c for i, c in enumerate(codes_list)}
            arrays.update({f"wav_{i}": np.asarray(w, dtype=np.float32) for i, w in enumerate(wavs)})
            name = f"{kind}_{case}.npz"
            np.savez(args.out / name, **arrays)
            manifest["cases"][f"{kind}/{case}"] = {"file": name, "args": case_args,
                                                   "frames": [int(c.shape[0]) for c in codes_list]}
            print(f"{kind}/{case}: frames {[int(c.shape[0]) for c in codes_list]}", flush=True)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
