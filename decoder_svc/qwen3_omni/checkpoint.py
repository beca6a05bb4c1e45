"""Open and validate a Hugging Face Qwen3-Omni-MoE checkpoint directory.

``OmniCheckpoint.open(path)`` checks, before anything is served, that the
directory holds what serving reads:

- ``config.json``: architecture ``Qwen3OmniMoeForConditionalGeneration``,
  audio output enabled, the thinker / talker (+ code predictor) / code2wav
  sub-configs with the keys serving needs, consistent with each other
  (hidden sizes, code groups, codebook size, special ids inside the vocabularies);
- the weights: ``model.safetensors.index.json`` and every shard it names, or a
  single ``model.safetensors``; every tensor serving loads (thinker text
  model, talker, code predictor, code2wav) present, embedding tables and heads
  with the shapes the config implies (``.checkpoint_tensors``);
- a tokenizer (``tokenizer.json``, or ``vocab.json`` + ``merges.txt``) and a
  chat template (``tokenizer_config.json``'s ``chat_template``,
  ``chat_template.json`` or ``chat_template.jinja``);
- ``generation_config.json``, when present, parses;
- ``preprocessor_config.json``, when present (released checkpoints ship it),
  describes Whisper-style audio features (sampling rate, hop length) and
  the image processor (patch and merge sizes, pixel bounds): the thinker
  then takes audio and image input (:attr:`OmniCheckpoint.audio_input`,
  :attr:`OmniCheckpoint.image_input`); without it, requests with media are
  refused.

Every failure is a ``CheckpointError`` naming the file and the key. Nothing
is ever written into (or changed in) the directory: files are only opened for
reading, and tensors are read with safetensors' ``safe_open``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decoder_svc.checkpoint_files import (
    CONFIG,
    INDEX,
    SINGLE,
    CheckpointError,
    CheckpointFiles,
    read_json,
    read_weights,
)

from .checkpoint_tensors import expected_shapes, required_prefixes, required_tensors
from .media_features import AudioFeatures, ImageFeatures

__all__ = [
    "ARCHITECTURE",
    "AudioFeatures",
    "CONFIG",
    "INDEX",
    "SINGLE",
    "CheckpointError",
    "OmniCheckpoint",
]

ARCHITECTURE = "Qwen3OmniMoeForConditionalGeneration"

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
PREPROCESSOR_CONFIG = "preprocessor_config.json"
CHAT_TEMPLATE_JSON = "chat_template.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"


# -- config.json --------------------------------------------------------------------------

_INT = "int"
_INT_LIST = "list of int"

_TEXT_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "moe_intermediate_size",
    "num_experts_per_tok",
)
_CODE_PREDICTOR_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_code_groups",
)
_CODEC_IDS = (
    "codec_pad_id",
    "codec_bos_id",
    "codec_eos_token_id",
    "codec_nothink_id",
    "codec_think_bos_id",
    "codec_think_eos_id",
)
_TALKER_KEYS = ("num_code_groups", "thinker_hidden_size", "accept_hidden_layer", *_CODEC_IDS)
_CODE2WAV_KEYS: tuple[tuple[str, str], ...] = (
    ("codebook_size", _INT),
    ("num_quantizers", _INT),
    ("hidden_size", _INT),
    ("upsample_rates", _INT_LIST),
    ("upsampling_ratios", _INT_LIST),
    ("decoder_dim", _INT),
    ("sliding_window", _INT),
    ("num_hidden_layers", _INT),
)
TOP_LEVEL_TOKEN_IDS = (
    "im_start_token_id",
    "im_end_token_id",
    "tts_pad_token_id",
    "tts_bos_token_id",
    "tts_eos_token_id",
    "system_token_id",
    "user_token_id",
    "assistant_token_id",
)
# Keys that must be >= 1 (sizes and counts); ids and layer indexes may be 0.
_POSITIVE = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "moe_intermediate_size",
        "num_experts",
        "num_experts_per_tok",
        "shared_expert_intermediate_size",
        "num_code_groups",
        "thinker_hidden_size",
        "codebook_size",
        "num_quantizers",
        "decoder_dim",
        "sliding_window",
    }
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _ConfigReader:
    """Typed access to config.json's nested dicts; errors name the dotted key."""

    def __init__(self, file: Path) -> None:
        self.file = file

    def error(self, key: str, message: str) -> CheckpointError:
        return CheckpointError(self.file, key, message)

    def section(self, parent: dict, name: str, where: str = "") -> dict:
        key = f"{where}{name}"
        value = parent.get(name)
        if value is None:
            raise self.error(key, "missing (required for serving)")
        if not isinstance(value, dict):
            raise self.error(key, f"must be a mapping, got {type(value).__name__}")
        return value

    def integer(self, section: dict, name: str, where: str) -> int:
        key = f"{where}{name}"
        if name not in section or section[name] is None:
            raise self.error(key, "missing (required for serving)")
        value = section[name]
        if not _is_int(value):
            raise self.error(key, f"must be an integer, got {value!r}")
        if name in _POSITIVE and value < 1:
            raise self.error(key, f"must be >= 1, got {value}")
        if value < 0:
            raise self.error(key, f"must be >= 0, got {value}")
        return value

    def int_list(self, section: dict, name: str, where: str) -> list[int]:
        key = f"{where}{name}"
        value = section.get(name)
        if value is None:
            raise self.error(key, "missing (required for serving)")
        if not isinstance(value, list) or not value or not all(_is_int(v) and v >= 1 for v in value):
            raise self.error(key, f"must be a non-empty list of positive integers, got {value!r}")
        return value

    def num_experts(self, section: dict, where: str) -> int:
        # transformers >= 5 writes the talker's count as num_local_experts
        # (num_experts is an alias there); released configs say num_experts.
        for name in ("num_experts", "num_local_experts"):
            if section.get(name) is not None:
                return self.integer(section, name, where)
        raise self.error(f"{where}num_experts", "missing (required for serving)")

    def head_dim(self, section: dict, where: str) -> int:
        if section.get("head_dim") is not None:
            return self.integer(section, "head_dim", where)
        hidden, heads = section["hidden_size"], section["num_attention_heads"]
        if hidden % heads:
            raise self.error(
                f"{where}head_dim",
                f"missing, and not derivable: hidden_size {hidden} is not a multiple of "
                f"num_attention_heads {heads}",
            )
        return hidden // heads

    def text_model(self, section: dict, where: str, extra: Iterable[str] = ()) -> dict[str, Any]:
        out: dict[str, Any] = {name: self.integer(section, name, where) for name in (*_TEXT_KEYS, *extra)}
        out["num_experts"] = self.num_experts(section, where)
        out["head_dim"] = self.head_dim(section, where)
        return out


def _validate_config(file: Path, config: Any) -> None:
    r = _ConfigReader(file)
    if not isinstance(config, dict):
        raise r.error("(top level)", f"must be a JSON object, got {type(config).__name__}")
    archs = config.get("architectures")
    if not isinstance(archs, list) or ARCHITECTURE not in archs:
        raise r.error(
            "architectures",
            f"found {archs!r}; supported: [{ARCHITECTURE!r}] (a Qwen3-Omni-MoE checkpoint "
            "with thinker, talker and code2wav)",
        )
    if config.get("enable_audio_output") is False:
        raise r.error(
            "enable_audio_output",
            "false: this checkpoint has no speech output (talker and code2wav); serving needs it",
        )
    thinker = r.section(config, "thinker_config")
    talker = r.section(config, "talker_config")
    code2wav = r.section(config, "code2wav_config")

    w_thinker = "thinker_config.text_config."
    th = r.text_model(r.section(thinker, "text_config", "thinker_config."), w_thinker)

    w_talker_text = "talker_config.text_config."
    tt = r.text_model(
        r.section(talker, "text_config", "talker_config."),
        w_talker_text,
        extra=("shared_expert_intermediate_size",),
    )
    w_cp = "talker_config.code_predictor_config."
    cp_section = r.section(talker, "code_predictor_config", "talker_config.")
    cp = {name: r.integer(cp_section, name, w_cp) for name in _CODE_PREDICTOR_KEYS}
    cp["head_dim"] = r.head_dim(cp_section, w_cp)
    tk = {name: r.integer(talker, name, "talker_config.") for name in _TALKER_KEYS}
    speakers = talker.get("speaker_id")
    if speakers is None:
        raise r.error("talker_config.speaker_id", "missing (required for serving: the voices)")
    if not isinstance(speakers, dict) or not speakers:
        raise r.error(
            "talker_config.speaker_id",
            f"must be a non-empty mapping of speaker name to codec id, got {speakers!r}",
        )
    for name, value in speakers.items():
        if not _is_int(value) or value < 0:
            raise r.error(f"talker_config.speaker_id.{name}", f"must be an integer id >= 0, got {value!r}")

    w_c2w = "code2wav_config."
    c2w: dict[str, Any] = {}
    for name, kind in _CODE2WAV_KEYS:
        c2w[name] = r.integer(code2wav, name, w_c2w) if kind == _INT else r.int_list(code2wav, name, w_c2w)
    top = {name: r.integer(config, name, "") for name in TOP_LEVEL_TOKEN_IDS}

    def same(key_a: str, a: int, key_b: str, b: int) -> None:
        if a != b:
            raise r.error(key_a, f"{key_a} = {a} but {key_b} = {b}; they must be equal")

    same("talker_config.thinker_hidden_size", tk["thinker_hidden_size"],
         f"{w_thinker}hidden_size", th["hidden_size"])
    same(f"{w_c2w}num_quantizers", c2w["num_quantizers"],
         "talker_config.num_code_groups", tk["num_code_groups"])
    same(f"{w_cp}num_code_groups", cp["num_code_groups"],
         "talker_config.num_code_groups", tk["num_code_groups"])
    same(f"{w_cp}vocab_size", cp["vocab_size"], f"{w_c2w}codebook_size", c2w["codebook_size"])
    if tk["num_code_groups"] < 2:
        raise r.error("talker_config.num_code_groups",
                      f"must be >= 2 (one talker code plus predicted ones), got {tk['num_code_groups']}")

    talker_vocab = tt["vocab_size"]
    ids = {f"talker_config.{name}": tk[name] for name in _CODEC_IDS}
    ids.update({f"talker_config.speaker_id.{name}": v for name, v in speakers.items()})
    for key, value in ids.items():
        if value >= talker_vocab:
            raise r.error(key, f"{key} = {value} but {w_talker_text}vocab_size = {talker_vocab}; "
                               "the id must be < vocab_size")
    eos = tk["codec_eos_token_id"]
    if eos < cp["vocab_size"]:
        raise r.error(
            "talker_config.codec_eos_token_id",
            f"talker_config.codec_eos_token_id = {eos} but {w_cp}vocab_size = {cp['vocab_size']}; "
            "the end-of-speech id must not be a codec code (codes are 0..vocab_size-1)",
        )
    accept = tk["accept_hidden_layer"]
    if not 0 < accept <= th["num_hidden_layers"]:
        raise r.error(
            "talker_config.accept_hidden_layer",
            f"talker_config.accept_hidden_layer = {accept} but {w_thinker}num_hidden_layers = "
            f"{th['num_hidden_layers']}; it must be in 1..num_hidden_layers",
        )
    for key, value in top.items():
        if value >= th["vocab_size"]:
            raise r.error(key, f"{key} = {value} but {w_thinker}vocab_size = {th['vocab_size']}; "
                               "the id must be < vocab_size")


# -- files ---------------------------------------------------------------------------------


class SubConfigs:
    """The sub-configurations of a Qwen3-Omni ``config.json`` (``self.config``)."""

    config: dict

    @property
    def thinker_config(self) -> dict:
        return self.config["thinker_config"]

    @property
    def talker_config(self) -> dict:
        return self.config["talker_config"]

    @property
    def code2wav_config(self) -> dict:
        return self.config["code2wav_config"]


def _media_features(path: Path, config: dict) -> tuple[AudioFeatures | None, ImageFeatures | None]:
    """What the thinker's encoders read, from preprocessor_config.json (none without it)."""
    file = path / PREPROCESSOR_CONFIG
    if not file.exists():
        return None, None
    data = read_json(file, "preprocessor_config")
    if not isinstance(data, dict):
        raise CheckpointError(file, "(top level)", f"must be a JSON object, got {type(data).__name__}")

    def positive(key: str, default: Any = None) -> int:
        value = data.get(key, default)
        if not _is_int(value) or value <= 0:
            raise CheckpointError(file, key, f"must be a positive integer, got {value!r}")
        return int(value)

    if data.get("feature_extractor_type", "WhisperFeatureExtractor") != "WhisperFeatureExtractor":
        raise CheckpointError(file, "feature_extractor_type",
                              f"{data['feature_extractor_type']!r}; serving reads WhisperFeatureExtractor's features")
    n_window = config["thinker_config"].get("audio_config", {}).get("n_window", 50)
    if not _is_int(n_window) or n_window <= 0:
        raise CheckpointError(path / CONFIG, "thinker_config.audio_config.n_window",
                              f"must be a positive integer, got {n_window!r}")
    audio = AudioFeatures(rate=positive("sampling_rate"), hop=positive("hop_length"), n_window=int(n_window))
    image = None
    if "image_processor_type" in data and "vision_config" in config["thinker_config"]:
        size = data.get("size") if isinstance(data.get("size"), dict) else {}
        image = ImageFeatures(patch=positive("patch_size"), merge=positive("merge_size"),
                              min_pixels=positive("min_pixels", size.get("shortest_edge")),
                              max_pixels=positive("max_pixels", size.get("longest_edge")))
    return audio, image


@dataclass(frozen=True)
class OmniCheckpoint(SubConfigs, CheckpointFiles):
    """A validated Qwen3-Omni-MoE checkpoint directory (see the module docstring)."""

    # the thinker's audio and image input (preprocessor_config.json); None: not taken
    audio_input: AudioFeatures | None = None
    image_input: ImageFeatures | None = None

    # -- opening
    @classmethod
    def open(cls, path: str | Path) -> OmniCheckpoint:
        """Validate the directory and return it; raises CheckpointError (file, key, message)."""
        path = Path(path).expanduser()
        if not path.exists():
            raise CheckpointError(path, "path", "no such directory")
        if not path.is_dir():
            raise CheckpointError(path, "path", "not a directory (expected a checkpoint folder)")
        path = path.resolve()

        config_file = path / CONFIG
        config = read_json(config_file, "config")
        _validate_config(config_file, config)

        generation: dict = {}
        gen_file = path / GENERATION_CONFIG
        if gen_file.exists():
            generation = read_json(gen_file, "generation_config")
            if not isinstance(generation, dict):
                raise CheckpointError(gen_file, "(top level)",
                                      f"must be a JSON object, got {type(generation).__name__}")

        weight_map, shapes, index_file = read_weights(path)
        _check_tensors(config, weight_map, shapes, path, index_file)
        _check_tokenizer(path)
        audio, image = _media_features(path, config)
        return cls(path=path, config=config, generation_config=generation, weight_map=weight_map, shapes=shapes,
                   audio_input=audio, image_input=image)



def _check_tensors(config: dict, weight_map: dict[str, str], shapes: dict[str, list[int]],
                   path: Path, index_file: Path) -> None:
    for name in required_tensors(config):
        if name not in weight_map:
            raise CheckpointError(index_file, name, "missing")
    names = sorted(weight_map)
    for prefix in required_prefixes(config):
        if not any(n.startswith(prefix) for n in names):
            raise CheckpointError(index_file, prefix + "*", "missing (no tensor with this prefix)")
    for name, (want, how) in expected_shapes(config).items():
        if name not in weight_map:  # e.g. a tied lm_head
            continue
        got = shapes.get(name)
        if got is not None and list(got) != list(want):
            raise CheckpointError(path / weight_map[name], name,
                                  f"shape {list(got)} but the config implies {list(want)} {how}")


def _check_tokenizer(path: Path) -> None:
    if not (path / "tokenizer.json").is_file() and not (
        (path / "vocab.json").is_file() and (path / "merges.txt").is_file()
    ):
        raise CheckpointError(path / "tokenizer.json", "tokenizer",
                              "no tokenizer: neither tokenizer.json nor vocab.json + merges.txt")
    tok_config = path / TOKENIZER_CONFIG
    if tok_config.is_file():
        data = read_json(tok_config, "tokenizer_config")
        if not isinstance(data, dict):
            raise CheckpointError(tok_config, "(top level)",
                                  f"must be a JSON object, got {type(data).__name__}")
        if _template_ok(data.get("chat_template")):
            return
    template_json = path / CHAT_TEMPLATE_JSON
    if template_json.is_file():
        data = read_json(template_json, "chat_template")
        if not isinstance(data, dict) or not _template_ok(data.get("chat_template")):
            raise CheckpointError(template_json, "chat_template", "missing or empty")
        return
    template_jinja = path / CHAT_TEMPLATE_JINJA
    if template_jinja.is_file():
        try:
            text = template_jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(template_jinja, "chat_template", f"cannot read: {exc}") from exc
        if text.strip():
            return
        raise CheckpointError(template_jinja, "chat_template", "empty")
    raise CheckpointError(
        template_json, "chat_template",
        f"no chat template: none in {TOKENIZER_CONFIG} (key chat_template), "
        f"{CHAT_TEMPLATE_JSON} or {CHAT_TEMPLATE_JINJA}",
    )


def _template_ok(value: Any) -> bool:
    """A template string, or transformers' list of named templates."""
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, list):
        return bool(value) and all(isinstance(v, dict) and isinstance(v.get("template"), str) for v in value)
    return False
