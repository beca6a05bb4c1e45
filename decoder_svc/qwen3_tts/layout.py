"""The released Qwen3-TTS (12 Hz) checkpoint layout: which tensors, named how, shaped how.

A Qwen3-TTS checkpoint directory holds ``config.json`` (``model_type``
``qwen3_tts``, architecture ``Qwen3TTSForConditionalGeneration``) with a
``talker_config`` (its ``code_predictor_config`` inside) and, for the
``base`` kind, a ``speaker_encoder_config``; ``model.safetensors`` with the
``talker.*`` (and ``speaker_encoder.*``) tensors; a Qwen2 tokenizer; and
``speech_tokenizer/``, the 12 Hz codec, whose ``model.safetensors`` holds
``encoder.*`` (a Mimi encoder: reference clips to codes) and ``decoder.*``
(codes to 24 kHz audio).

The functions here give, from a config dict, every tensor the released
layout has and its shape (``{name: shape}``), so that one description both
writes the tiny checkpoint (:mod:`.tiny`) and checks a user's
(:mod:`.checkpoint`). The Mimi encoder's tensors are transformers' own
(``MimiModel``) and are not listed here.

Pure Python: nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "ARCHITECTURE",
    "KINDS",
    "SPEECH_TOKENIZER_DIR",
    "Shapes",
    "attention_tensors",
    "head_dim",
    "speaker_encoder_tensors",
    "speech_decoder_tensors",
    "talker_tensors",
]

ARCHITECTURE = "Qwen3TTSForConditionalGeneration"
SPEECH_TOKENIZER_DIR = "speech_tokenizer"
# config.json tts_model_type: named speakers (+ style instructions), a voice
# described in words, a voice cloned from reference audio
KINDS = ("custom_voice", "voice_design", "base")

Shapes = dict[str, tuple[int, ...]]


def head_dim(cfg: Mapping[str, Any]) -> int:
    """``head_dim`` as the reference reads it (its value, else hidden / heads)."""
    return int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))


def attention_tensors(prefix: str, cfg: Mapping[str, Any], *, qk_norm: bool = True) -> Shapes:
    """One Qwen3-style decoder layer's tensors (attention with q/k norms, gated MLP, two RMS norms)."""
    h, i = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    nh, nkv, d = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]), head_dim(cfg)
    out: Shapes = {
        f"{prefix}self_attn.q_proj.weight": (nh * d, h),
        f"{prefix}self_attn.k_proj.weight": (nkv * d, h),
        f"{prefix}self_attn.v_proj.weight": (nkv * d, h),
        f"{prefix}self_attn.o_proj.weight": (h, nh * d),
        f"{prefix}mlp.gate_proj.weight": (i, h),
        f"{prefix}mlp.up_proj.weight": (i, h),
        f"{prefix}mlp.down_proj.weight": (h, i),
        f"{prefix}input_layernorm.weight": (h,),
        f"{prefix}post_attention_layernorm.weight": (h,),
    }
    if qk_norm:
        out[f"{prefix}self_attn.q_norm.weight"] = (d,)
        out[f"{prefix}self_attn.k_norm.weight"] = (d,)
    return out


def talker_tensors(talker: Mapping[str, Any]) -> Shapes:
    """``talker.*``: the talker, its text embedding and projection, and its code predictor."""
    cp = talker["code_predictor_config"]
    big, small = int(talker["hidden_size"]), int(cp["hidden_size"])
    text_h, vocab = int(talker["text_hidden_size"]), int(talker["vocab_size"])
    groups = int(talker["num_code_groups"])
    out: Shapes = {}
    for n in range(int(talker["num_hidden_layers"])):
        out.update(attention_tensors(f"talker.model.layers.{n}.", talker))
    out.update(
        {
            "talker.model.norm.weight": (big,),
            "talker.model.codec_embedding.weight": (vocab, big),
            "talker.model.text_embedding.weight": (int(talker["text_vocab_size"]), text_h),
            "talker.text_projection.linear_fc1.weight": (text_h, text_h),
            "talker.text_projection.linear_fc1.bias": (text_h,),
            "talker.text_projection.linear_fc2.weight": (big, text_h),
            "talker.text_projection.linear_fc2.bias": (big,),
            "talker.codec_head.weight": (vocab, big),
        }
    )
    for n in range(int(cp["num_hidden_layers"])):
        out.update(attention_tensors(f"talker.code_predictor.model.layers.{n}.", cp))
    out["talker.code_predictor.model.norm.weight"] = (small,)
    for g in range(groups - 1):
        # the residual codebooks' embeddings are at the talker's width
        out[f"talker.code_predictor.model.codec_embedding.{g}.weight"] = (int(cp["vocab_size"]), big)
        out[f"talker.code_predictor.lm_head.{g}.weight"] = (int(cp["vocab_size"]), small)
    if small != big:
        out["talker.code_predictor.small_to_mtp_projection.weight"] = (small, big)
        out["talker.code_predictor.small_to_mtp_projection.bias"] = (small,)
    return out


_SPEAKER_DEFAULTS: dict[str, Any] = {
    "mel_dim": 128,
    "enc_dim": 1024,
    "enc_channels": [512, 512, 512, 512, 1536],
    "enc_kernel_sizes": [5, 3, 3, 3, 1],
    "enc_dilations": [1, 2, 3, 4, 1],
    "enc_attention_channels": 128,
    "enc_res2net_scale": 8,
    "enc_se_channels": 128,
}


def speaker_encoder_tensors(raw: Mapping[str, Any]) -> Shapes:
    """``speaker_encoder.*`` (the ``base`` kind's ECAPA-TDNN x-vector model; every conv has a bias)."""
    cfg = {**_SPEAKER_DEFAULTS, **raw}
    ch, ks = [int(c) for c in cfg["enc_channels"]], [int(k) for k in cfg["enc_kernel_sizes"]]
    scale, se, att = int(cfg["enc_res2net_scale"]), int(cfg["enc_se_channels"]), int(cfg["enc_attention_channels"])
    out: Shapes = {}

    def conv(name: str, c_out: int, c_in: int, k: int) -> None:
        out[f"speaker_encoder.{name}.weight"] = (c_out, c_in, k)
        out[f"speaker_encoder.{name}.bias"] = (c_out,)

    conv("blocks.0.conv", ch[0], int(cfg["mel_dim"]), ks[0])
    for b in range(1, len(ch) - 1):
        conv(f"blocks.{b}.tdnn1.conv", ch[b], ch[b - 1], 1)
        for r in range(scale - 1):
            conv(f"blocks.{b}.res2net_block.blocks.{r}.conv", ch[b] // scale, ch[b] // scale, ks[b])
        conv(f"blocks.{b}.tdnn2.conv", ch[b], ch[b], 1)
        conv(f"blocks.{b}.se_block.conv1", se, ch[b], 1)
        conv(f"blocks.{b}.se_block.conv2", ch[b], se, 1)
    conv("mfa.conv", ch[-1], ch[-1], ks[-1])
    conv("asp.tdnn.conv", att, ch[-1] * 3, 1)
    conv("asp.conv", ch[-1], att, 1)
    conv("fc", int(cfg["enc_dim"]), ch[-1] * 2, 1)
    return out


def speech_decoder_tensors(dec: Mapping[str, Any]) -> Shapes:
    """``decoder.*`` of ``speech_tokenizer/model.safetensors``: codes -> 24 kHz audio."""
    cd, latent, hidden = int(dec["codebook_dim"]), int(dec["latent_dim"]), int(dec["hidden_size"])
    bins, dim = int(dec["codebook_size"]), int(dec["decoder_dim"])
    q = cd // 2
    out: Shapes = {}
    for part, n_q in (("rvq_first", 1), ("rvq_rest", int(dec["num_quantizers"]) - 1)):
        out[f"decoder.quantizer.{part}.input_proj.weight"] = (q, cd, 1)
        out[f"decoder.quantizer.{part}.output_proj.weight"] = (cd, q, 1)
        for n in range(n_q):
            out[f"decoder.quantizer.{part}.vq.layers.{n}._codebook.cluster_usage"] = (bins,)
            out[f"decoder.quantizer.{part}.vq.layers.{n}._codebook.embedding_sum"] = (bins, q)
    out["decoder.pre_conv.conv.weight"] = (latent, cd, 3)
    out["decoder.pre_conv.conv.bias"] = (latent,)
    tr = "decoder.pre_transformer."
    out.update(
        {
            f"{tr}input_proj.weight": (hidden, latent),
            f"{tr}input_proj.bias": (hidden,),
            f"{tr}output_proj.weight": (latent, hidden),
            f"{tr}output_proj.bias": (latent,),
            f"{tr}norm.weight": (hidden,),
        }
    )
    for n in range(int(dec["num_hidden_layers"])):
        layer = f"{tr}layers.{n}."
        out.update(attention_tensors(layer, dec, qk_norm=False))
        out[f"{layer}self_attn_layer_scale.scale"] = (hidden,)
        out[f"{layer}mlp_layer_scale.scale"] = (hidden,)
    for k, factor in enumerate(dec["upsampling_ratios"]):
        up = f"decoder.upsample.{k}."
        out.update(
            {
                f"{up}0.conv.weight": (latent, latent, int(factor)),
                f"{up}0.conv.bias": (latent,),
                f"{up}1.dwconv.conv.weight": (latent, 1, 7),
                f"{up}1.dwconv.conv.bias": (latent,),
                f"{up}1.norm.weight": (latent,),
                f"{up}1.norm.bias": (latent,),
                f"{up}1.pwconv1.weight": (4 * latent, latent),
                f"{up}1.pwconv1.bias": (4 * latent,),
                f"{up}1.pwconv2.weight": (latent, 4 * latent),
                f"{up}1.pwconv2.bias": (latent,),
                f"{up}1.gamma": (latent,),
            }
        )
    out["decoder.decoder.0.conv.weight"] = (dim, latent, 7)
    out["decoder.decoder.0.conv.bias"] = (dim,)
    rates = [int(r) for r in dec["upsample_rates"]]
    for b, rate in enumerate(rates, start=1):
        c_in, c_out = dim // 2 ** (b - 1), dim // 2**b
        blk = f"decoder.decoder.{b}.block."
        out[f"{blk}0.alpha"] = (c_in,)
        out[f"{blk}0.beta"] = (c_in,)
        out[f"{blk}1.conv.weight"] = (c_in, c_out, 2 * rate)
        out[f"{blk}1.conv.bias"] = (c_out,)
        for u in (2, 3, 4):
            res = f"{blk}{u}."
            out.update(
                {
                    f"{res}act1.alpha": (c_out,),
                    f"{res}act1.beta": (c_out,),
                    f"{res}conv1.conv.weight": (c_out, c_out, 7),
                    f"{res}conv1.conv.bias": (c_out,),
                    f"{res}act2.alpha": (c_out,),
                    f"{res}act2.beta": (c_out,),
                    f"{res}conv2.conv.weight": (c_out, c_out, 1),
                    f"{res}conv2.conv.bias": (c_out,),
                }
            )
    last = dim // 2 ** len(rates)
    n = len(rates) + 1
    out[f"decoder.decoder.{n}.alpha"] = (last,)
    out[f"decoder.decoder.{n}.beta"] = (last,)
    out[f"decoder.decoder.{n + 1}.conv.weight"] = (1, last, 7)
    out[f"decoder.decoder.{n + 1}.conv.bias"] = (1,)
    return out
