"""Checkpoint presets: the released Qwen3-Omni-30B-A3B's configuration, at any depth.

:func:`released_config` is the ``config.json`` of the released checkpoint
(its widths, expert counts, special token ids and speaker map), with every
stack cut to ``layers`` layers when asked (thinker, talker, code predictor,
Code2Wav's transformer, the audio and vision encoders); the settings that
index layers (the talker's ``accept_hidden_layer``, the vision encoder's
``deepstack_visual_indexes``) are moved to the same relative depth, so they
stay valid.

:class:`ConfigCheckpoint` stands in for an opened checkpoint where only the
configuration is known: its tensors' element counts come from the model
built on PyTorch's meta device (no memory, no weights), so the memory plan
(``.memory_plan``) can be computed for a checkpoint that is not here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from .checkpoint import SubConfigs

__all__ = ["RELEASED_LAYERS", "ConfigCheckpoint", "released_config"]

# The released depths (config.json of Qwen3-Omni-30B-A3B-Instruct).
RELEASED_LAYERS = {"thinker": 48, "talker": 20, "code_predictor": 5, "code2wav": 8, "audio": 32, "vision": 27}

_ROPE_TEXT = {"rope_type": "default", "rope_theta": 1_000_000, "mrope_section": [24, 20, 20], "interleaved": True,
              "mrope_interleaved": True}

_RELEASED: dict[str, Any] = {
    "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
    "model_type": "qwen3_omni_moe",
    "torch_dtype": "bfloat16",
    "enable_audio_output": True,
    "im_start_token_id": 151644,
    "im_end_token_id": 151645,
    "system_token_id": 8948,
    "user_token_id": 872,
    "assistant_token_id": 77091,
    "tts_pad_token_id": 151671,
    "tts_bos_token_id": 151672,
    "tts_eos_token_id": 151673,
    "thinker_config": {
        "audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656,
        "audio_start_token_id": 151669, "audio_end_token_id": 151670,
        "vision_start_token_id": 151652, "vision_end_token_id": 151653, "user_token_id": 872,
        "position_id_per_seconds": 13, "seconds_per_chunk": 2, "tie_word_embeddings": False,
        "text_config": {
            "vocab_size": 152064, "hidden_size": 2048, "intermediate_size": 768, "moe_intermediate_size": 768,
            "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "shared_expert_intermediate_size": 0, "max_position_embeddings": 65536,
            "rms_norm_eps": 1e-6, "rope_parameters": dict(_ROPE_TEXT), "tie_word_embeddings": False,
        },
        "audio_config": {
            "num_mel_bins": 128, "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120,
            "d_model": 1280, "output_dim": 2048, "downsample_hidden_size": 480, "n_window": 50,
            "n_window_infer": 800, "conv_chunksize": 500, "max_source_positions": 1500,
        },
        "vision_config": {
            "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 2048,
            "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24], "image_size": 768, "apply_vit_abs_pos_embed": True,
        },
    },
    "talker_config": {
        "accept_hidden_layer": 24, "thinker_hidden_size": 2048, "num_code_groups": 16,
        "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_nothink_id": 2155,
        "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
        "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
        "audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656,
        "audio_start_token_id": 151669, "audio_end_token_id": 151670, "vision_start_token_id": 151652,
        "position_id_per_seconds": 13, "seconds_per_chunk": 2, "spatial_merge_size": 2,
        "text_config": {
            "vocab_size": 3072, "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 384,
            "shared_expert_intermediate_size": 768, "num_hidden_layers": 20, "num_attention_heads": 16,
            "num_key_value_heads": 2, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 6,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "rope_parameters": dict(_ROPE_TEXT),
        },
        "code_predictor_config": {
            "vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 5,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "num_code_groups": 16,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000},
        },
    },
    "code2wav_config": {
        "codebook_size": 2048, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_quantizers": 16, "sliding_window": 72,
        "max_position_embeddings": 8000, "rope_parameters": {"rope_type": "default", "rope_theta": 10000},
        "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "decoder_dim": 1536,
        "layer_scale_initial_scale": 0.01, "rms_norm_eps": 1e-5,
    },
}


def _at_depth(index: int, released: int, layers: int, *, first: int = 0) -> int:
    """A layer index of a stack of `released` layers, at the same relative
    depth in one of `layers`; indexes run from `first` to `layers - 1 + first`."""
    return max(first, min(layers - 1 + first, round(index * layers / released)))


def released_config(layers: int | None = None) -> dict[str, Any]:
    """The released checkpoint's ``config.json`` (a new dict), every stack
    cut to `layers` layers when given (module docstring)."""
    cfg = copy.deepcopy(_RELEASED)
    if layers is None:
        return cfg
    if layers < 1:
        raise ValueError(f"layers: at least 1, got {layers}")
    thinker, talker = cfg["thinker_config"], cfg["talker_config"]
    thinker["text_config"]["num_hidden_layers"] = layers
    thinker["audio_config"]["encoder_layers"] = layers
    vision = thinker["vision_config"]
    vision["depth"] = layers
    vision["deepstack_visual_indexes"] = [_at_depth(i, RELEASED_LAYERS["vision"], layers)
                                          for i in vision["deepstack_visual_indexes"]]
    # the talker's index counts hidden states (0 = the embeddings, i = layer i's output)
    talker["accept_hidden_layer"] = _at_depth(talker["accept_hidden_layer"], RELEASED_LAYERS["thinker"], layers,
                                              first=1)
    talker["text_config"]["num_hidden_layers"] = layers
    talker["code_predictor_config"]["num_hidden_layers"] = layers
    cfg["code2wav_config"]["num_hidden_layers"] = layers
    return cfg


def tensor_numel(config: dict[str, Any]) -> dict[str, int]:
    """Elements of each tensor of a checkpoint with this ``config.json``: the
    model built on the meta device (nothing allocated); MoE experts under
    their fused names (the element counts are the same)."""
    import torch
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(**copy.deepcopy(config)))
    return {name: p.numel() for name, p in model.state_dict().items()}


def stage_numel(config: dict[str, Any]) -> dict[str, int]:
    """Elements of the tensors under each top-level prefix ("thinker.",
    "talker.", "code2wav.") of a checkpoint with this ``config.json``."""
    out: dict[str, int] = {}
    for name, n in tensor_numel(config).items():
        prefix = name.split(".", 1)[0] + "."
        out[prefix] = out.get(prefix, 0) + n
    return out


@dataclass
class ConfigCheckpoint(SubConfigs):
    """What the memory plan and the engine settings read of a checkpoint,
    from its configuration alone (module docstring)."""

    config: dict[str, Any]
    path: str = "(configuration only)"
    _numel: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self._numel:
            self._numel = tensor_numel(self.config)

    def numel(self, prefix: str) -> int:
        """Elements of the tensors named `prefix*` (as ``OmniCheckpoint.numel``)."""
        return sum(n for name, n in self._numel.items() if name.startswith(prefix))
