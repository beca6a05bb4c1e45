"""The Qwen3-TTS talker's input: text, voice and language as prompt embeddings.

With ``T(ids)`` the talker's text rows (``text_projection(text_embedding(ids))``)
and ``C(ids)`` its codec embedding, a request's prompt is, in order:

1. its instruction, when it has one: ``T`` of ``<|im_start|>user\\n{instruction}<|im_end|>\\n``
   (a style for a built-in speaker, or the voice described in words);
2. the role: ``T`` of ``<|im_start|>assistant\\n``;
3. the codec prefix under the text's pads: ``[nothink, think_bos,
   think_eos]`` with no language (``auto``), else ``[think, think_bos,
   language, think_eos]`` (a speaker with a dialect speaks it for Chinese
   and ``auto``), then the voice's slot (a built-in speaker's codec
   embedding, a cloned voice's x-vector, or nothing), then ``[pad, bos]``;
   every position but the last gets ``tts_pad``'s row, the one before it
   ``tts_bos``'s; the last (``bos``) is added to the first text row;
4. the text: all of it at once (``non_streaming``, the default for speakers
   and described voices: every text row + ``C(pad)``, ``tts_eos``, then
   ``tts_pad + C(bos)``), or its first token only, the rest read one per
   step (streamed text, the default for cloned voices) followed by
   ``tts_eos``;
   for a clone with its reference's transcript (in-context), instead: the
   reference's text and the new text, then ``tts_eos``, aligned with
   ``C(bos)`` and the reference clip's codes (each frame its 16 codebooks'
   embeddings summed), as the reference implementation lays them.

After the prompt, each step's input is the frame's code embeddings plus the
next per-step text row (``trailing``), then ``tts_pad``'s row.

The rows are computed over the same spans as the reference implementation
(qwen-tts ``Qwen3TTSForConditionalGeneration.generate``), so its greedy
codes are reproduced (tests/test_qwen3_tts_parity.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from decoder_svc.qwen3_omni.prompt import TalkerPrompt

__all__ = ["TTSIds", "VoicePrompt", "build_prompt", "assistant_text", "instruct_text", "reference_text"]

Rows = Callable[[torch.Tensor], torch.Tensor]  # ids [n] -> rows [n, H]


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def instruct_text(instruction: str) -> str:
    return f"<|im_start|>user\n{instruction}<|im_end|>\n"


def reference_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


@dataclass(frozen=True)
class TTSIds:
    """The ids the prompt needs (config.json)."""

    tts_pad: int
    tts_bos: int
    tts_eos: int
    codec_pad: int
    codec_bos: int
    codec_think: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int

    @classmethod
    def from_config(cls, config: Mapping) -> TTSIds:
        t = config["talker_config"]
        return cls(
            tts_pad=int(config["tts_pad_token_id"]),
            tts_bos=int(config["tts_bos_token_id"]),
            tts_eos=int(config["tts_eos_token_id"]),
            codec_pad=int(t["codec_pad_id"]),
            codec_bos=int(t["codec_bos_id"]),
            codec_think=int(t["codec_think_id"]),
            codec_nothink=int(t["codec_nothink_id"]),
            codec_think_bos=int(t["codec_think_bos_id"]),
            codec_think_eos=int(t["codec_think_eos_id"]),
        )


@dataclass(frozen=True)
class VoicePrompt:
    """What one request says: ``text_ids`` (of :func:`assistant_text`), an
    instruction's ids (of :func:`instruct_text`) or None, the language's
    codec id (None: ``auto``), the voice (a speaker's codec id, an x-vector
    [H], or None), whether the text is given whole, and for an in-context
    clone the reference's text ids (of :func:`reference_text`) and its codes [F, G]."""

    text_ids: list[int]
    instruct_ids: list[int] | None = None
    language: int | None = None
    speaker: int | torch.Tensor | None = None
    non_streaming: bool = True
    ref_text_ids: list[int] | None = None
    ref_codes: torch.Tensor | None = None


def _ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def build_prompt(ids: TTSIds, voice: VoicePrompt, text_rows: Rows, codec_rows: Rows,
                 frame_rows: Callable[[torch.Tensor], torch.Tensor]) -> TalkerPrompt:
    """The talker's prompt embeddings [L, H], its per-step text rows [N, H]
    and the ``tts_pad`` row [H] (module docstring). ``text_rows``: T;
    ``codec_rows``: C; ``frame_rows``: codes [F, G] -> each frame's summed
    code embeddings [F, H] (an in-context clone's reference)."""
    text = voice.text_ids
    if len(text) < 9:  # 3 ids of the role, at least one of text, 5 of the ending
        raise ValueError("text_ids: the assistant turn of at least one token")
    bos, eos, pad = text_rows(_ids([ids.tts_bos, ids.tts_eos, ids.tts_pad])).unbind(0)
    parts: list[torch.Tensor] = []
    if voice.instruct_ids:
        parts.append(text_rows(_ids(voice.instruct_ids)))
    if voice.language is None:
        codec = [ids.codec_nothink, ids.codec_think_bos, ids.codec_think_eos]
    else:
        codec = [ids.codec_think, ids.codec_think_bos, voice.language, ids.codec_think_eos]
    prefix = [codec_rows(_ids(codec))]
    if isinstance(voice.speaker, int):
        prefix.append(codec_rows(_ids([voice.speaker])))
    elif voice.speaker is not None:
        prefix.append(voice.speaker.reshape(1, -1).to(pad))
    prefix.append(codec_rows(_ids([ids.codec_pad, ids.codec_bos])))
    codec_prefix = torch.cat(prefix)
    n = codec_prefix.shape[0]
    parts.append(text_rows(_ids(text[:3])))
    parts.append(torch.cat((pad.expand(n - 2, -1), bos[None])) + codec_prefix[:-1])
    if voice.ref_codes is not None and voice.ref_text_ids is not None:
        prompt, trailing = _in_context(ids, voice, text_rows, codec_rows, frame_rows, eos, pad)
        parts.append(prompt)
    elif voice.non_streaming:
        body = torch.cat((text_rows(_ids(text[3:-5])), eos[None]))
        parts.append(body + codec_rows(_ids([ids.codec_pad] * body.shape[0])))
        parts.append(pad[None] + codec_rows(_ids([ids.codec_bos])))
        trailing = pad[None, :0]
    else:
        parts.append(text_rows(_ids(text[3:4])) + codec_prefix[-1:])
        trailing = torch.cat((text_rows(_ids(text[4:-5])), eos[None]))
    return TalkerPrompt(prompt_embeds=torch.cat(parts), trailing=trailing, pad=pad)


def _in_context(ids: TTSIds, voice: VoicePrompt, text_rows: Rows, codec_rows: Rows,
                frame_rows: Callable[[torch.Tensor], torch.Tensor], eos: torch.Tensor,
                pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The in-context part of a clone's prompt and its per-step text rows."""
    assert voice.ref_text_ids is not None and voice.ref_codes is not None
    both = voice.ref_text_ids[3:-2] + voice.text_ids[3:-5]
    text = torch.cat((text_rows(_ids(both)), eos[None]))
    codec = torch.cat((codec_rows(_ids([ids.codec_bos])), frame_rows(voice.ref_codes)))
    if voice.non_streaming:
        prompt = torch.cat((text + codec_rows(_ids([ids.codec_pad] * text.shape[0])), codec + pad))
        return prompt, pad[None, :0]
    if text.shape[0] > codec.shape[0]:
        return text[: codec.shape[0]] + codec, text[codec.shape[0]:]
    text = torch.cat((text, pad.expand(codec.shape[0] - text.shape[0], -1)))
    return text + codec, pad[None, :0]
