"""`omni-serving models create --preset released` (decoder_svc/qwen3_omni/released.py):
a random-weight checkpoint at the released Qwen3-Omni-30B-A3B's widths, in its
layout, special token ids and dtype. Serving it is a benchmark
(`omni-serving bench checkpoint`), not a test: it needs about 10 GiB."""

from __future__ import annotations

import json
import shutil

import pytest

import decoder_svc.qwen3_omni  # noqa: F401  (the torchvision shim before transformers)


@pytest.fixture(scope="module")
def tokenizer():
    from decoder_svc.qwen3_omni.released import released_tokenizer

    return released_tokenizer()


def test_the_tokenizer_has_the_released_ids(tokenizer):
    """Special tokens at 151643..151675, the role words at their released ids,
    the chat prompt's assistant turn opening with <|im_start|>, assistant,
    newline (what the talker's prompt reads), and every id up to the last
    special one decodes."""
    from decoder_svc.qwen3_omni.presets import released_config
    from decoder_svc.qwen3_omni.released import RELEASED_SPECIAL_TOKENS, ROLE_WORDS

    cfg = released_config(1)
    named = {"im_start_token_id": "<|im_start|>", "im_end_token_id": "<|im_end|>", "tts_pad_token_id": "<tts_pad>",
             "tts_bos_token_id": "<tts_text_bos>", "tts_eos_token_id": "<tts_text_eod>", "user_token_id": "user",
             "system_token_id": "system", "assistant_token_id": "assistant"}
    for key, token in named.items():
        assert tokenizer.convert_tokens_to_ids(token) == cfg[key], key
    th = cfg["thinker_config"]
    for key, token in {"audio_token_id": "<|audio_pad|>", "image_token_id": "<|image_pad|>",
                       "video_token_id": "<|video_pad|>", "audio_start_token_id": "<|audio_start|>",
                       "audio_end_token_id": "<|audio_end|>", "vision_start_token_id": "<|vision_start|>",
                       "vision_end_token_id": "<|vision_end|>"}.items():
        assert tokenizer.convert_tokens_to_ids(token) == th[key], key
    assert [tokenizer.convert_tokens_to_ids(t) for t in RELEASED_SPECIAL_TOKENS] == list(range(151643, 151676))
    assert {w: tokenizer.convert_tokens_to_ids(w) for w in ROLE_WORDS} == {"user": 872, "system": 8948,
                                                                          "assistant": 77091}
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there, assistant."}],
                                        add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert ids[:2] == [151644, 872] and ids[-3:-1] == [151644, 77091] and tokenizer.decode(ids[-1:]) == "\n"
    assert tokenizer.decode(ids) == ("<|im_start|>user\nHello there, assistant.<|im_end|>\n"
                                     "<|im_start|>assistant\n")
    vocab = tokenizer.get_vocab()
    assert sorted(vocab.values()) == list(range(151676))  # dense: a sampled id always has a token
    assert tokenizer.decode([5, 4000, 150000, 151645], skip_special_tokens=True)


def test_the_layout_is_the_one_transformers_saves(tiny_checkpoint):
    """Names and shapes from the meta-device model with its fused experts
    split one per key equal what save_pretrained wrote for the tiny
    checkpoint, tensor for tensor."""
    from safetensors import safe_open

    from decoder_svc.qwen3_omni.released import released_tensor_shapes

    config = json.loads((tiny_checkpoint / "config.json").read_text())
    saved = {}
    for shard in sorted(tiny_checkpoint.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            saved.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    assert released_tensor_shapes(config) == dict(sorted(saved.items()))


def test_create_the_released_widths_at_one_layer(tmp_path, capsys):
    """The real thing at N = 1 (3.4 GiB): bfloat16 shards under the released
    names and counts, random but reproducible weights, the configuration and
    tokenizer the checks accept, the talker's view built over the shards,
    and the plan computed from the headers; the directory readable by others."""
    from safetensors import safe_open

    from decoder_svc.qwen3_omni.checkpoint import OmniCheckpoint
    from decoder_svc.qwen3_omni.presets import released_config, stage_numel
    from decoder_svc.qwen3_omni.released import _random_tensor
    from omni_cli.main import main

    out = tmp_path / "released-l1"
    try:
        assert main(["models", "create", "--preset", "released", "--layers", "1", "--out", str(out),
                     "--seed", "5"]) == 0
        cap = capsys.readouterr()
        assert cap.out.strip() == str(out)
        assert "shard 2/2 written" in cap.err  # progress on a long write
        assert not list(tmp_path.glob(".released-l1-*"))  # the temporary directory was renamed
        assert out.stat().st_mode & 0o055 == 0o055
        ckpt = OmniCheckpoint.open(out)
        config = released_config(1)
        assert ckpt.config["talker_config"]["accept_hidden_layer"] == 1
        assert ckpt.thinker_config["text_config"]["hidden_size"] == 2048
        assert ckpt.thinker_config["text_config"]["num_experts"] == 128
        assert ckpt.config["torch_dtype" if "torch_dtype" in ckpt.config else "dtype"] == "bfloat16"
        numel = stage_numel(config)
        assert {p: ckpt.numel(p) for p in numel} == numel
        assert 1.7e9 < sum(numel.values()) < 1.9e9
        shards = sorted(out.glob("model-*.safetensors"))
        assert [s.name for s in shards] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == {s.name for s in shards}

        def read(name: str):
            with safe_open(str(out / index["weight_map"][name]), framework="pt") as f:
                return f.get_tensor(name)

        name = "thinker.model.layers.0.mlp.experts.127.down_proj.weight"
        t = read(name)
        assert str(t.dtype) == "torch.bfloat16" and tuple(t.shape) == (2048, 768)
        assert bool((t == _random_tensor(name, (2048, 768), 5, 0.01)).all())  # the seed's bytes
        assert 0.015 < float(t.float().std()) < 0.025
        assert not bool((t == _random_tensor(name, (2048, 768), 6, 0.01)).all())
        assert bool((read("thinker.model.norm.weight") == 1).all())
        assert bool((read("code2wav.decoder.1.block.0.alpha") == 0).all())
        assert bool((read("code2wav.pre_transformer.layers.0.mlp_layer_scale.scale") == 0.01).all())
        gen = json.loads((out / "generation_config.json").read_text())
        assert gen["eos_token_id"] == 151645 and gen["pad_token_id"] == 151643
        assert main(["models", "check", str(out)]) == 0
        cap = capsys.readouterr().out
        assert "thinker:     1 layers, hidden 2048, vocab 152064, 128 experts (8 per token)" in cap
        assert main(["models", "plan", str(out)]) == 0  # float32 here (the tests' setting)
        plan = capsys.readouterr().out
        assert "thinker   on cpu     weights 7.63 GiB" in plan, plan
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_create_refuses_what_it_cannot_write(tmp_path, monkeypatch, capsys):
    """Bad arguments exit 2 naming the option; a file system without the
    space exits 1 before anything is written, leaving nothing behind."""
    from decoder_svc.qwen3_omni import released
    from omni_cli.main import main

    def err(argv: list[str]) -> tuple[int, str]:
        code = main(["models", "create", *argv])
        return code, capsys.readouterr().err

    assert err(["--layers", "2"]) == (2, "omni-serving models create: --layers goes with --preset released\n")
    code, msg = err(["--preset", "released", "--layers", "0", "--out", str(tmp_path / "x")])
    assert code == 2 and "--layers: at least 1, got 0" in msg
    code, msg = err(["--preset", "released", "--seed", "3"])
    assert code == 2 and "--seed needs --out" in msg
    (tmp_path / "taken").mkdir()
    code, msg = err(["--preset", "released", "--out", str(tmp_path / "taken")])
    assert code == 2 and "exists" in msg

    class Small:
        free = 1 << 30

    monkeypatch.setattr(released.shutil, "disk_usage", lambda _path: Small())
    code, msg = err(["--preset", "released", "--out", str(tmp_path / "new")])
    assert code == 1 and "1.0 GiB free; the checkpoint needs 3.4 GiB" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_the_model_cache_names_one_checkpoint_per_depth(tmp_path, monkeypatch):
    from decoder_svc.qwen3_omni import cache
    from decoder_svc.qwen3_omni.released import RELEASED_FORMAT

    monkeypatch.setenv("OMNI_SERVING_MODEL_DIR", str(tmp_path))
    written = []
    monkeypatch.setattr("decoder_svc.qwen3_omni.released.create_released_checkpoint",
                        lambda target, **kw: (written.append((target.name, kw["layers"])), target.mkdir()))
    assert cache.released_model_dir(2, create=False) == tmp_path / f"qwen3-omni-released-l2-v{RELEASED_FORMAT}"
    assert not written
    path = cache.released_model_dir(3)
    assert path.is_dir() and cache.released_model_dir(3) == path
    assert written == [(f"qwen3-omni-released-l3-v{RELEASED_FORMAT}", 3)]  # written once
    with pytest.raises(ValueError, match="layers"):
        cache.released_model_dir(0)

