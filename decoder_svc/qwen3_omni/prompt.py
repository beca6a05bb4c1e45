"""The talker's input, built from the thinker's side of a conversation.

Given the token ids of the whole thinker sequence (chat prompt + the
assistant's reply) and the thinker's per-position embeddings (and hidden
states at ``accept_hidden_layer``, for audio/image/video positions), the
talker starts from

- the user turns: ``text_projection(embedding)`` per text position,
  ``hidden_projection(hidden)`` per multimodal position;
- the assistant turn's head: its first 3 positions (``<|im_start|>``,
  ``assistant``, newline) projected, 4 ``tts_pad``, ``tts_bos`` and the first
  reply token, each added to the codec control embeddings
  (zeros x 3, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos);

and then consumes one more reply token per step (``trailing``), then
``tts_eos``, then ``tts_pad`` for as long as it keeps speaking.

Positions follow the thinker's forward passes: the reply's last token (the
end of turn, or the last one when the reply was cut) is never forwarded, so
it has no embedding and is not spoken. This matches the reference
implementation's conventions exactly (see docs/models.md, parity).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from omni_common.errors import InvalidArgumentError

__all__ = ["TalkerIds", "TalkerPrompt", "build_talker_prompt"]


@dataclass(frozen=True)
class TalkerIds:
    """Token ids the construction needs (from config.json)."""

    im_start: int
    user: int
    assistant: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    multimodal: frozenset[int]  # audio / image / video placeholder ids
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int
    codec_pad: int
    codec_bos: int

    @classmethod
    def from_config(cls, config: Mapping) -> TalkerIds:
        th, tk = config["thinker_config"], config["talker_config"]
        return cls(
            im_start=int(config["im_start_token_id"]),
            user=int(config["user_token_id"]),
            assistant=int(config["assistant_token_id"]),
            tts_pad=int(config["tts_pad_token_id"]),
            tts_bos=int(config["tts_bos_token_id"]),
            tts_eos=int(config["tts_eos_token_id"]),
            multimodal=frozenset(int(th[k]) for k in ("audio_token_id", "image_token_id", "video_token_id") if k in th),
            codec_nothink=int(tk["codec_nothink_id"]),
            codec_think_bos=int(tk["codec_think_bos_id"]),
            codec_think_eos=int(tk["codec_think_eos_id"]),
            codec_pad=int(tk["codec_pad_id"]),
            codec_bos=int(tk["codec_bos_id"]),
        )


@dataclass
class TalkerPrompt:
    prompt_embeds: torch.Tensor  # [L, H]
    trailing: torch.Tensor  # [N, H], then tts_pad
    pad: torch.Tensor  # [H]


@torch.inference_mode()
def build_talker_prompt(
    ids: TalkerIds,
    prompt_ids: list[int],
    reply_ids: list[int],
    thinker_embed: torch.Tensor,
    thinker_hidden: torch.Tensor | None,
    *,
    speaker_id: int,
    text_projection: Callable[[torch.Tensor], torch.Tensor],
    hidden_projection: Callable[[torch.Tensor], torch.Tensor],
    codec_embedding: Callable[[torch.Tensor], torch.Tensor],
    thinker_token_embed: Callable[[torch.Tensor], torch.Tensor],
    end_ids: frozenset[int] = frozenset(),
) -> TalkerPrompt:
    """See the module docstring.

    prompt_ids: the chat prompt (ends with ``<|im_start|>assistant\\n``);
    reply_ids: the assistant's reply as generated (its end-of-turn id
    included when it has one); thinker_embed / thinker_hidden: one row per
    forwarded position, ``len(prompt_ids) + len(reply_ids) - 1`` rows;
    thinker_token_embed: the thinker's input embedding table (for the
    tts_* ids); end_ids: the reply's end-of-turn ids.
    """
    seq = list(prompt_ids) + list(reply_ids)
    p = len(prompt_ids)
    rows = len(seq) - 1
    if len(reply_ids) < 2:
        raise InvalidArgumentError("text", "the reply is empty: nothing to speak")
    if thinker_embed.shape[0] != rows:  # e.g. a preempted request whose rows were computed twice
        raise InvalidArgumentError("thinker_embed", f"has {thinker_embed.shape[0]} rows for {rows} positions")
    embed = thinker_embed[:rows].to(torch.float32)

    # the assistant turn of the prompt: the last <|im_start|> assistant
    starts = [i for i in range(p - 1) if seq[i] == ids.im_start and seq[i + 1] == ids.assistant]
    if not starts:
        raise InvalidArgumentError("prompt", "the chat prompt has no assistant turn")
    a = starts[-1]

    # 1) user turns: positions whose role token (after the last <|im_start|>) is `user`
    role = torch.full((p,), -1, dtype=torch.long)
    last = 0
    for i in range(p):
        if seq[i] == ids.im_start:
            last = i
        role[i] = seq[min(last + 1, p - 1)]
    user = (role == ids.user).nonzero().squeeze(1)
    if user.numel() == 0:
        raise InvalidArgumentError("prompt", "the chat prompt has no user turn")
    mm = torch.tensor([seq[int(i)] in ids.multimodal for i in user], dtype=torch.bool)
    user_part = text_projection(embed[user])
    if bool(mm.any()):
        if thinker_hidden is None:
            raise InvalidArgumentError("thinker_hidden", "multimodal positions need the thinker's hidden states")
        user_part[mm] = hidden_projection(thinker_hidden[user[mm]].to(torch.float32))

    # 2) the assistant turn's head
    special = thinker_token_embed(torch.tensor([ids.tts_bos, ids.tts_eos, ids.tts_pad], dtype=torch.long))
    tts_bos, tts_eos, tts_pad = text_projection(special.to(torch.float32))
    assistant = text_projection(embed[a:rows])
    head_text = torch.cat((assistant[:3], tts_pad.expand(4, -1), tts_bos[None], assistant[3:4]))
    codec = codec_embedding(
        torch.tensor(
            [ids.codec_nothink, ids.codec_think_bos, ids.codec_think_eos, speaker_id, ids.codec_pad, ids.codec_bos],
            dtype=torch.long,
        )
    ).to(torch.float32)
    head_codec = torch.cat((torch.zeros((3, codec.shape[-1]), dtype=torch.float32), codec))
    prompt_embeds = torch.cat((user_part, head_text + head_codec))

    # 3) the rest of the reply, one position per step, then tts_eos
    trailing = torch.cat((assistant[4:], tts_eos[None]))
    reply = seq[p:]
    first_end = next((j for j, t in enumerate(reply) if t in end_ids), len(reply))
    if first_end < trailing.shape[0]:
        trailing = trailing.clone()
        trailing[first_end] = tts_eos
        trailing[first_end + 1 :] = tts_pad
    return TalkerPrompt(prompt_embeds.contiguous(), trailing.contiguous(), tts_pad.clone())
