"""A tiny random-weight Qwen3-Omni-MoE checkpoint in the released layout.

``create_tiny_checkpoint(out_dir)`` writes what a user's real checkpoint
directory holds, at toy sizes:

- ``config.json``: ``Qwen3OmniMoeForConditionalGeneration`` with thinker,
  talker (code predictor inside) and code2wav configs, built with the
  transformers config classes and the released checkpoint's conventions
  (codec special ids, speaker map, 16 code groups), not the class defaults;
- ``model.safetensors`` (+ ``model.safetensors.index.json``): ``thinker.*``,
  ``talker.*`` and ``code2wav.*`` tensors under the released names (MoE
  experts one per key);
- a byte-level BPE tokenizer trained offline (no hub) whose special tokens
  (``<|im_start|>``, ``<tts_pad>``, the role words ...) have the ids that
  ``config.json`` names, and the chat template;
- ``generation_config.json`` with the sampling settings serving reads.

Sizes follow what vLLM's CPU kernels accept: head_dim 64 (CPU attention),
hidden and MoE intermediate sizes that are multiples of 32 (CPU fused MoE).
Weights are drawn from a seeded generator: the same seed writes the same
bytes. Heavy imports happen inside the functions.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["create_tiny_checkpoint", "train_bpe", "TINY_FORMAT", "SPECIAL_TOKENS", "SPEAKERS", "CHAT_TEMPLATE"]

# Bumped whenever the tiny checkpoint's content changes (the model cache keys on it).
TINY_FORMAT = 4

# Token ids 0.. in this order (the BPE trainer assigns special tokens first).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "system",
    "user",
    "assistant",
)
_ID = {t: i for i, t in enumerate(SPECIAL_TOKENS)}

# Released speaker map (lower-case names -> codec ids).
SPEAKERS: dict[str, int] = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}

# The released chat template's conventions, text and media: roles in
# <|im_start|> ... <|im_end|> blocks; content a string or a list of parts:
# text, and audio / image parts written as their placeholders (the
# processor expands each pad token to the clip's or image's tokens).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ('audio', 'input_audio', 'audio_url') %}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{%- elif part['type'] in ('image', 'image_url') %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The tokenizer attributes the released tokenizer config names (the
# processor reads them to find the placeholders).
MEDIA_TOKENS: dict[str, str] = {
    "audio_token": "<|audio_pad|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
}

_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny omni model that reads text and speaks it.",
    "A thinker reads the prompt and writes text; a talker turns text into speech codes.",
    "The code predictor fills the remaining codebooks for every audio frame.",
    "Streams of tokens are decoded step by step, and each step samples one token per request.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2026 3.14 42.",
    "Punctuation, quotes \"like this\", (parentheses), [brackets] and {braces}; colons: yes.",
    "She sells sea shells by the sea shore, and the shells she sells are sea shells.",
    "How are you today? I am fine, thank you. What is the weather like in the city?",
    "Please read the following sentence aloud in a calm and friendly voice.",
    "Once upon a time there was a small model that could only say a few words.",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "Good morning, good afternoon, good evening and good night to everyone here.",
    "Speech synthesis converts written text into spoken audio at 24 kHz.",
    "The server answers over gRPC with partial results while decoding continues.",
)

VOCAB_SIZE = 1024
HIDDEN = 128
HEAD_DIM = 64


def chat_tokenizer(tok, *, model_max_length: int):  # noqa: ANN001, ANN201
    """A ``tokenizers.Tokenizer`` as the ``PreTrainedTokenizerFast`` a checkpoint
    saves: end of turn ``<|im_end|>``, padding ``<|endoftext|>``, the chat template."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        extra_special_tokens=dict(MEDIA_TOKENS),
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def train_bpe(special_tokens: tuple[str, ...], vocab_size: int = VOCAB_SIZE):  # noqa: ANN201
    """A byte-level BPE ``tokenizers.Tokenizer`` trained offline on a small
    English corpus, ``special_tokens`` first (ids 0.. in their order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    return tok


def _tokenizer():
    fast = chat_tokenizer(train_bpe(SPECIAL_TOKENS), model_max_length=2048)
    for t in SPECIAL_TOKENS:  # the ids config.json names
        assert fast.convert_tokens_to_ids(t) == _ID[t], t
    return fast


def _config():
    from transformers import Qwen3OmniMoeConfig

    # as released: the key vLLM reads is mrope_interleaved (without it, vLLM's
    # thinker would lay the T/H/W sections out unlike the reference: image
    # positions differ; text and audio positions, equal in all three, do not)
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [12, 10, 10], "interleaved": True,
            "mrope_interleaved": True}
    thinker = {
        "text_config": {
            "vocab_size": VOCAB_SIZE,
            "hidden_size": HIDDEN,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": HEAD_DIM,
            "moe_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "max_position_embeddings": 4096,
            "rope_parameters": dict(rope),
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-6,
        },
        "audio_config": {
            "num_mel_bins": 128,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 256,
            "d_model": HIDDEN,
            "output_dim": HIDDEN,
            "downsample_hidden_size": 32,
            "n_window": 50,
            "n_window_infer": 400,
            "conv_chunksize": 500,
            "max_source_positions": 1500,
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": HIDDEN,
            "intermediate_size": 256,
            "num_heads": 2,
            "out_hidden_size": HIDDEN,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [0, 1],
            "image_size": 768,
            "apply_vit_abs_pos_embed": True,
        },
        "audio_token_id": _ID["<|audio_pad|>"],
        "image_token_id": _ID["<|image_pad|>"],
        "video_token_id": _ID["<|video_pad|>"],
        "audio_start_token_id": _ID["<|audio_start|>"],
        "vision_start_token_id": _ID["<|vision_start|>"],
        "user_token_id": _ID["user"],
        "position_id_per_seconds": 13,
        "tie_word_embeddings": False,
    }
    talker = {
        "text_config": {
            "vocab_size": 3072,
            "hidden_size": HIDDEN,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": HEAD_DIM,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": HIDDEN,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
            "max_position_embeddings": 4096,
            "rope_parameters": dict(rope),
            "rms_norm_eps": 1e-6,
        },
        "code_predictor_config": {
            "vocab_size": 2048,
            "hidden_size": HIDDEN,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": HEAD_DIM,
            "num_code_groups": 16,
            "max_position_embeddings": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "rms_norm_eps": 1e-6,
        },
        "num_code_groups": 16,
        "thinker_hidden_size": HIDDEN,
        "accept_hidden_layer": 1,
        "codec_pad_id": 2148,
        "codec_bos_id": 2149,
        "codec_eos_token_id": 2150,
        "codec_nothink_id": 2155,
        "codec_think_bos_id": 2156,
        "codec_think_eos_id": 2157,
        "speaker_id": dict(SPEAKERS),
        "audio_token_id": _ID["<|audio_pad|>"],
        "image_token_id": _ID["<|image_pad|>"],
        "video_token_id": _ID["<|video_pad|>"],
        "vision_start_token_id": _ID["<|vision_start|>"],
        "audio_start_token_id": _ID["<|audio_start|>"],
        "position_id_per_seconds": 13,
        "spatial_merge_size": 2,
    }
    code2wav = {
        "codebook_size": 2048,
        "hidden_size": HIDDEN,
        "max_position_embeddings": 8000,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "sliding_window": 72,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_quantizers": 16,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 64,
        "layer_scale_initial_scale": 0.01,
    }
    cfg = Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=True,
        im_start_token_id=_ID["<|im_start|>"],
        im_end_token_id=_ID["<|im_end|>"],
        tts_pad_token_id=_ID["<tts_pad>"],
        tts_bos_token_id=_ID["<tts_text_bos>"],
        tts_eos_token_id=_ID["<tts_text_eod>"],
        system_token_id=_ID["system"],
        user_token_id=_ID["user"],
        assistant_token_id=_ID["assistant"],
    )
    cfg.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    cfg.dtype = "float32"
    return cfg


# Sampling defaults serving reads from generation_config.json (the values of
# the reference ``generate()`` signature; code predictor: its hard-coded top-k/p).
GENERATION_CONFIG: dict[str, Any] = {
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "eos_token_id": _ID["<|im_end|>"],
    "pad_token_id": _ID["<|endoftext|>"],
    "talker_temperature": 0.9,
    "talker_top_k": 50,
    "talker_top_p": 1.0,
    "talker_repetition_penalty": 1.05,
    "code_predictor_temperature": 1.0,
    "code_predictor_top_k": 50,
    "code_predictor_top_p": 0.8,
}


def _randomize(model, seed: int) -> None:
    """Deterministic weights from our own generator, independent of init order."""
    import torch

    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight") or name.endswith("norm1.weight") or name.endswith("norm2.weight"):
                p.fill_(1.0)
            elif ".alpha" in name or ".beta" in name or name.endswith("scale"):
                # SnakeBeta (log-scale parameters) and layer scales keep their init values.
                continue
            elif p.dim() == 1:
                p.zero_()
            elif name.startswith("code2wav.decoder") or name.startswith("code2wav.upsample"):
                # variance-preserving convolutions: the waveform comes out as
                # audible noise instead of near-denormal values
                p.copy_(torch.randn(p.shape, generator=gen) * (0.75 / float(p[0].numel()) ** 0.5))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        # code2wav's codebook embeddings: larger, so the decoder's output is
        # audible noise rather than near-denormal values.
        for name, p in model.named_parameters():
            if name.startswith("code2wav.code_embedding"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def create_tiny_checkpoint(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny checkpoint into ``out_dir`` (atomically: a temporary
    sibling renamed into place; an existing ``out_dir`` is refused)."""
    import torch
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; the tiny checkpoint is only written to a new directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        torch.manual_seed(seed)
        cfg = _config()
        model = Qwen3OmniMoeForConditionalGeneration(cfg).to(torch.float32).eval()
        _randomize(model, seed)
        model.generation_config = GenerationConfig(
            **{k: v for k, v in GENERATION_CONFIG.items() if not k.startswith(("talker_", "code_predictor_"))}
        )
        model.save_pretrained(tmp, safe_serialization=True)
        # Released checkpoints keep the talker/code-predictor settings in
        # generation_config.json too.
        gen_path = tmp / "generation_config.json"
        gen = json.loads(gen_path.read_text())
        gen.update(GENERATION_CONFIG)
        gen_path.write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
        _tokenizer().save_pretrained(tmp)
        (tmp / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
        write_preprocessor_config(tmp, patch_size=int(cfg.thinker_config.vision_config.patch_size))
        _write_index(tmp)
        (tmp / "omni_serving_tiny.json").write_text(json.dumps({"format": TINY_FORMAT, "seed": int(seed)}) + "\n")
        os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


# The released checkpoint's preprocessor_config.json: Whisper-style log-mel
# features (128 bins, 16 kHz, 10 ms hop) for the audio tower, and the
# vision tower's image processor (patches of its patch size, 2x2 merged).
PREPROCESSOR_CONFIG: dict[str, Any] = {
    "processor_class": "Qwen3OmniMoeProcessor",
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "sampling_rate": 16000,
    "hop_length": 160,
    "n_fft": 400,
    "chunk_length": 300,
    "n_samples": 4800000,
    "nb_max_frames": 30000,
    "padding_side": "right",
    "padding_value": 0.0,
    "dither": 0.0,
    "return_attention_mask": True,
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "rescale_factor": 1 / 255,
    "resample": 3,
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "merge_size": 2,
    "temporal_patch_size": 2,
}


def write_preprocessor_config(out_dir: Path, *, patch_size: int) -> None:
    """The processor's settings (audio features, images) as released checkpoints ship them."""
    cfg = dict(PREPROCESSOR_CONFIG, patch_size=patch_size)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _write_index(out_dir: Path) -> None:
    """A weight index as released checkpoints ship (also for a single file)."""
    from safetensors import safe_open

    index_path = out_dir / "model.safetensors.index.json"
    if index_path.exists():
        return
    weights = out_dir / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        names = sorted(f.keys())
    index = {"metadata": {"total_size": weights.stat().st_size}, "weight_map": {n: weights.name for n in names}}
    index_path.write_text(json.dumps(index, indent=2) + "\n")
