"""``omni-serving models create --family qwen3-tts`` and ``models check`` of a Qwen3-TTS checkpoint."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["create", "check", "is_tts_dir"]


def _say(command: str, message: str) -> None:
    print(f"omni-serving models {command}: {message}", file=sys.stderr)


def is_tts_dir(path: str) -> bool:
    """Whether the directory's config.json names a Qwen3-TTS model (unreadable: not)."""
    from decoder_svc.qwen3_tts.checkpoint import is_qwen3_tts

    try:
        return is_qwen3_tts(json.loads((Path(path).expanduser() / "config.json").read_text()))
    except (OSError, ValueError):
        return False


def create(args: argparse.Namespace) -> int:
    """A tiny random-weight Qwen3-TTS checkpoint of ``--kind`` in ``--out``."""
    from decoder_svc.qwen3_tts.tiny import create_tiny_checkpoint

    if args.preset != "tiny" or args.layers is not None:
        _say("create", "--family qwen3-tts writes the tiny checkpoint only (no --preset released, no --layers)")
        return 2
    if args.out is None:
        _say("create", "--family qwen3-tts needs --out DIR (a new directory)")
        return 2
    out = Path(args.out)
    if out.exists() or out.is_symlink():
        _say("create", f"{out} exists; give a new directory (an existing one is left untouched)")
        return 2
    try:
        path = create_tiny_checkpoint(out, kind=args.kind, seed=args.seed or 0)
    except FileExistsError as exc:
        _say("create", str(exc))
        return 2
    except OSError as exc:
        _say("create", str(exc))
        return 1
    print(path)
    return 0


def check(directory: str) -> int:
    """Validate a Qwen3-TTS checkpoint as the decoder does, build its talker's view, print a summary."""
    from decoder_svc.qwen3_omni.views import TALKER_PREFIX, check_view
    from decoder_svc.qwen3_tts.backend import talker_view
    from decoder_svc.qwen3_tts.checkpoint import CheckpointError, TTSCheckpoint

    try:
        ckpt = TTSCheckpoint.open(directory)
        view = talker_view(ckpt)
        check_view(view, ckpt, TALKER_PREFIX)
    except CheckpointError as exc:
        _say("check", str(exc))
        return 1
    except OSError as exc:
        _say("check", f"cannot write the talker's view into the model cache: {exc}")
        return 1
    t, cp = ckpt.talker_config, ckpt.talker_config["code_predictor_config"]
    dec = ckpt.speech_config["decoder_config"]
    voices = ", ".join(f"{n} ({i})" for n, i in sorted(ckpt.speakers.items())) or "none (" + (
        "described by instructions" if ckpt.kind == "voice_design" else "cloned from reference clips") + ")"
    rows = [
        ("checkpoint", str(ckpt.path)),
        ("arch", f"{', '.join(ckpt.config.get('architectures', []))} ({ckpt.kind})"),
        ("talker", f"{t['num_hidden_layers']} layers, hidden {t['hidden_size']}, codec vocab {t['vocab_size']}, "
                   f"text vocab {t['text_vocab_size']}"),
        ("predictor", f"{cp['num_hidden_layers']} layers, hidden {cp['hidden_size']}, "
                      f"{cp['num_code_groups']} code groups of {cp['vocab_size']} codes"),
        ("speech", f"12 Hz decoder: {dec['num_hidden_layers']} layers, hidden {dec['hidden_size']}, "
                   f"{dec['num_quantizers']} quantizers, codebook {dec['codebook_size']}"),
        ("voices", voices),
        ("languages", ", ".join(["auto", *sorted(ckpt.languages)])),
        ("fingerprint", ckpt.fingerprint()),
    ]
    for label, value in rows:
        print(f"{label + ':':<12} {value}")
    print(f"{'talker view:':<12} {view.path} ({len(view.shards)} shards, {view.tensors} tensors)")
    return 0
