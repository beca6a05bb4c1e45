"""A random-weight checkpoint at the released Qwen3-Omni-30B-A3B's widths.

``create_released_checkpoint(out_dir, layers=N)`` writes what the released
checkpoint's directory holds, with random weights and every stack cut to
``N`` layers (:func:`presets.released_config`):

- ``config.json``: the released configuration (widths, 128 experts top-8 in
  the thinker, the talker, code predictor and Code2Wav as released, special
  token ids, speaker map), ``torch_dtype`` bfloat16;
- ``model-0000i-of-0000n.safetensors`` shards in bfloat16 with their
  ``model.safetensors.index.json``, tensors under the released names (MoE
  experts one per key), shards cut at ``shard_bytes``;
- a tokenizer with the released special tokens at their ids (151643 ...
  151675) and the role words ``user``, ``system`` and ``assistant`` at 872,
  8948 and 77091; the rest of the 151,643 regular ids are a small byte-level
  BPE trained offline, padded with unreachable filler tokens so that every id
  the model can sample decodes;
- the chat template (text only) and ``generation_config.json``.

Weights are drawn tensor by tensor, each from its own generator seeded by
the seed and the tensor's name, so a shard is built in memory at a time
(about ``shard_bytes`` plus one tensor in float32) whatever the depth, and
the same seed writes the same bytes. The shapes come from the model built on
PyTorch's meta device: no model is materialized.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .presets import released_config
from .tiny import CHAT_TEMPLATE, GENERATION_CONFIG, chat_tokenizer, write_preprocessor_config

__all__ = [
    "RELEASED_FORMAT",
    "RELEASED_SPECIAL_TOKENS",
    "ROLE_WORDS",
    "checkpoint_bytes",
    "create_released_checkpoint",
    "released_tensor_shapes",
    "released_tokenizer",
]

# Bumped whenever what create_released_checkpoint writes changes.
RELEASED_FORMAT = 3

# The released tokenizer's added tokens, ids 151643 ... 151675 in this order
# (the ones the configuration names: im_start/end, vision, audio, tts_*).
RELEASED_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>",
    "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
)
FIRST_SPECIAL_ID = 151643
# Added tokens the released tokenizer does not mark special (they stay in decoded text).
_NOT_SPECIAL = frozenset({"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                          "</think>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                          "<|repo_name|>", "<|file_sep|>"})
# The role words are regular vocabulary in the released tokenizer, at these ids.
ROLE_WORDS: dict[str, int] = {"user": 872, "system": 8948, "assistant": 77091}

_BPE_VOCAB = 800  # trained merges: below 872, so no trained id collides with a role word's
_CORPUS: tuple[str, ...] = (
    "user", "assistant", "system",
    "You are a helpful assistant that answers in a calm and friendly voice.",
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This model reads text and speaks it aloud.",
    "A thinker reads the prompt and writes text; a talker turns text into speech codes.",
    "The code predictor fills the remaining codebooks for every audio frame.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2026 3.14 42.",
    "Punctuation, quotes \"like this\", (parentheses), [brackets] and {braces}; colons: yes.",
    "How are you today? I am fine, thank you. What is the weather like in the city?",
    "Please read the following sentence aloud. Once upon a time there was a small model.",
    "Speech synthesis converts written text into spoken audio at 24 kHz, streamed over gRPC.",
)


def released_tokenizer():
    """The tokenizer described in the module docstring (a ``PreTrainedTokenizerFast``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=_BPE_VOCAB, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([line + "\n" for line in _CORPUS] * 8, trainer=trainer)
    spec = json.loads(bpe.to_str())
    trained: dict[str, int] = spec["model"]["vocab"]
    vocab: dict[str, int] = {}
    for token, i in trained.items():
        if token not in ROLE_WORDS:
            vocab[token] = i
    missing = set(ROLE_WORDS) - set(trained)
    if missing:  # the corpus lists them, so the trainer merges them whole
        raise AssertionError(f"the BPE did not learn the role words {sorted(missing)}")
    vocab.update(ROLE_WORDS)
    taken = set(vocab.values())
    for i in range(FIRST_SPECIAL_ID):  # unreachable fillers: every id below the specials decodes
        if i not in taken:
            vocab[f"<|x{i}|>"] = i
    spec["model"]["vocab"] = vocab
    tok = Tokenizer.from_str(json.dumps(spec))
    for tid, t in enumerate(RELEASED_SPECIAL_TOKENS, FIRST_SPECIAL_ID):  # each takes the next id
        special = t not in _NOT_SPECIAL
        (tok.add_special_tokens if special else tok.add_tokens)([AddedToken(t, special=special, normalized=False)])
        if tok.token_to_id(t) != tid:
            raise AssertionError(f"{t} got id {tok.token_to_id(t)}, not {tid}")
    fast = chat_tokenizer(tok, model_max_length=65536)
    head = fast.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    head = head["input_ids"] if isinstance(head, dict) or hasattr(head, "keys") else head
    if head[-3:-1] != [FIRST_SPECIAL_ID + 1, ROLE_WORDS["assistant"]] or len(fast.decode(head[-1:])) != 1:
        raise AssertionError(f"the assistant turn does not open with <|im_start|>, assistant, newline: {head}")
    return fast


_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def released_tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensors (name -> shape) of a checkpoint with this ``config.json``,
    under the names released checkpoints use: the model built on the meta
    device, its fused expert tensors ([E, 2I, H] gate/up and [E, H, I] down)
    written one expert and projection per key."""
    import copy

    import torch
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(**copy.deepcopy(config)))
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in model.state_dict().items():
        m = _EXPERTS.match(name)
        if m is None:
            shapes[name] = tuple(t.shape)
            continue
        base, kind = m.groups()
        experts = t.shape[0]
        for e in range(experts):
            if kind == "gate_up_proj":
                half = t.shape[1] // 2
                shapes[f"{base}.{e}.gate_proj.weight"] = (half, t.shape[2])
                shapes[f"{base}.{e}.up_proj.weight"] = (half, t.shape[2])
            else:
                shapes[f"{base}.{e}.down_proj.weight"] = (t.shape[1], t.shape[2])
    return dict(sorted(shapes.items()))


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, layer_scale: float):
    """One tensor's weights (bfloat16): norms 1, biases 0, layer scales at the
    configured initial scale, SnakeBeta's log-scale parameters 0, Code2Wav's
    convolutions variance-preserving and its codebooks wide (audible output
    instead of near-denormal values), everything else N(0, 0.02)."""
    import torch

    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("alpha", "beta"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    if leaf == "scale":
        return torch.full(shape, layer_scale, dtype=torch.bfloat16)
    if len(shape) == 1:
        is_norm = leaf == "weight" and re.search(r"(norm\d?|ln_q|ln_post)\.weight$", name) is not None
        return (torch.ones if is_norm else torch.zeros)(shape, dtype=torch.bfloat16)
    # (a CPU generator keeps 32 bits of its seed: seed and name hashed together)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{int(seed)}/{name}".encode()))
    values = torch.randn(shape, generator=gen)
    if name.startswith("code2wav.code_embedding"):
        std = 0.5
    elif name.startswith(("code2wav.decoder", "code2wav.upsample")):
        std = 0.75 / math.prod(shape[1:]) ** 0.5
    else:
        std = 0.02
    return values.mul_(std).to(torch.bfloat16)


def _nbytes(shape: tuple[int, ...]) -> int:
    return 2 * math.prod(shape)  # bfloat16


def _shards(shapes: dict[str, tuple[int, ...]], shard_bytes: int) -> list[list[str]]:
    """Names grouped into shards of at most ``shard_bytes`` (a larger tensor
    gets a shard of its own), in name order."""
    out: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = _nbytes(shape)
        if out[-1] and size + nbytes > shard_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += nbytes
    return out


def checkpoint_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """The weights' size in bfloat16."""
    return sum(_nbytes(shape) for shape in shapes.values())


def _readable(directory: Path) -> None:
    """The modes a directory written with the umask would have (a temporary
    directory and the weight files start private): readable by the users
    and containers that serve it."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for f in directory.iterdir():
        os.chmod(f, 0o666 & ~umask)


def create_released_checkpoint(
    out_dir: str | Path,
    *,
    layers: int = 1,
    seed: int = 0,
    shard_bytes: int = 2 << 30,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write the checkpoint (module docstring) into the new directory
    ``out_dir``, atomically: a temporary sibling renamed into place, removed
    on any failure. Refused (``FileExistsError``) when ``out_dir`` exists,
    (``OSError``) when its file system lacks the space."""
    from safetensors.torch import save_file
    from transformers import Qwen3OmniMoeConfig

    if layers < 1:
        raise ValueError(f"layers: at least 1, got {layers}")
    if shard_bytes < 1 << 20:
        raise ValueError(f"shard_bytes: at least 1 MiB, got {shard_bytes}")
    say = progress or (lambda _msg: None)
    out_dir = Path(out_dir)
    if out_dir.exists() or out_dir.is_symlink():
        raise FileExistsError(f"{out_dir} exists; a checkpoint is only written to a new directory")
    config = released_config(layers)
    shapes = released_tensor_shapes(config)
    total = checkpoint_bytes(shapes)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out_dir.parent).free
    if free < total + (64 << 20):
        raise OSError(f"{out_dir.parent} has {free / 2**30:.1f} GiB free; the checkpoint needs "
                      f"{total / 2**30:.1f} GiB (bfloat16, {layers} layer(s) per stack)")
    groups = _shards(shapes, shard_bytes)
    layer_scale = float(config["code2wav_config"]["layer_scale_initial_scale"])
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        cfg = Qwen3OmniMoeConfig(**config)
        cfg.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
        cfg.dtype = "bfloat16"
        cfg.save_pretrained(tmp)
        weight_map: dict[str, str] = {}
        started = time.monotonic()
        for i, names in enumerate(groups, 1):
            file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            tensors = {n: _random_tensor(n, shapes[n], seed, layer_scale) for n in names}
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            del tensors
            weight_map.update(dict.fromkeys(names, file))
            say(f"shard {i}/{len(groups)} written ({(tmp / file).stat().st_size / 2**30:.2f} GiB, "
                f"{time.monotonic() - started:.0f} s)")
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        gen = dict(GENERATION_CONFIG)
        gen.update(eos_token_id=FIRST_SPECIAL_ID + 2, pad_token_id=FIRST_SPECIAL_ID)
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
        released_tokenizer().save_pretrained(tmp)
        (tmp / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
        write_preprocessor_config(tmp, patch_size=int(config["thinker_config"]["vision_config"]["patch_size"]))
        marker = {"preset": "released", "format": RELEASED_FORMAT, "layers": layers, "seed": int(seed)}
        (tmp / "omni_serving_preset.json").write_text(json.dumps(marker) + "\n")
        _readable(tmp)
        os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir

