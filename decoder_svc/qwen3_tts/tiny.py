"""A tiny random-weight Qwen3-TTS (12 Hz) checkpoint in the released layout.

``create_tiny_checkpoint(out_dir, kind=...)`` writes what a released
Qwen3-TTS directory holds (:mod:`.layout`), at toy sizes, for one of the
three kinds (``custom_voice``, ``voice_design``, ``base``):

- ``config.json``: ``Qwen3TTSForConditionalGeneration`` with the released
  conventions the config classes' defaults get wrong (16 code groups, the
  codec special ids 2148-2157, the language ids, ``rope_scaling`` with an
  interleaved ``mrope_section``, ``text_vocab_size``), the speakers of the
  ``custom_voice`` kind, the speaker encoder of the ``base`` kind at the
  talker's width; written with ``json.dump`` (the reference's speaker
  encoder config takes no other key);
- ``generation_config.json`` (the released sampling settings),
  ``model.safetensors`` (``talker.*``, and ``speaker_encoder.*`` for
  ``base``), ``preprocessor_config.json``;
- a Qwen2 tokenizer as released (``vocab.json``, ``merges.txt``,
  ``tokenizer_config.json``, no ``tokenizer.json``): a byte-level BPE
  trained offline whose special tokens have the ids ``config.json`` names;
- ``speech_tokenizer/``: ``config.json`` (``qwen3_tts_tokenizer_12hz``), its
  ``preprocessor_config.json`` and ``model.safetensors`` with a Mimi encoder
  (``encoder.*``, transformers' ``MimiModel`` less its decoder side) and the
  12 Hz decoder (``decoder.*``).

The talker's code predictor is narrower than the talker (as at 1.7B), so the
``small_to_mtp_projection`` is exercised. The talker's head_dim is 64, what
vLLM's CPU attention takes. Weights come from a seeded generator in name
order: the same seed and kind write the same bytes. Heavy imports happen
inside the functions.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .layout import (
    ARCHITECTURE,
    KINDS,
    SPEECH_TOKENIZER_DIR,
    speaker_encoder_tensors,
    speech_decoder_tensors,
    talker_tensors,
)

__all__ = ["TINY_FORMAT", "SPECIAL_TOKENS", "SPEAKERS", "LANGUAGES", "create_tiny_checkpoint", "tiny_config"]

# Bumped whenever the tiny checkpoint's content changes.
TINY_FORMAT = 1

# Token ids 0.. in this order (the BPE trainer assigns special tokens first).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "system",
    "user",
    "assistant",
)
_ID = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
VOCAB_SIZE = 1024

# The released codec ids of the languages (CustomVoice adds the dialects).
LANGUAGES: dict[str, int] = {
    "chinese": 2055,
    "english": 2050,
    "german": 2053,
    "italian": 2070,
    "portuguese": 2071,
    "spanish": 2054,
    "japanese": 2058,
    "korean": 2064,
    "french": 2061,
    "russian": 2069,
}
DIALECTS: dict[str, int] = {"beijing_dialect": 2074, "sichuan_dialect": 2062}
# Speakers of the custom_voice kind: codec id, and the dialect a Chinese request in that voice speaks.
SPEAKERS: dict[str, int] = {"vivian": 3065, "ryan": 3061, "eric": 2875, "dylan": 2878}
SPEAKER_DIALECTS: dict[str, Any] = {"vivian": False, "ryan": False, "eric": "sichuan_dialect", "dylan": "beijing_dialect"}

HIDDEN = 128
HEAD_DIM = 64

GENERATION_CONFIG: dict[str, Any] = {
    "do_sample": True,
    "repetition_penalty": 1.05,
    "temperature": 0.9,
    "top_p": 1.0,
    "top_k": 50,
    "subtalker_dosample": True,
    "subtalker_temperature": 0.9,
    "subtalker_top_p": 1.0,
    "subtalker_top_k": 50,
    "max_new_tokens": 8192,
}


def tiny_config(kind: str) -> dict[str, Any]:
    """``config.json`` of the tiny checkpoint of ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"kind: one of {', '.join(KINDS)}, got {kind!r}")
    custom = kind == "custom_voice"
    talker = {
        "model_type": "qwen3_tts_talker",
        "vocab_size": 3072,
        "hidden_size": HIDDEN,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000,
        "rope_scaling": {"rope_type": "default", "mrope_section": [12, 10, 10], "interleaved": True},
        "attention_bias": False,
        "use_sliding_window": False,
        "position_id_per_seconds": 13,
        "num_code_groups": 16,
        "text_hidden_size": 64,
        "text_vocab_size": VOCAB_SIZE,
        "codec_eos_token_id": 2150,
        "codec_think_id": 2154,
        "codec_nothink_id": 2155,
        "codec_think_bos_id": 2156,
        "codec_think_eos_id": 2157,
        "codec_pad_id": 2148,
        "codec_bos_id": 2149,
        "codec_language_id": {**LANGUAGES, **(DIALECTS if custom else {})},
        "spk_id": dict(SPEAKERS) if custom else {},
        "spk_is_dialect": dict(SPEAKER_DIALECTS) if custom else {},
        "code_predictor_config": {
            "model_type": "qwen3_tts_talker_code_predictor",
            "vocab_size": 2048,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "hidden_act": "silu",
            "max_position_embeddings": 65536,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000,
            "rope_scaling": None,
            "use_sliding_window": False,
            "layer_types": ["full_attention", "full_attention"],
            "num_code_groups": 16,
        },
    }
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_size": "1b7",  # the reference ignores instructions to a 0b6 custom_voice model
        "tts_model_type": kind,
        "im_start_token_id": _ID["<|im_start|>"],
        "im_end_token_id": _ID["<|im_end|>"],
        "tts_pad_token_id": _ID["<tts_pad>"],
        "tts_bos_token_id": _ID["<tts_text_bos>"],
        "tts_eos_token_id": _ID["<tts_text_eod>"],
        "assistant_token_id": _ID["assistant"],
        "talker_config": talker,
        "dtype": "float32",
    }
    # every kind's reference reads speaker_encoder_config.sample_rate; base also builds the encoder from it
    cfg["speaker_encoder_config"] = {"sample_rate": 24000}
    if kind == "base":
        cfg["speaker_encoder_config"] = {
            "mel_dim": 128,
            "enc_dim": HIDDEN,  # the x-vector takes a codec token's place in the talker's input
            "enc_channels": [32, 32, 32, 32, 96],
            "enc_kernel_sizes": [5, 3, 3, 3, 1],
            "enc_dilations": [1, 2, 3, 4, 1],
            "enc_attention_channels": 16,
            "enc_res2net_scale": 8,
            "enc_se_channels": 16,
            "sample_rate": 24000,
        }
    return cfg


def speech_tokenizer_config() -> dict[str, Any]:
    """``speech_tokenizer/config.json``: a tiny Mimi encoder and 12 Hz decoder (1920 samples a frame)."""
    return {
        "architectures": ["Qwen3TTSTokenizerV2Model"],
        "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_valid_num_quantizers": 16,
        "input_sample_rate": 24000,
        "output_sample_rate": 24000,
        "decode_upsample_rate": 1920,
        "encode_downsample_rate": 1920,
        "encoder_config": {
            "audio_channels": 1,
            "num_filters": 8,
            "kernel_size": 7,
            "residual_kernel_size": 3,
            "last_kernel_size": 3,
            "num_residual_layers": 1,
            "compress": 2,
            "upsampling_ratios": [8, 6, 5, 4],
            "upsample_groups": 64,
            "hidden_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 128,
            "hidden_act": "gelu",
            "norm_eps": 1e-5,
            "layer_scale_initial_scale": 0.01,
            "rope_theta": 10000.0,
            "max_position_embeddings": 8000,
            "sliding_window": 250,
            "num_quantizers": 32,
            "num_semantic_quantizers": 1,
            "codebook_size": 2048,
            "codebook_dim": 32,
            "vector_quantization_hidden_dimension": 32,
            "frame_rate": 12.5,
            "sampling_rate": 24000,
            "pad_mode": "constant",
            "use_causal_conv": True,
        },
        "decoder_config": {
            "codebook_size": 2048,
            "codebook_dim": 32,
            "hidden_size": 64,
            "latent_dim": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "hidden_act": "silu",
            "attention_bias": False,
            "sliding_window": 72,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000,
            "max_position_embeddings": 8000,
            "layer_scale_initial_scale": 0.01,
            "num_quantizers": 16,
            "num_semantic_quantizers": 1,
            "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2],
            "decoder_dim": 64,
        },
    }


_FEATURES = {
    "feature_extractor_type": "EncodecFeatureExtractor",
    "feature_size": 1,
    "sampling_rate": 24000,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "chunk_length_s": None,
    "overlap": None,
}


def _value(name: str, shape: tuple[int, ...], gen: Any) -> Any:
    """One tensor's seeded value: norms 1, biases 0, snake parameters 0 (log
    scale), layer scales 0.01, codebooks audible, convolutions of the audio
    path variance-preserving, the rest N(0, 0.02)."""
    import math

    import numpy as np

    last = name.rsplit(".", 1)[-1]
    if name.endswith(("norm.weight", "layernorm.weight", "cluster_usage")) or last == "initialized":
        return np.ones(shape)
    if last in ("alpha", "beta") or (len(shape) == 1 and last == "bias"):
        return np.zeros(shape)
    if last == "scale":
        return np.full(shape, 0.01)
    if name.endswith(("embedding_sum", "embed_sum")):
        return gen.standard_normal(shape) * 0.5
    audio = name.startswith(("decoder.", "encoder.", "speaker_encoder."))
    if audio and len(shape) >= 2:
        return gen.standard_normal(shape) * (0.75 / math.prod(shape[1:]) ** 0.5)
    return gen.standard_normal(shape) * 0.02


def _tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, Any]:
    """Seeded values in name order; numpy's generator, whose draws are the same on every host."""
    import numpy as np
    import torch

    gen = np.random.default_rng(int(seed))
    return {
        name: torch.from_numpy(np.ascontiguousarray(_value(name, shapes[name], gen), dtype=np.float32))
        for name in sorted(shapes)
    }


def _mimi_encoder_shapes(encoder_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The Mimi encoder's tensors (``encoder.*``), as transformers' ``MimiModel`` names them."""
    from omni_common import torchvision_compat

    torchvision_compat.install()  # before transformers' models
    from transformers import MimiConfig, MimiModel

    model = MimiModel(MimiConfig(**encoder_config))
    dropped = ("upsample.", "decoder_transformer.", "decoder.")
    return {
        f"encoder.{k}": tuple(v.shape)
        for k, v in model.state_dict().items()
        if not k.startswith(dropped)
    }


def _write_tokenizer(out_dir: Path) -> None:
    from decoder_svc.qwen3_omni.tiny import train_bpe

    tok = train_bpe(SPECIAL_TOKENS, VOCAB_SIZE)
    tok.model.save(str(out_dir))  # vocab.json, merges.txt
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    cfg = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "add_prefix_space": False,
    }
    _dump(out_dir / "tokenizer_config.json", cfg)


def _dump(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def create_tiny_checkpoint(out_dir: str | Path, *, kind: str = "custom_voice", seed: int = 0) -> Path:
    """Write the tiny checkpoint of ``kind`` into ``out_dir`` (atomically: a
    temporary sibling renamed into place; an existing ``out_dir`` is refused)."""
    from safetensors.torch import save_file

    cfg = tiny_config(kind)
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; the tiny checkpoint is only written to a new directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        shapes = talker_tensors(cfg["talker_config"])
        if kind == "base":
            shapes.update(speaker_encoder_tensors(cfg["speaker_encoder_config"]))
        save_file(_tensors(shapes, seed), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _dump(tmp / "config.json", cfg)
        _dump(tmp / "generation_config.json", GENERATION_CONFIG)
        _dump(tmp / "preprocessor_config.json", {"processor_class": "Qwen3TTSProcessor"})
        _write_tokenizer(tmp)
        speech = tmp / SPEECH_TOKENIZER_DIR
        speech.mkdir()
        st = speech_tokenizer_config()
        st_shapes = _mimi_encoder_shapes(st["encoder_config"])
        st_shapes.update(speech_decoder_tensors(st["decoder_config"]))
        save_file(_tensors(st_shapes, seed + 1), str(speech / "model.safetensors"), metadata={"format": "pt"})
        _dump(speech / "config.json", st)
        _dump(speech / "preprocessor_config.json", _FEATURES)
        _dump(tmp / "omni_serving_tiny.json", {"family": "qwen3_tts", "kind": kind, "format": TINY_FORMAT,
                                               "seed": int(seed)})
        os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
