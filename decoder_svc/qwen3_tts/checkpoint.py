"""Open and validate a Qwen3-TTS (12 Hz) checkpoint directory in the released layout.

``TTSCheckpoint.open(path)`` checks, before anything is served, that the
directory holds what serving reads (:mod:`.layout` names the files and
tensors):

- ``config.json``: architecture ``Qwen3TTSForConditionalGeneration``, a
  ``tts_model_type`` (``custom_voice``, ``voice_design``, ``base``), a
  ``talker_config`` (with its ``code_predictor_config``) whose sizes and ids
  agree (codec special ids inside the codec vocabulary, the speaker and
  language maps as objects of ids, every speaker's dialect entry, text ids
  inside the text vocabulary), and for ``base`` a ``speaker_encoder_config``
  whose x-vector has the talker's width;
- the weights (``model.safetensors``, or an index and its shards): every
  ``talker.*`` tensor, and ``speaker_encoder.*`` for ``base``, with the
  shapes the config implies;
- ``speech_tokenizer/``: ``config.json`` (the 12 Hz tokenizer: its decoder's
  quantizers and codebook size matching the talker's code groups and
  codes, 1920 samples a frame) and ``model.safetensors`` with the decoder's
  tensors at their shapes and the encoder's (``encoder.*``, reference clips
  for ``base``);
- a tokenizer (``tokenizer.json``, or ``vocab.json`` + ``merges.txt``);
- ``generation_config.json``, when present, a JSON object.

Every failure is a ``CheckpointError`` naming the file and the key. Nothing
is ever written into the directory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from decoder_svc.checkpoint_files import (
    CONFIG,
    CheckpointError,
    CheckpointFiles,
    read_json,
    read_weights,
    shard_keys,
)

from .layout import (
    ARCHITECTURE,
    KINDS,
    SPEECH_TOKENIZER_DIR,
    speaker_encoder_tensors,
    speech_decoder_tensors,
    talker_tensors,
)

if TYPE_CHECKING:
    import torch

__all__ = ["TTSCheckpoint", "CheckpointError", "is_qwen3_tts"]

GENERATION_CONFIG = "generation_config.json"
SPEECH_WEIGHTS = "model.safetensors"

_TALKER_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "num_code_groups", "text_hidden_size", "text_vocab_size")
_CODEC_IDS = ("codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_think_id", "codec_nothink_id",
              "codec_think_bos_id", "codec_think_eos_id")
_CP_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_code_groups")
_TEXT_IDS = ("im_start_token_id", "im_end_token_id", "tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id")
_DECODER_INTS = ("codebook_size", "codebook_dim", "latent_dim", "hidden_size", "num_hidden_layers",
                 "num_attention_heads", "num_quantizers", "decoder_dim")


def is_qwen3_tts(config: Any) -> bool:
    """Whether a parsed config.json is a Qwen3-TTS checkpoint's."""
    return isinstance(config, dict) and ARCHITECTURE in (config.get("architectures") or ())


def _int(file: Path, section: dict, key: str, where: str, *, positive: bool = True) -> int:
    value = section.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or (positive and value <= 0) or value < 0:
        raise CheckpointError(file, where + key, f"must be a {'positive ' if positive else ''}integer, got {value!r}")
    return value


def _section(file: Path, parent: dict, key: str, where: str = "") -> dict:
    value = parent.get(key)
    if not isinstance(value, dict):
        raise CheckpointError(file, where + key, f"missing or not an object (got {type(value).__name__})")
    return value


def _validate_config(file: Path, config: Any) -> None:
    if not isinstance(config, dict):
        raise CheckpointError(file, "(top level)", f"must be a JSON object, got {type(config).__name__}")
    if not is_qwen3_tts(config):
        raise CheckpointError(file, "architectures", f"must name {ARCHITECTURE}, got {config.get('architectures')!r}")
    kind = config.get("tts_model_type")
    if kind not in KINDS:
        raise CheckpointError(file, "tts_model_type", f"one of {', '.join(KINDS)}, got {kind!r}")
    talker = _section(file, config, "talker_config")
    t = "talker_config."
    sizes = {k: _int(file, talker, k, t) for k in _TALKER_INTS}
    if sizes["num_attention_heads"] % sizes["num_key_value_heads"]:
        raise CheckpointError(file, t + "num_attention_heads", "must be a multiple of num_key_value_heads")
    for key in _CODEC_IDS:
        if _int(file, talker, key, t, positive=False) >= sizes["vocab_size"]:
            raise CheckpointError(file, t + key, f"outside the codec vocabulary of {sizes['vocab_size']}")
    for key in _TEXT_IDS:
        if _int(file, config, key, "", positive=False) >= sizes["text_vocab_size"]:
            raise CheckpointError(file, key, f"outside the text vocabulary of {sizes['text_vocab_size']}")
    for key in ("codec_language_id", "spk_id", "spk_is_dialect"):
        value = talker.get(key)
        if not isinstance(value, dict):
            raise CheckpointError(file, t + key, "must be an object (name -> value; {} when there is none)")
    for name, cid in list(talker["codec_language_id"].items()) + list(talker["spk_id"].items()):
        ids = cid if isinstance(cid, list) else [cid]
        if not ids or not all(isinstance(i, int) and 0 <= i < sizes["vocab_size"] for i in ids):
            raise CheckpointError(file, t + f"{name}", f"codec id {cid!r} outside the codec vocabulary")
    for speaker in talker["spk_id"]:
        dialect = talker["spk_is_dialect"].get(speaker)
        if speaker not in talker["spk_is_dialect"] or (dialect is not False
                                                       and dialect not in talker["codec_language_id"]):
            raise CheckpointError(file, t + f"spk_is_dialect.{speaker}",
                                  "every speaker needs false or a dialect named in codec_language_id")
    if kind == "custom_voice" and not talker["spk_id"]:
        raise CheckpointError(file, t + "spk_id", "a custom_voice model needs at least one speaker")
    cp = _section(file, talker, "code_predictor_config", t)
    c = t + "code_predictor_config."
    cp_sizes = {k: _int(file, cp, k, c) for k in _CP_INTS}
    if cp_sizes["num_code_groups"] != sizes["num_code_groups"]:
        raise CheckpointError(file, c + "num_code_groups", f"{cp_sizes['num_code_groups']} but the talker has "
                                                           f"{sizes['num_code_groups']}")
    if kind == "base":
        spk = _section(file, config, "speaker_encoder_config")
        enc_dim = spk.get("enc_dim", 1024)
        if enc_dim != sizes["hidden_size"]:
            raise CheckpointError(file, "speaker_encoder_config.enc_dim",
                                  f"{enc_dim} but the talker's hidden size is {sizes['hidden_size']} "
                                  "(the x-vector takes a codec token's place)")


def _validate_speech_config(file: Path, config: Any, talker: dict) -> None:
    if not isinstance(config, dict):
        raise CheckpointError(file, "(top level)", f"must be a JSON object, got {type(config).__name__}")
    if config.get("model_type") != "qwen3_tts_tokenizer_12hz":
        raise CheckpointError(file, "model_type", f"must be qwen3_tts_tokenizer_12hz (the 12 Hz tokenizer), got "
                                                  f"{config.get('model_type')!r}")
    dec = _section(file, config, "decoder_config")
    d = "decoder_config."
    sizes = {k: _int(file, dec, k, d) for k in _DECODER_INTS}
    if sizes["num_quantizers"] != talker["num_code_groups"]:
        raise CheckpointError(file, d + "num_quantizers", f"{sizes['num_quantizers']} but the talker makes "
                                                          f"{talker['num_code_groups']} codes a frame")
    if sizes["codebook_size"] != talker["code_predictor_config"]["vocab_size"]:
        raise CheckpointError(file, d + "codebook_size", f"{sizes['codebook_size']} but the code predictor's "
                                                         f"vocabulary is {talker['code_predictor_config']['vocab_size']}")
    rates = list(dec.get("upsample_rates") or ()) + list(dec.get("upsampling_ratios") or ())
    rate = config.get("decode_upsample_rate", 1920)
    if not rates or math.prod(rates) != rate:
        raise CheckpointError(file, d + "upsample_rates", f"their product with upsampling_ratios must be the "
                                                          f"decode_upsample_rate {rate}, got {rates}")


def _check_shapes(file: Path, want: dict[str, tuple[int, ...]], got: dict[str, list[int]]) -> None:
    for name, shape in want.items():
        if name not in got:
            raise CheckpointError(file, name, "missing")
        if tuple(got[name]) != tuple(shape):
            raise CheckpointError(file, name, f"shape {list(got[name])} but the config implies {list(shape)}")


@dataclass(frozen=True)
class TTSCheckpoint(CheckpointFiles):
    """A validated Qwen3-TTS checkpoint directory (see the module docstring)."""

    speech_config: dict = field(default_factory=dict)

    @classmethod
    def open(cls, path: str | Path) -> TTSCheckpoint:
        """Validate the directory and return it; raises CheckpointError (file, key, message)."""
        path = Path(path).expanduser()
        if not path.is_dir():
            raise CheckpointError(path, "path", "no such directory" if not path.exists() else "not a directory")
        path = path.resolve()
        config_file = path / CONFIG
        config = read_json(config_file, "config")
        _validate_config(config_file, config)
        generation: dict = {}
        if (path / GENERATION_CONFIG).exists():
            generation = read_json(path / GENERATION_CONFIG, "generation_config")
            if not isinstance(generation, dict):
                raise CheckpointError(path / GENERATION_CONFIG, "(top level)", "must be a JSON object")
        weight_map, shapes, index_file = read_weights(path)
        want = talker_tensors(config["talker_config"])
        if config["tts_model_type"] == "base":
            want.update(speaker_encoder_tensors(config.get("speaker_encoder_config") or {}))
        _check_shapes(index_file, want, shapes)
        speech = path / SPEECH_TOKENIZER_DIR
        speech_config = read_json(speech / CONFIG, "speech tokenizer config")
        _validate_speech_config(speech / CONFIG, speech_config, config["talker_config"])
        speech_shapes = shard_keys(speech / SPEECH_WEIGHTS)
        _check_shapes(speech / SPEECH_WEIGHTS, speech_decoder_tensors(speech_config["decoder_config"]), speech_shapes)
        if not any(n.startswith("encoder.") for n in speech_shapes):
            raise CheckpointError(speech / SPEECH_WEIGHTS, "encoder.*", "missing (the speech tokenizer's encoder)")
        if not (path / "tokenizer.json").is_file() and not ((path / "vocab.json").is_file()
                                                           and (path / "merges.txt").is_file()):
            raise CheckpointError(path / "tokenizer.json", "tokenizer",
                                  "no tokenizer: neither tokenizer.json nor vocab.json + merges.txt")
        return cls(path=path, config=config, generation_config=generation, weight_map=weight_map, shapes=shapes,
                   speech_config=speech_config)

    def other_files(self) -> list[Path]:
        speech = self.path / SPEECH_TOKENIZER_DIR
        return [speech / CONFIG, speech / SPEECH_WEIGHTS]

    # -- what the config says
    @property
    def kind(self) -> str:
        return str(self.config["tts_model_type"])

    @property
    def talker_config(self) -> dict:
        return self.config["talker_config"]

    @property
    def speakers(self) -> dict[str, int]:
        """Built-in speakers (lower-case name -> codec id); none but for custom_voice."""
        return {str(k).lower(): int(v[0] if isinstance(v, list) else v) for k, v in self.talker_config["spk_id"].items()}

    @property
    def languages(self) -> dict[str, int]:
        """Languages a request may name (lower-case name -> codec id), dialects excluded."""
        return {str(k).lower(): int(v) for k, v in self.talker_config["codec_language_id"].items()
                if "dialect" not in str(k).lower()}

    def speech_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The speech tokenizer's tensors named ``prefix*`` (read only)."""
        from safetensors import safe_open

        with safe_open(str(self.path / SPEECH_TOKENIZER_DIR / SPEECH_WEIGHTS), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in sorted(f.keys()) if name.startswith(prefix)}
