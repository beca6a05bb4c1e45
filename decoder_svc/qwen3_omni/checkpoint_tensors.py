"""The tensors a Qwen3-Omni-MoE config implies: what serving loads, and the shapes it fixes.

``required_tensors`` names every tensor serving loads (thinker text model,
talker, code predictor, code2wav), ``required_prefixes`` the groups of which
at least one tensor must exist, and ``expected_shapes`` the embedding tables
and heads whose shapes the config fixes. ``.checkpoint.OmniCheckpoint.open``
checks a checkpoint's weights against them; the config was validated first
(``.checkpoint``), so keys are read without checks here.
"""

from __future__ import annotations

__all__ = ["required_tensors", "required_prefixes", "expected_shapes"]


def _attention(prefix: str, text: dict, qk_norm: bool = True) -> list[str]:
    names = [f"{prefix}self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o")]
    if text.get("attention_bias"):
        names += [f"{prefix}self_attn.{p}_proj.bias" for p in ("q", "k", "v")]
    if qk_norm:
        names += [f"{prefix}self_attn.q_norm.weight", f"{prefix}self_attn.k_norm.weight"]
    names += [f"{prefix}input_layernorm.weight", f"{prefix}post_attention_layernorm.weight"]
    return names


def _dense_mlp(prefix: str) -> list[str]:
    return [f"{prefix}{p}_proj.weight" for p in ("gate", "up", "down")]


def _experts(prefix: str, n: int) -> list[str]:
    names = [f"{prefix}gate.weight"]
    for e in range(n):
        names += _dense_mlp(f"{prefix}experts.{e}.")
    return names


def _num_experts(text: dict) -> int:
    value = text.get("num_experts")
    return int(value if value is not None else text.get("num_local_experts") or 0)


def _tied(*sections: dict) -> bool:
    return any(s.get("tie_word_embeddings") is True for s in sections)


def required_tensors(config: dict) -> list[str]:
    """Names of the tensors serving loads, computed from a validated config.json."""
    thinker, talker, c2w = config["thinker_config"], config["talker_config"], config["code2wav_config"]
    th = thinker["text_config"]
    names = ["thinker.model.embed_tokens.weight", "thinker.model.norm.weight"]
    if not _tied(th, thinker):
        names.append("thinker.lm_head.weight")
    experts = _num_experts(th)
    sparse_step = th.get("decoder_sparse_step") or 1
    dense_layers = set(th.get("mlp_only_layers") or [])
    for i in range(th["num_hidden_layers"]):
        p = f"thinker.model.layers.{i}."
        names += _attention(p, th)
        if i not in dense_layers and experts > 0 and (i + 1) % sparse_step == 0:
            names += _experts(f"{p}mlp.", experts)
        else:
            names += _dense_mlp(f"{p}mlp.")

    tt = talker["text_config"]
    names += ["talker.model.codec_embedding.weight", "talker.model.norm.weight"]
    if not _tied(talker):
        names.append("talker.codec_head.weight")
    for proj in ("text_projection", "hidden_projection"):
        names += [f"talker.{proj}.linear_fc{k}.{w}" for k in (1, 2) for w in ("weight", "bias")]
    for i in range(tt["num_hidden_layers"]):  # every talker layer is a MoE layer
        p = f"talker.model.layers.{i}."
        names += _attention(p, tt)
        names += _experts(f"{p}mlp.", _num_experts(tt))
        names += _dense_mlp(f"{p}mlp.shared_expert.")
        names.append(f"{p}mlp.shared_expert_gate.weight")

    cp = talker["code_predictor_config"]
    for g in range(cp["num_code_groups"] - 1):
        names.append(f"talker.code_predictor.model.codec_embedding.{g}.weight")
        names.append(f"talker.code_predictor.lm_head.{g}.weight")
    for i in range(cp["num_hidden_layers"]):
        p = f"talker.code_predictor.model.layers.{i}."
        names += _attention(p, cp)
        names += _dense_mlp(f"{p}mlp.")
    names.append("talker.code_predictor.model.norm.weight")

    names += ["code2wav.code_embedding.weight", "code2wav.pre_transformer.norm.weight"]
    for i in range(c2w["num_hidden_layers"]):
        p = f"code2wav.pre_transformer.layers.{i}."
        names += _attention(p, c2w, qk_norm=False)
        names += _dense_mlp(f"{p}mlp.")
        names += [f"{p}self_attn_layer_scale.scale", f"{p}mlp_layer_scale.scale"]
    return names


def required_prefixes(config: dict) -> list[str]:
    """Module prefixes that must hold at least one tensor (code2wav's convolution stacks,
    checked loosely: their inner names follow the layer types, not the config)."""
    c2w = config["code2wav_config"]
    prefixes = [f"code2wav.upsample.{i}." for i in range(len(c2w["upsampling_ratios"]))]
    # decoder.0: input conv; 1..n: one block per upsample rate; then activation, output conv.
    prefixes += [f"code2wav.decoder.{i}." for i in range(len(c2w["upsample_rates"]) + 3)]
    return prefixes


def expected_shapes(config: dict) -> dict[str, tuple[list[int], str]]:
    """Shapes of embedding tables and heads: name -> (shape, how the config implies it)."""
    thinker, talker, c2w = config["thinker_config"], config["talker_config"], config["code2wav_config"]
    th, tt, cp = thinker["text_config"], talker["text_config"], talker["code_predictor_config"]
    th_shape = ([th["vocab_size"], th["hidden_size"]],
                "[thinker_config.text_config.vocab_size, hidden_size]")
    tt_shape = ([tt["vocab_size"], tt["hidden_size"]],
                "[talker_config.text_config.vocab_size, hidden_size]")
    cp_shape = ([cp["vocab_size"], cp["hidden_size"]],
                "[talker_config.code_predictor_config.vocab_size, hidden_size]")
    shapes = {
        "thinker.model.embed_tokens.weight": th_shape,
        "thinker.lm_head.weight": th_shape,
        "talker.model.codec_embedding.weight": tt_shape,
        "talker.codec_head.weight": tt_shape,
        "code2wav.code_embedding.weight": (
            [c2w["codebook_size"] * c2w["num_quantizers"], c2w["hidden_size"]],
            "[code2wav_config.codebook_size * num_quantizers, hidden_size]",
        ),
    }
    for g in range(cp["num_code_groups"] - 1):
        shapes[f"talker.code_predictor.model.codec_embedding.{g}.weight"] = cp_shape
        shapes[f"talker.code_predictor.lm_head.{g}.weight"] = cp_shape
    return shapes
