"""Qwen3-Omni checkpoint directories: validation, read-only access, the model cache,
and the `omni-serving models` / `up --model` command lines.

One tiny random-weight checkpoint (decoder_svc/qwen3_omni/tiny.py) is written per
session; the failure cases are copies of it with one thing broken (the weights
file symlinked where the case does not touch it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from decoder_svc.qwen3_omni import cache
from decoder_svc.qwen3_omni.checkpoint import (
    ARCHITECTURE,
    CheckpointError,
    OmniCheckpoint,
)
from decoder_svc.qwen3_omni.checkpoint_tensors import required_tensors
from tests.fs_helpers import tree_snapshot

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _hide_broken_torchvision() -> None:
    """transformers imports torchvision when it is installed; a build that does not
    match torch fails at import, and the tiny checkpoint needs none of it."""
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError):
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision"] = None  # type: ignore[assignment]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    from decoder_svc.qwen3_omni.tiny import create_tiny_checkpoint

    _hide_broken_torchvision()
    return create_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_keys(tiny) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(tiny / SINGLE), framework="pt") as f:
        return sorted(f.keys())


SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _write_sharded(src: Path, dst: Path, *, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """A copy of `src` with its tensors split into two shards (thinker / the rest) and an
    index, as sharded releases ship; tensors in `drop` are left out of shards and index."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(SINGLE, INDEX))
    parts: tuple[dict, dict] = ({}, {})
    with safe_open(str(src / SINGLE), framework="pt") as f:
        for name in f.keys():
            if name not in drop:
                parts[0 if name.startswith("thinker.") else 1][name] = f.get_tensor(name)
    weight_map = {}
    for shard, tensors in zip(SHARDS, parts, strict=True):
        save_file(tensors, str(dst / shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in tensors})
    total = sum((dst / s).stat().st_size for s in SHARDS)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


@pytest.fixture(scope="session")
def sharded(tiny, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("sharded") / "tiny-sharded"
    _write_sharded(tiny, dst)
    return dst


def _variant(src: Path, dst: Path, *, config=None, remove: tuple[str, ...] = ()) -> Path:
    """A copy of `src` (weights symlinked) with config.json edited by `config(dict)` and
    the files in `remove` left out."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name in remove:
            continue
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        else:
            shutil.copy2(f, dst / f.name)
    if config is not None:
        data = json.loads((src / "config.json").read_text())
        config(data)
        (dst / "config.json").write_text(json.dumps(data, indent=2))
    return dst


_snapshot = tree_snapshot


# Writes seen by an audit hook while a directory is watched (root bypasses chmod, so
# a read-only copy alone would not catch a write when the tests run as root).
_WATCHED: list[Path] = []
_WRITES: list[tuple] = []
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_MUTATING_EVENTS = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                    "os.utime", "os.truncate", "os.link", "os.symlink", "shutil.rmtree",
                    "shutil.move", "shutil.copyfile"}


def _inside_watched(arg) -> bool:
    if isinstance(arg, int | type(None)):
        return False
    try:
        p = Path(os.fsdecode(arg)).absolute()
    except TypeError:
        return False
    return any(p == w or w in p.parents for w in _WATCHED)


def _audit(event: str, args: tuple) -> None:
    if not _WATCHED:
        return
    if event == "open":
        path, mode, flags = (list(args) + [None, None])[:3]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writing and _inside_watched(path):
            _WRITES.append((event, args))
    elif event in _MUTATING_EVENTS and any(_inside_watched(a) for a in args):
        _WRITES.append((event, args))


sys.addaudithook(_audit)


class _NoWrites:
    def __init__(self, root: Path) -> None:
        self.roots = sorted({root.absolute(), root.resolve()})

    def __enter__(self):
        _WRITES.clear()
        _WATCHED.extend(self.roots)
        return self

    def __exit__(self, *exc) -> None:
        for root in self.roots:
            _WATCHED.remove(root)
        assert not _WRITES, f"writes into {self.roots[0]}: {_WRITES}"


# -- opening ---------------------------------------------------------------------------------


def test_tiny_checkpoint_opens(tiny, tiny_keys):
    ckpt = OmniCheckpoint.open(tiny)
    assert ckpt.path == tiny.resolve()
    assert ARCHITECTURE in ckpt.config["architectures"]
    assert ckpt.thinker_config is ckpt.config["thinker_config"]
    assert ckpt.talker_config["num_code_groups"] == 16
    assert ckpt.code2wav_config["num_quantizers"] == 16
    assert ckpt.generation_config["talker_temperature"] == 0.9
    assert sorted(ckpt.weight_map) == tiny_keys
    assert set(ckpt.weight_map.values()) == {SINGLE}
    assert ckpt.shard_files() == [tiny.resolve() / SINGLE]
    assert ckpt.shard_files("no-such-prefix.") == []
    fp = ckpt.fingerprint()
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert OmniCheckpoint.open(str(tiny)).fingerprint() == fp


def test_required_tensors_are_the_released_names(tiny, tiny_keys):
    """Every name the validation requires exists in the checkpoint transformers writes;
    what is not required is only the audio/vision encoders and code2wav's conv stacks."""
    config = json.loads((tiny / "config.json").read_text())
    required = required_tensors(config)
    assert len(required) == len(set(required))
    assert not set(required) - set(tiny_keys)
    rest = {k for k in tiny_keys if k not in set(required)}
    allowed = ("thinker.audio_tower.", "thinker.visual.", "code2wav.upsample.", "code2wav.decoder.")
    assert all(k.startswith(allowed) for k in rest), sorted(k for k in rest if not k.startswith(allowed))
    # MoE experts one per key, for thinker and talker; the code predictor has G-1 heads.
    assert "thinker.model.layers.1.mlp.experts.3.down_proj.weight" in required
    assert "talker.model.layers.1.mlp.shared_expert_gate.weight" in required
    assert "talker.code_predictor.lm_head.14.weight" in required
    assert "talker.code_predictor.lm_head.15.weight" not in tiny_keys


def test_open_leaves_the_directory_unchanged(tiny):
    before = _snapshot(tiny)
    with _NoWrites(tiny):
        ckpt = OmniCheckpoint.open(tiny)
        ckpt.tensors("talker.model.norm")
        ckpt.fingerprint()
        ckpt.shard_files("code2wav.")
    assert _snapshot(tiny) == before


def test_open_works_on_a_read_only_copy(tiny, tmp_path):
    ro = tmp_path / "ro"
    shutil.copytree(tiny, ro)
    paths = [ro, *ro.rglob("*")]
    for p in paths:
        p.chmod(stat.S_IMODE(p.stat().st_mode) & ~0o222)
    try:
        before = _snapshot(ro)
        with _NoWrites(ro):
            ckpt = OmniCheckpoint.open(ro)
            norm = ckpt.tensors("thinker.model.norm.")
        assert list(norm) == ["thinker.model.norm.weight"]
        assert _snapshot(ro) == before
    finally:
        for p in paths:
            p.chmod(stat.S_IMODE(p.stat().st_mode) | 0o200)


def test_tensors_returns_exactly_the_prefix(tiny, tiny_keys):
    from safetensors import safe_open

    ckpt = OmniCheckpoint.open(tiny)
    got = ckpt.tensors("code2wav.")
    assert sorted(got) == [k for k in tiny_keys if k.startswith("code2wav.")]
    with safe_open(str(tiny / SINGLE), framework="pt") as f:
        emb = f.get_tensor("code2wav.code_embedding.weight")
    assert got["code2wav.code_embedding.weight"].equal(emb)
    assert list(emb.shape) == [2048 * 16, 128]  # codebook_size * num_quantizers rows


def test_sharded_checkpoint_reads_across_shards(tiny, sharded):
    ckpt = OmniCheckpoint.open(sharded)
    single = OmniCheckpoint.open(tiny)
    assert set(ckpt.weight_map.values()) == set(SHARDS)
    assert ckpt.shard_files() == [sharded.resolve() / s for s in SHARDS]
    assert ckpt.shard_files("thinker.") == [sharded.resolve() / SHARDS[0]]
    assert ckpt.shard_files("talker.") == [sharded.resolve() / SHARDS[1]]
    prefix = "thinker.model.norm"  # one tensor; "" reads everything across both shards
    assert list(ckpt.tensors(prefix)) == ["thinker.model.norm.weight"]
    everything = ckpt.tensors("")
    reference = single.tensors("")
    assert sorted(everything) == sorted(reference)
    for name in ("thinker.model.embed_tokens.weight", "talker.codec_head.weight",
                 "code2wav.code_embedding.weight"):
        assert everything[name].equal(reference[name])
    assert ckpt.fingerprint() != single.fingerprint()


def test_fingerprint_follows_the_files(tiny, tmp_path):
    a = _variant(tiny, tmp_path / "a")
    fp = OmniCheckpoint.open(a).fingerprint()
    assert OmniCheckpoint.open(a).fingerprint() == fp
    b = _variant(tiny, tmp_path / "b")  # same content, other path
    assert OmniCheckpoint.open(b).fingerprint() != fp
    cfg = json.loads((a / "config.json").read_text())
    (a / "config.json").write_text(json.dumps(cfg))  # same values, other bytes
    assert OmniCheckpoint.open(a).fingerprint() != fp


# -- failures: each names the file and the key ------------------------------------------------


def _error(path: Path) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        OmniCheckpoint.open(path)
    err = info.value
    assert str(err) == f"{err.file}: {err.key}: {err.message}"
    return err


def test_error_is_file_key_message():
    err = CheckpointError("/x/config.json", "architectures", "bad")
    assert (str(err), err.file, err.key, err.message) == ("/x/config.json: architectures: bad",
                                                          "/x/config.json", "architectures", "bad")
    import pickle

    assert str(pickle.loads(pickle.dumps(err))) == str(err)


def test_missing_directory(tmp_path):
    err = _error(tmp_path / "nope")
    assert Path(err.file) == tmp_path / "nope"
    (tmp_path / "file").write_text("x")
    assert "not a directory" in _error(tmp_path / "file").message


def test_wrong_architecture(tiny, tmp_path):
    d = _variant(tiny, tmp_path / "d", config=lambda c: c.update(architectures=["Qwen2ForCausalLM"]))
    err = _error(d)
    assert Path(err.file) == d.resolve() / "config.json" and err.key == "architectures"
    assert "Qwen2ForCausalLM" in err.message and ARCHITECTURE in err.message


def test_missing_config_json(tiny, tmp_path):
    d = _variant(tiny, tmp_path / "d", remove=("config.json",))
    err = _error(d)
    assert Path(err.file) == d.resolve() / "config.json"
    assert "not found" in err.message


def test_config_json_not_json(tiny, tmp_path):
    d = _variant(tiny, tmp_path / "d")
    (d / "config.json").write_text("{not json")
    err = _error(d)
    assert Path(err.file).name == "config.json" and "not valid JSON" in err.message


def test_audio_output_disabled(tiny, tmp_path):
    d = _variant(tiny, tmp_path / "d", config=lambda c: c.update(enable_audio_output=False))
    assert _error(d).key == "enable_audio_output"


def _delete(*keys: str):
    def edit(c: dict) -> None:
        *parents, last = keys
        for k in parents:
            c = c[k]
        del c[last]

    return edit


def _set(value, *keys: str):
    def edit(c: dict) -> None:
        *parents, last = keys
        for k in parents:
            c = c[k]
        c[last] = value

    return edit


@pytest.mark.parametrize("keys", [
    ("talker_config",),
    ("thinker_config", "text_config"),
    ("thinker_config", "text_config", "num_experts"),
    ("talker_config", "text_config", "shared_expert_intermediate_size"),
    ("talker_config", "code_predictor_config", "num_code_groups"),
    ("talker_config", "speaker_id"),
    ("talker_config", "codec_eos_token_id"),
    ("code2wav_config", "upsample_rates"),
    ("tts_pad_token_id",),
])
def test_missing_config_key(tiny, tmp_path, keys):
    d = _variant(tiny, tmp_path / "d", config=_delete(*keys))
    err = _error(d)
    assert Path(err.file).name == "config.json"
    assert err.key == ".".join(keys) and "missing" in err.message


def test_talker_experts_under_either_name(tiny, tmp_path):
    """transformers 5 writes the talker's expert count as num_local_experts, released
    configs as num_experts: both are read; neither is an error."""
    talker = json.loads((tiny / "config.json").read_text())["talker_config"]["text_config"]
    assert "num_local_experts" in talker or "num_experts" in talker

    def rename(c: dict) -> None:
        text = c["talker_config"]["text_config"]
        text["num_experts"] = text.pop("num_local_experts", text.get("num_experts"))

    OmniCheckpoint.open(_variant(tiny, tmp_path / "a", config=rename))

    def drop(c: dict) -> None:
        text = c["talker_config"]["text_config"]
        text.pop("num_local_experts", None)
        text.pop("num_experts", None)

    assert _error(_variant(tiny, tmp_path / "b", config=drop)).key == "talker_config.text_config.num_experts"


@pytest.mark.parametrize("edit,key", [
    (_set("128", "thinker_config", "text_config", "hidden_size"), "thinker_config.text_config.hidden_size"),
    (_set(True, "talker_config", "num_code_groups"), "talker_config.num_code_groups"),
    (_set(0, "code2wav_config", "codebook_size"), "code2wav_config.codebook_size"),
    (_set([8, "5"], "code2wav_config", "upsample_rates"), "code2wav_config.upsample_rates"),
    (_set({}, "talker_config", "speaker_id"), "talker_config.speaker_id"),
    (_set({"ethan": "x"}, "talker_config", "speaker_id"), "talker_config.speaker_id.ethan"),
])
def test_config_value_of_wrong_type(tiny, tmp_path, edit, key):
    assert _error(_variant(tiny, tmp_path / "d", config=edit)).key == key


def test_head_dim_may_be_derived(tiny, tmp_path):
    OmniCheckpoint.open(_variant(tiny, tmp_path / "ok", config=_delete("thinker_config", "text_config", "head_dim")))

    def odd(c: dict) -> None:
        del c["thinker_config"]["text_config"]["head_dim"]
        c["thinker_config"]["text_config"]["num_attention_heads"] = 3

    err = _error(_variant(tiny, tmp_path / "bad", config=odd))
    assert err.key == "thinker_config.text_config.head_dim" and "derivable" in err.message


@pytest.mark.parametrize("edit,key,other", [
    (_set(8, "code2wav_config", "num_quantizers"), "code2wav_config.num_quantizers",
     "talker_config.num_code_groups"),
    (_set(8, "talker_config", "code_predictor_config", "num_code_groups"),
     "talker_config.code_predictor_config.num_code_groups", "talker_config.num_code_groups"),
    (_set(64, "talker_config", "thinker_hidden_size"), "talker_config.thinker_hidden_size",
     "thinker_config.text_config.hidden_size"),
    (_set(1024, "code2wav_config", "codebook_size"), "talker_config.code_predictor_config.vocab_size",
     "code2wav_config.codebook_size"),
    (_set(3072, "talker_config", "codec_pad_id"), "talker_config.codec_pad_id",
     "talker_config.text_config.vocab_size"),
    (_set({"ethan": 5000}, "talker_config", "speaker_id"), "talker_config.speaker_id.ethan",
     "talker_config.text_config.vocab_size"),
    (_set(2000, "talker_config", "codec_eos_token_id"), "talker_config.codec_eos_token_id",
     "talker_config.code_predictor_config.vocab_size"),
    (_set(0, "talker_config", "accept_hidden_layer"), "talker_config.accept_hidden_layer",
     "thinker_config.text_config.num_hidden_layers"),
    (_set(3, "talker_config", "accept_hidden_layer"), "talker_config.accept_hidden_layer",
     "thinker_config.text_config.num_hidden_layers"),
    (_set(1024, "tts_pad_token_id"), "tts_pad_token_id", "thinker_config.text_config.vocab_size"),
])
def test_inconsistent_config(tiny, tmp_path, edit, key, other):
    err = _error(_variant(tiny, tmp_path / "d", config=edit))
    assert Path(err.file).name == "config.json"
    assert err.key == key
    assert key in err.message and other in err.message


def test_inconsistent_quantizers_names_both_values(tiny, tmp_path):
    err = _error(_variant(tiny, tmp_path / "d", config=_set(8, "code2wav_config", "num_quantizers")))
    assert "= 8" in err.message and "= 16" in err.message


def test_missing_shard(sharded, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(sharded, d, ignore=shutil.ignore_patterns(SHARDS[1]))
    err = _error(d)
    assert Path(err.file) == d.resolve() / SHARDS[1]
    assert err.key == "weight_map"


def test_missing_tensor_sharded(tiny, tmp_path):
    name = "talker.model.layers.1.mlp.experts.2.up_proj.weight"
    d = tmp_path / "d"
    _write_sharded(tiny, d, drop=(name,))
    err = _error(d)
    assert Path(err.file) == d.resolve() / INDEX
    assert (err.key, err.message) == (name, "missing")


def test_missing_tensor_single_file(tiny, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    name = "thinker.model.layers.0.self_attn.q_norm.weight"
    d = _variant(tiny, tmp_path / "d", remove=(SINGLE, INDEX))
    with safe_open(str(tiny / SINGLE), framework="pt") as f:
        save_file({k: f.get_tensor(k) for k in f.keys() if k != name}, str(d / SINGLE))
    err = _error(d)
    assert Path(err.file) == d.resolve() / SINGLE
    assert (err.key, err.message) == (name, "missing")


def test_index_names_a_tensor_its_shard_lacks(tiny, tmp_path):
    name = "code2wav.pre_transformer.norm.weight"
    d = tmp_path / "d"
    weight_map = _write_sharded(tiny, d, drop=(name,))
    index = json.loads((d / INDEX).read_text())
    index["weight_map"][name] = SHARDS[1]
    (d / INDEX).write_text(json.dumps(index))
    assert name not in weight_map
    err = _error(d)
    assert Path(err.file) == d.resolve() / SHARDS[1] and err.key == name


def test_missing_code2wav_module(tiny, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    d = _variant(tiny, tmp_path / "d", remove=(SINGLE, INDEX))
    with safe_open(str(tiny / SINGLE), framework="pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("code2wav.upsample.1.")}
    save_file(kept, str(d / SINGLE))
    err = _error(d)
    assert err.key == "code2wav.upsample.1.*"


def test_embedding_shape_mismatch(tiny, tmp_path):
    d = _variant(tiny, tmp_path / "d", config=_set(2048, "thinker_config", "text_config", "vocab_size"))
    err = _error(d)
    assert err.key == "thinker.model.embed_tokens.weight"
    assert "[1024, 128]" in err.message and "[2048, 128]" in err.message


def test_no_weights(tiny, tmp_path):
    d = _variant(tiny, tmp_path / "d", remove=(SINGLE, INDEX))
    err = _error(d)
    assert Path(err.file).name == SINGLE


def test_single_file_without_index_opens(tiny, tmp_path):
    d = _variant(tiny, tmp_path / "d", remove=(INDEX,))
    ckpt = OmniCheckpoint.open(d)
    assert set(ckpt.weight_map.values()) == {SINGLE}


def test_missing_chat_template(tiny, tmp_path):
    d = _variant(tiny, tmp_path / "d", remove=("chat_template.json", "chat_template.jinja"))
    assert "chat_template" not in json.loads((d / "tokenizer_config.json").read_text())
    err = _error(d)
    assert err.key == "chat_template"
    assert Path(err.file).parent == d.resolve()
    for where in ("tokenizer_config.json", "chat_template.json", "chat_template.jinja"):
        assert where in err.message


@pytest.mark.parametrize("keep", ["tokenizer_config.json", "chat_template.json", "chat_template.jinja"])
def test_chat_template_in_any_of_three_places(tiny, tmp_path, keep):
    d = _variant(tiny, tmp_path / "d", remove=("chat_template.json", "chat_template.jinja"))
    template = json.loads((tiny / "chat_template.json").read_text())["chat_template"]
    if keep == "tokenizer_config.json":
        tok = json.loads((d / keep).read_text())
        (d / keep).write_text(json.dumps({**tok, "chat_template": template}))
    else:
        shutil.copy2(tiny / keep, d / keep)
    OmniCheckpoint.open(d)


def test_missing_tokenizer(tiny, tmp_path):
    d = _variant(tiny, tmp_path / "d", remove=("tokenizer.json",))
    err = _error(d)
    assert err.key == "tokenizer" and Path(err.file).name == "tokenizer.json"
    (d / "vocab.json").write_text("{}")
    (d / "merges.txt").write_text("")
    OmniCheckpoint.open(d)  # the slow tokenizer's files are enough


def test_failed_open_writes_nothing(tiny, tmp_path):
    d = _variant(tiny, tmp_path / "d", config=_set(8, "code2wav_config", "num_quantizers"))
    before = _snapshot(d)
    with _NoWrites(d):
        _error(d)
    assert _snapshot(d) == before


# -- the model cache ----------------------------------------------------------------------------


def test_cache_root_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("OMNI_SERVING_MODEL_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.model_cache_root() == tmp_path / "models"
    monkeypatch.delenv("OMNI_SERVING_MODEL_DIR")
    assert cache.model_cache_root() == tmp_path / "xdg" / "omni-serving" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.model_cache_root() == tmp_path / "home" / ".cache" / "omni-serving" / "models"
    monkeypatch.setenv("OMNI_SERVING_MODEL_DIR", str(tmp_path / "m2"))
    assert cache.default_model_dir(create=False) == tmp_path / "m2" / cache.TINY_DIR_NAME
    assert not (tmp_path / "m2").exists()


def test_derived_dir_is_in_the_cache(tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("OMNI_SERVING_MODEL_DIR", str(tmp_path / "models"))
    before = _snapshot(tiny)
    ckpt = OmniCheckpoint.open(tiny)
    out = cache.derived_dir(ckpt, "talker")
    assert out == tmp_path / "models" / "derived" / ckpt.fingerprint() / "talker"
    assert out.is_dir()
    assert cache.derived_dir(ckpt, "talker") == out
    assert _snapshot(tiny) == before
    for bad in ("", "..", "a/b"):
        with pytest.raises(ValueError):
            cache.derived_dir(ckpt, bad)


def test_default_model_dir_creates_once(monkeypatch, tmp_path):
    _hide_broken_torchvision()
    monkeypatch.setenv("OMNI_SERVING_MODEL_DIR", str(tmp_path / "models"))
    path = cache.default_model_dir()
    assert path == tmp_path / "models" / cache.TINY_DIR_NAME
    marker = json.loads((path / "omni_serving_tiny.json").read_text())
    from decoder_svc.qwen3_omni.tiny import TINY_FORMAT

    assert marker == {"format": TINY_FORMAT, "seed": 0}
    OmniCheckpoint.open(path)
    before = _snapshot(path)
    assert cache.default_model_dir() == path
    assert _snapshot(path) == before
    leftovers = [p.name for p in (tmp_path / "models").iterdir() if p.name.startswith(f".{cache.TINY_DIR_NAME}-")]
    assert leftovers == []


def test_default_model_dir_concurrent_callers_write_once(monkeypatch, tmp_path):
    monkeypatch.setenv("OMNI_SERVING_MODEL_DIR", str(tmp_path / "models"))
    calls = []
    stale = tmp_path / "models" / f".{cache.TINY_DIR_NAME}-killedwriter"
    stale.mkdir(parents=True)

    def fake_create(out_dir, *, seed=0):
        calls.append(out_dir)
        time.sleep(0.3)
        tmp = out_dir.parent / f".{out_dir.name}-x"
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        os.rename(tmp, out_dir)
        return out_dir

    monkeypatch.setattr(cache, "create_tiny_checkpoint", fake_create)
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.default_model_dir())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(calls) == 1
    assert results == [tmp_path / "models" / cache.TINY_DIR_NAME] * 3
    assert not stale.exists(), "a temp dir left by a killed writer is removed"


# -- omni-serving models ---------------------------------------------------------------------


def test_cli_models_check(tiny, capsys):
    from omni_cli.main import main

    assert main(["models", "check", str(tiny)]) == 0
    out = capsys.readouterr().out
    assert ARCHITECTURE in out and "chelsie" in out and SINGLE in out
    assert "input:       text, audio (16000 Hz), images (32 px per token side)" in out


def test_cli_models_check_reports_the_error(tiny, tmp_path, capsys):
    from omni_cli.main import main

    d = _variant(tiny, tmp_path / "d", config=_set(["Other"], "architectures"))
    assert main(["models", "check", str(d)]) == 1
    err = capsys.readouterr().err
    assert f"{d.resolve() / 'config.json'}: architectures:" in err


def test_cli_models_create_refuses_an_existing_dir(tmp_path, capsys):
    from omni_cli.main import main

    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = _snapshot(out)
    assert main(["models", "create", "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert _snapshot(out) == before


def test_cli_models_create_writes_and_prints(monkeypatch, tmp_path, capsys):
    from decoder_svc.qwen3_omni import tiny as tiny_mod
    from omni_cli.main import main

    seen = []

    def fake_create(out_dir, *, seed=0):
        seen.append((Path(out_dir), seed))
        Path(out_dir).mkdir()
        return Path(out_dir)

    monkeypatch.setattr(tiny_mod, "create_tiny_checkpoint", fake_create)
    monkeypatch.setattr(cache, "create_tiny_checkpoint", fake_create)
    assert main(["models", "create", "--out", str(tmp_path / "new"), "--seed", "7"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "new")
    monkeypatch.setenv("OMNI_SERVING_MODEL_DIR", str(tmp_path / "models"))
    assert main(["models", "create"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "models" / cache.TINY_DIR_NAME)
    assert seen == [(tmp_path / "new", 7), (tmp_path / "models" / cache.TINY_DIR_NAME, 0)]
    assert main(["models", "create", "--seed", "3"]) == 2  # the cache's checkpoint has seed 0


# -- omni-serving up --model ------------------------------------------------------------------


def _up_config(argv: list[str]):
    from omni_stack.config import add_up_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_up_model_reaches_the_decoder(tmp_path):
    from omni_stack.commands import service_commands

    cfg = _up_config(["--model", "/ckpt", "--deployment", "d"])
    assert cfg.model == "/ckpt"
    decoder = next(s for s in service_commands(cfg, tmp_path) if s.name == "decoder")
    i = decoder.argv.index("--model")
    assert decoder.argv[i + 1] == "/ckpt"
    none = next(s for s in service_commands(_up_config([]), tmp_path) if s.name == "decoder")
    assert "--model" not in none.argv and "--model-dir" not in none.argv


def test_up_model_dir_is_a_deprecated_alias(tmp_path, capsys):
    assert _up_config(["--model-dir", "/old"]).model == "/old"
    assert "--model-dir is deprecated" in capsys.readouterr().err
    assert _up_config(["--model-dir", "/old", "--model", "/new"]).model == "/new"
    capsys.readouterr()
    conf = tmp_path / "stack.toml"
    conf.write_text('model-dir = "/from-file"\n')
    assert _up_config(["--config", str(conf)]).model == "/from-file"
    assert "deprecated" in capsys.readouterr().err
    conf.write_text('model = "/m"\n')
    assert _up_config(["--config", str(conf)]).model == "/m"
    conf.write_text('model = "/m"\nmodel_dir = "/old"\n')
    assert _up_config(["--config", str(conf)]).model == "/m"


def test_up_help_shows_model_not_model_dir():
    from omni_stack.config import add_up_arguments

    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    text = parser.format_help()
    assert "--model MODEL" in text or "--model " in text
    assert "--model-dir" not in text



def test_derived_files_never_go_into_the_model_directory(tiny, monkeypatch):
    """A model cache pointed at (or inside) the checkpoint is refused, not written."""
    from decoder_svc.qwen3_omni.cache import derived_dir

    ckpt = OmniCheckpoint.open(tiny)
    before = tree_snapshot(tiny)
    monkeypatch.setenv("OMNI_SERVING_MODEL_DIR", str(tiny))
    with pytest.raises(CheckpointError) as err:
        derived_dir(ckpt, "talker-vllm")
    assert err.value.key == "OMNI_SERVING_MODEL_DIR"
    assert tree_snapshot(tiny) == before
