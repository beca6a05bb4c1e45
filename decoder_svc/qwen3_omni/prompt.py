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

The talker can start before the thinker has finished: the prompt needs the
reply only up to its first token's row, and ``trailing`` grows as the reply
arrives (:class:`TalkerPromptBuilder`; :func:`build_talker_prompt` is the
same construction fed the whole reply at once, with the same numbers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from omni_common.errors import InvalidArgumentError

__all__ = ["PROJECTION_BLOCK", "TalkerIds", "TalkerPrompt", "TalkerPromptBuilder", "build_talker_prompt"]

# Rows per projection call over the assistant turn (see _BlockProjection).
PROJECTION_BLOCK = 16


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


class _BlockProjection:
    """``fn`` (a row-wise projection) over a run of rows that grows at its
    end, handed out in order.

    The rows are projected in blocks of ``block`` rows aligned to the run's
    start, the open last block zero-padded: a matrix product's rounding
    depends on its number of rows, so projecting the whole run at once and
    projecting it piece by piece would differ in the last bits. Computed in
    fixed blocks, a row's value is the same however the run arrived. Raw rows
    are kept only until their block is handed out.
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], block: int) -> None:
        self._fn = fn
        self._block = block
        self._raw: torch.Tensor | None = None  # rows [base, end) of the run
        self._base = 0  # first raw row: a block start
        self._end = 0  # rows fed
        self._taken = 0  # rows handed out

    def __len__(self) -> int:
        return self._end

    def feed(self, rows: torch.Tensor) -> None:
        if rows.shape[0] == 0:
            return
        self._raw = rows if self._raw is None else torch.cat((self._raw, rows))
        self._end += int(rows.shape[0])

    def take(self, upto: int) -> torch.Tensor:
        """Rows [handed out so far, upto) projected; they count as handed out."""
        assert self._raw is not None and self._taken <= upto <= self._end
        b, lo = self._block, self._taken
        parts = []
        for start in range(lo - lo % b, upto, b):
            raw = self._raw[start - self._base : start - self._base + b]
            if raw.shape[0] < b:
                raw = torch.cat((raw, raw.new_zeros((b - raw.shape[0], raw.shape[1]))))
            out = self._fn(raw)
            parts.append(out[max(lo - start, 0) : min(upto - start, b)])
        self._taken = upto
        drop = upto - upto % b - self._base  # whole blocks handed out
        if drop > 0:
            self._raw = self._raw[drop:]
            self._base += drop
        return torch.cat(parts) if parts else self._raw.new_zeros((0, 0))


class TalkerPromptBuilder:
    """The talker's input built as the thinker's reply arrives (see the
    module docstring): :meth:`add` the reply's token ids and the thinker's
    rows as they come, build the prompt with :meth:`head` once the first
    reply token's row is there, then :meth:`take` the per-step rows known so
    far after each :meth:`add`.

    The numbers do not depend on how the reply was cut into pieces: the
    projections run in fixed blocks (:data:`PROJECTION_BLOCK` rows, see
    :class:`_BlockProjection`), so feeding the whole reply at once
    (:func:`build_talker_prompt`) or a few rows at a time gives the same
    tensors, bit for bit.

    Trailing row ``t`` is the projected thinker row at position
    ``a + 4 + t`` (``a``: the assistant turn's ``<|im_start|>``, so row
    ``t`` reads reply token ``t + 1``). Until the reply ends, a row is known
    once its position was forwarded and no end-of-turn came before it; at the
    end (``finished``) the row after the last forwarded one -- or the one at
    the first end-of-turn, whichever comes first -- is ``tts_eos``, and the
    rest up to the one-shot length is ``tts_pad``. :attr:`complete` is then
    True: every later step reads ``tts_pad`` (:attr:`pad`).
    """

    def __init__(
        self,
        ids: TalkerIds,
        prompt_ids: list[int],
        *,
        speaker_id: int,
        text_projection: Callable[[torch.Tensor], torch.Tensor],
        hidden_projection: Callable[[torch.Tensor], torch.Tensor],
        codec_embedding: Callable[[torch.Tensor], torch.Tensor],
        thinker_token_embed: Callable[[torch.Tensor], torch.Tensor],
        end_ids: frozenset[int] = frozenset(),
        block: int = PROJECTION_BLOCK,
    ) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.ids = ids
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.reply_ids: list[int] = []
        self.speaker_id = speaker_id
        self.end_ids = end_ids
        self._text_projection = text_projection
        self._hidden_projection = hidden_projection
        self._codec_embedding = codec_embedding
        self._thinker_token_embed = thinker_token_embed
        self._block = block
        self._pending: list[torch.Tensor] = []  # thinker rows until the head is built
        self._rows = 0  # thinker rows added
        self._first_end: int | None = None  # reply index of the first end-of-turn id
        self._proj: _BlockProjection | None = None  # rows from the assistant turn on (after head)
        self._start = -1  # thinker position of trailing row 0 (after head)
        self._next = 0  # trailing rows handed out
        self._specials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.user_positions: list[int] = []  # set by head()
        self.finished = False  # the reply ended (no more rows will come)
        self.complete = False  # every trailing row was handed out (then tts_pad)

    @property
    def pad(self) -> torch.Tensor:
        """The projected ``tts_pad`` embedding [H] (after :meth:`head`)."""
        assert self._specials is not None, "head() first"
        return self._specials[2].clone()

    @torch.inference_mode()
    def add(self, reply_ids: list[int], thinker_embed: torch.Tensor, *, finished: bool = False) -> None:
        """More of the reply: its next token ids and the thinker's next rows
        (one per forwarded position: after this call the rows number
        ``len(prompt) + len(reply so far) - 1``). ``finished``: the reply
        ended with these (its last token is never forwarded)."""
        if self.finished:
            raise InvalidArgumentError("conditioning", "the reply already ended; nothing can be added")
        for t in reply_ids:
            if self._first_end is None and int(t) in self.end_ids:
                self._first_end = len(self.reply_ids)
            self.reply_ids.append(int(t))
        if finished and len(self.reply_ids) < 2:
            raise InvalidArgumentError("text", "the reply is empty: nothing to speak")
        self._rows += int(thinker_embed.shape[0])
        rows = len(self.prompt_ids) + len(self.reply_ids) - 1
        if self._rows != rows:  # e.g. a preempted request whose rows were computed twice
            raise InvalidArgumentError("thinker_embed", f"has {self._rows} rows for {rows} positions")
        embed = thinker_embed.to(torch.float32)
        if embed.shape[0] and self._proj is None:
            self._pending.append(embed)
        elif embed.shape[0]:
            self._proj.feed(embed)
        self.finished = finished

    @torch.inference_mode()
    def head(self, thinker_hidden: torch.Tensor | None) -> torch.Tensor:
        """The prompt embeddings [L, H]: the user turns and the assistant
        turn's head. Needs the rows up to the first reply token's (two reply
        ids: the first one's row comes with the second's step).
        ``thinker_hidden``: the thinker's hidden rows of (at least) the
        prompt's positions, for audio/image/video positions."""
        assert self._proj is None, "head() once"
        ids, seq, p = self.ids, self.prompt_ids, len(self.prompt_ids)
        if len(self.reply_ids) < 2:
            raise InvalidArgumentError(
                "conditioning.thinker_token_ids",
                f"the talker starts from the first reply token's row: needs 2 reply token ids, "
                f"got {len(self.reply_ids)}",
            )
        embed = torch.cat(self._pending) if len(self._pending) != 1 else self._pending[0]

        # the assistant turn of the prompt: the last <|im_start|> assistant
        starts = [i for i in range(p - 1) if seq[i] == ids.im_start and seq[i + 1] == ids.assistant]
        if not starts:
            raise InvalidArgumentError("prompt", "the chat prompt has no assistant turn")
        a = starts[-1]
        if embed.shape[0] < a + 4:
            raise InvalidArgumentError(
                "conditioning.thinker_token_ids",
                f"the assistant turn's head needs the rows up to position {a + 3}, got {embed.shape[0]} rows",
            )

        # 1) user turns: positions whose role token (after the last <|im_start|>) is `user`
        role = torch.full((p,), -1, dtype=torch.long)
        last = 0
        for i in range(p):
            if seq[i] == ids.im_start:
                last = i
            role[i] = seq[min(last + 1, p - 1)]
        user = (role == ids.user).nonzero().squeeze(1)
        self.user_positions = [int(u) for u in user]  # the prompt positions the talker's user part reads
        if user.numel() == 0:
            raise InvalidArgumentError("prompt", "the chat prompt has no user turn")
        mm = torch.tensor([seq[int(i)] in ids.multimodal for i in user], dtype=torch.bool)
        user_part = self._text_projection(embed[user])
        if bool(mm.any()):
            if thinker_hidden is None:
                raise InvalidArgumentError("thinker_hidden", "multimodal positions need the thinker's hidden states")
            user_part[mm] = self._hidden_projection(thinker_hidden[user[mm]].to(torch.float32))

        # 2) the assistant turn's head
        special = self._thinker_token_embed(torch.tensor([ids.tts_bos, ids.tts_eos, ids.tts_pad], dtype=torch.long))
        tts_bos, tts_eos, tts_pad = self._text_projection(special.to(torch.float32))
        self._specials = (tts_bos, tts_eos, tts_pad)
        self._proj = _BlockProjection(self._text_projection, self._block)
        self._proj.feed(embed[a:])
        self._pending = []
        self._start = a + 4
        assistant = self._proj.take(4)
        head_text = torch.cat((assistant[:3], tts_pad.expand(4, -1), tts_bos[None], assistant[3:4]))
        codec = self._codec_embedding(
            torch.tensor(
                [ids.codec_nothink, ids.codec_think_bos, ids.codec_think_eos, self.speaker_id, ids.codec_pad,
                 ids.codec_bos],
                dtype=torch.long,
            )
        ).to(torch.float32)
        head_codec = torch.cat((torch.zeros((3, codec.shape[-1]), dtype=torch.float32), codec))
        return torch.cat((user_part, head_text + head_codec)).contiguous()

    @torch.inference_mode()
    def take(self) -> torch.Tensor:
        """The trailing rows known now and not handed out yet, [k, H] (k may
        be 0), in step order; after the reply's end, the last ones (tts_eos,
        then tts_pad up to the one-shot length) and :attr:`complete` is set."""
        assert self._proj is not None and self._specials is not None, "head() first"
        if self.complete:
            return self._specials[2].new_zeros((0, self._specials[2].shape[-1]))
        forwarded = self._rows - self._start  # trailing rows whose thinker row is here
        first_end = len(self.reply_ids) if self._first_end is None else self._first_end
        known = min(first_end, forwarded)  # rows read from the thinker's rows
        total = forwarded + 1 if self.finished else known  # the one-shot length at the end
        parts = []
        if known > self._next:
            parts.append(self._proj.take(4 + known))
        if self.finished:
            _, tts_eos, tts_pad = self._specials
            parts.append(tts_eos[None])
            if total > known + 1:
                parts.append(tts_pad.expand(total - known - 1, -1))
            self.complete = True
        self._next = max(self._next, total)
        if not parts:
            return self._specials[2].new_zeros((0, self._specials[2].shape[-1]))
        return torch.cat(parts) if len(parts) > 1 else parts[0]


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
    """See the module docstring; the whole reply at once
    (:class:`TalkerPromptBuilder` fed in one piece).

    prompt_ids: the chat prompt (ends with ``<|im_start|>assistant\\n``);
    reply_ids: the assistant's reply as generated (its end-of-turn id
    included when it has one); thinker_embed / thinker_hidden: one row per
    forwarded position, ``len(prompt_ids) + len(reply_ids) - 1`` rows;
    thinker_token_embed: the thinker's input embedding table (for the
    tts_* ids); end_ids: the reply's end-of-turn ids.
    """
    b = TalkerPromptBuilder(
        ids,
        prompt_ids,
        speaker_id=speaker_id,
        text_projection=text_projection,
        hidden_projection=hidden_projection,
        codec_embedding=codec_embedding,
        thinker_token_embed=thinker_token_embed,
        end_ids=end_ids,
    )
    b.add(list(reply_ids), thinker_embed, finished=True)
    prompt_embeds = b.head(thinker_hidden)
    return TalkerPrompt(prompt_embeds, b.take().contiguous(), b.pad)
