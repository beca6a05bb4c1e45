"""The fake engine: a deterministic test double where the model goes (not a model).

`--engine fake` serves it: the unit, pipeline and stack tests and the quick
benchmarks use it because it starts in a second and its outputs are exact.
It has two parts: :class:`FakeBackend` for the AR stages and
:class:`FakeVocoder` (a sine table) for code2wav.

As a talker it behaves like one under continuous batching: requests join at
any step (a prefill step with one hidden row per prompt token), then decode
one codec frame per step (codebook 0 is the sampled token; a code-predictor
fills the other codebooks), and finish after a length fixed by the prompt.
As a thinker it writes text (one printable byte token per step) and exposes
hidden rows for the talker. A talker request conditioned on a thinker's
output speaks the thinker's tokens.

Every number is an integer hash of (seed, position, index), computed with
batched int64 tensor ops, so a request's outputs never depend on which other
requests share its batch or on timing: the same seed gives the same codes on
the synchronous and the asynchronous paths.

Lengths: a talker request's natural length is ``4 + 2 * len(prompt bytes)``
frames, ending with "stop"; its ``max_tokens`` (the pipeline's cap, from
max_tokens / max_audio_seconds) cuts it with "length". A thinker writes
``8 + len(prompt bytes) // 2`` tokens. The fake engine's context is
``FakeBackend.max_model_len`` (8192) tokens, its sampling defaults
``FakeBackend.sampling_defaults`` (its outputs do not depend on them).

Test only: a prompt containing ``FAKE_LOOP_MARKER`` makes the talker run
away like a model that never emits its end token: after 8 frames it repeats a
3-frame cycle of codes for ever (until its cap, or the pipeline's runaway
guard ends it). A prompt containing ``FAKE_SLOW_MARKER`` makes the talker a
slow model: every step that runs such a request takes at least
``FAKE_SLOW_STEP_S`` (the whole batch waits, as it would on a busy model), so
a test can hold a request in flight for seconds whether its client reads or
not. A thinker puts a request's instructions in its prompt
(``instructions + "\n" + prompt``, byte tokens), as a system turn would, and
takes audio parts (decoded at ``AUDIO_INPUT_RATE``): it hears one token per
80 ms of a clip, so a longer question gets a longer answer.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from decoder_svc.backend import RequestSpec, StepOutput
from decoder_svc.busy import BUSY
from decoder_svc.code2wav.chunking import SAMPLE_RATE_HZ, SAMPLES_PER_FRAME
from omni_common.conversation import turn_text
from omni_serving.v1 import snapshot_pb2

PER_REQUEST = snapshot_pb2.TENSOR_LAYOUT_PER_REQUEST
PER_TOKEN = snapshot_pb2.TENSOR_LAYOUT_PER_TOKEN
_M1 = 0x5851F42D4C957F2D  # odd multipliers that fit int64 (wrapping arithmetic)
_M2 = 0x14057B7EF767814F
_MASK62 = (1 << 62) - 1
FAKE_LOOP_MARKER = "<|fake-loop|>"
"""Test only: a prompt with this text makes the fake talker loop (see the module docstring)."""
FAKE_SLOW_MARKER = "<|fake-slow|>"
"""Test only: a prompt with this text makes the fake talker's steps slow (see the module docstring)."""
FAKE_SLOW_STEP_S = 0.005
"""Seconds a step that runs a slow request takes at least: 200 frames a second at most."""
AUDIO_INPUT_RATE = 16_000
"""The fake thinker takes audio parts, decoded at this rate (the first stage's audio input rate)."""
AUDIO_TOKEN_SAMPLES = 1280
"""Samples of audio per token the fake thinker hears (80 ms at `AUDIO_INPUT_RATE`)."""
_LOOP_HEAD, _LOOP_PERIOD = 8, 3
_ENDLESS = 1 << 40


def mix(x: torch.Tensor) -> torch.Tensor:
    """A cheap integer hash on int64 tensors (wrapping arithmetic, exact)."""
    x = x * _M1 + 0x2545F491
    x = x ^ (x >> 29)
    x = x * _M2
    x = x ^ (x >> 32)
    return x & _MASK62


@dataclass
class _Req:
    spec: RequestSpec
    prompt_ids: list[int]
    target_frames: int
    position: int = 0  # frames emitted so far
    prefilled: bool = False
    natural: int = 0  # where it would stop by itself ("stop"); beyond target_frames: "length"
    loops: bool = False
    slow: bool = False


def tokenize(text: str) -> list[int]:
    """Byte-level token ids (the reference tokenizer)."""
    return list(text.encode("utf-8"))


def frames_for(prompt_ids: list[int], max_tokens: int) -> int:
    n = 4 + 2 * len(prompt_ids)
    return min(n, max_tokens) if max_tokens > 0 else n


def audio_ids(clip: np.ndarray) -> list[int]:
    """What the fake thinker hears of a decoded clip (mono at `AUDIO_INPUT_RATE`):
    one token per `AUDIO_TOKEN_SAMPLES` (80 ms; a shorter clip is one token),
    its id the window's loudness (RMS x 1000, at most 255)."""
    clip = np.asarray(clip, dtype=np.float32).reshape(-1)
    n = max(1, len(clip) // AUDIO_TOKEN_SAMPLES)
    windows = np.resize(clip, n * AUDIO_TOKEN_SAMPLES).reshape(n, AUDIO_TOKEN_SAMPLES) if len(clip) else np.zeros((1, 1))
    rms = np.sqrt(np.mean(np.square(windows, dtype=np.float64), axis=1))
    return [int(min(255, round(v * 1000))) for v in rms]


def prompt_ids_for(spec: RequestSpec) -> list[int]:
    """The fake thinker's prompt: the instructions (a system turn's place), then the text;
    a conversation's turns joined by newlines (a system turn then a user turn: the same ids),
    then what it hears of the conversation's audio parts (`audio_ids`)."""
    if spec.messages:
        ids = tokenize("\n".join(turn_text(content) for _, content in spec.messages))
        return ids + [i for clip in spec.audio for i in audio_ids(clip)]
    if spec.instructions:
        return tokenize(spec.instructions + "\n" + spec.prompt)
    return tokenize(spec.prompt)


class FakeBackend:
    """Deterministic stand-in for the vLLM talker (and a benchmark engine)."""

    name = "fake"
    model_name = "fake"
    max_model_len = 8192
    """Nominal context, in tokens (the deployment's caps are computed from it)."""
    sampling_defaults = (0.9, 1.0, 50)
    """(temperature, top_p, top_k) reported as the model's defaults."""

    def __init__(
        self,
        *,
        role: str = "talker",
        hidden_size: int = 64,
        num_codebooks: int = 16,
        codec_vocab: int = 2048,
        max_num_seqs: int = 256,
        work_per_step: int = 0,
    ) -> None:
        if role not in ("talker", "thinker"):
            raise ValueError(f"role must be 'talker' or 'thinker', got {role!r}")
        self.role = role
        self.audio_input_rate = AUDIO_INPUT_RATE if role == "thinker" else 0
        """A thinker takes audio parts (``prompt_ids_for``); a talker reads text only."""
        self.hidden_size = hidden_size
        self.num_codebooks = num_codebooks
        self.codec_vocab = codec_vocab
        self.max_num_seqs = max_num_seqs
        # Optional synthetic model cost (a matmul of this size per step), so
        # benchmarks have a decode step to compare gaps against.
        self._work = torch.randn(work_per_step, work_per_step) if work_per_step else None
        self._lock = threading.Lock()
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._cols = torch.arange(max(hidden_size, num_codebooks), dtype=torch.int64)

    # -- request management (any thread) ---------------------------------------
    def add_request(self, spec: RequestSpec) -> None:
        cond = spec.conditioning.get("thinker_token_ids")
        loops = slow = False
        if cond is not None:
            ids = [int(x) for x in cond.reshape(-1).tolist()]
        elif self.role == "thinker":
            ids = prompt_ids_for(spec)
        else:
            ids = tokenize(spec.prompt)
        if self.role == "thinker":
            n = 8 + len(ids) // 2
        else:
            loops = FAKE_LOOP_MARKER in spec.prompt
            slow = FAKE_SLOW_MARKER in spec.prompt
            n = _ENDLESS if loops else frames_for(ids, 0)
        target = min(n, spec.max_tokens) if spec.max_tokens > 0 else n
        with self._lock:
            self._waiting.append(_Req(spec, ids, target, natural=n, loops=loops, slow=slow))

    def abort(self, request_id: str) -> bool:
        with self._lock:
            for queue in (self._waiting, self._running):
                for r in queue:
                    if r.spec.request_id == request_id:
                        queue.remove(r)
                        return True
        return False

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running)

    # -- the model ------------------------------------------------------------
    def _hash(self, seeds: torch.Tensor, positions: torch.Tensor, salt: int, width: int) -> torch.Tensor:
        base = mix(seeds * 1_000_003 + positions * 8191 + salt)
        return mix(base[:, None] + self._cols[None, :width])

    def _hidden(self, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self._hash(seeds, positions, 17, self.hidden_size)
        # 16-bit values scaled by a power of two: exact in float32.
        return ((h & 0xFFFF).to(torch.float32) - 32768.0) / 32768.0

    def step(self) -> StepOutput | None:
        """One decode step for the running batch (admitting waiting requests)."""
        with self._lock:
            room = self.max_num_seqs - len(self._running)
            if room > 0 and self._waiting:
                self._running.extend(self._waiting[:room])
                del self._waiting[:room]
            batch = list(self._running)
        if not batch:
            return None
        if self._work is not None:
            with BUSY.forward(self.role):
                torch.mm(self._work, self._work)
        if any(r.slow for r in batch):  # test only: a slow model
            time.sleep(FAKE_SLOW_STEP_S)
        # 1) schedule: prefill rows for new requests, one row for the others
        num_sched = [1 if r.prefilled else len(r.prompt_ids) or 1 for r in batch]
        qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(num_sched, dtype=torch.int32), 0)
        seeds = torch.tensor([r.spec.seed for r in batch], dtype=torch.int64)
        frame_pos = torch.tensor([r.position for r in batch], dtype=torch.int64)
        counts = torch.tensor(num_sched, dtype=torch.int64)
        # per-token positions: prompt positions for prefill rows, frame index for decode rows
        tok_seed = torch.repeat_interleave(seeds, counts)
        starts = torch.repeat_interleave(qsl[:-1].to(torch.int64), counts)
        tok_pos = torch.arange(int(qsl[-1]), dtype=torch.int64) - starts + torch.repeat_interleave(frame_pos, counts) * 100_000
        # 2) forward: hidden rows for every scheduled token
        hidden = self._hidden(tok_seed, tok_pos)
        # 3) sample (+ code predictor for the talker: one frame of codes per request)
        mm_outputs: dict[str, tuple[torch.Tensor, int]] = {}
        text_deltas: dict[str, str] = {}
        new_token_ids: dict[str, list[int]] = {}
        if self.role == "talker":
            code_pos = frame_pos
            if any(r.loops for r in batch):  # test only: a runaway request repeats a short cycle
                loops = torch.tensor([r.loops for r in batch], dtype=torch.bool)
                cycle = _LOOP_HEAD + (frame_pos - _LOOP_HEAD) % _LOOP_PERIOD
                code_pos = torch.where(loops & (frame_pos >= _LOOP_HEAD), cycle, frame_pos)
            codes = self._hash(seeds, code_pos, 99, self.num_codebooks) % self.codec_vocab
            sampled = codes[:, :1].clone()
            mm_outputs["codec_codes"] = (codes, PER_REQUEST)
        else:
            # printable text: lowercase letters and spaces
            sampled = (self._hash(seeds, frame_pos, 5, 1) % 27 + 97).clone()
            sampled[sampled == 123] = 32
            for r, tok in zip(batch, sampled[:, 0].tolist(), strict=True):
                text_deltas[r.spec.request_id] = chr(tok)
                new_token_ids[r.spec.request_id] = [tok]
            # what a Qwen3-Omni thinker hands its talker, per token
            mm_outputs["thinker_embed"] = (self._hidden(tok_seed + 7, tok_pos), PER_TOKEN)
            mm_outputs["thinker_hidden"] = (hidden, PER_TOKEN)
        # 4) update decode state (eager postprocess: the next step needs it)
        finished: dict[str, str] = {}
        with self._lock:
            for r in batch:
                r.prefilled = True
                r.position += 1
                if r.position >= r.target_frames:
                    finished[r.spec.request_id] = "stop" if r.position >= r.natural else "length"
                    if r in self._running:
                        self._running.remove(r)
        return StepOutput(
            request_ids=[r.spec.request_id for r in batch],
            batch_indices=list(range(len(batch))),
            num_scheduled_tokens=num_sched,
            query_start_loc=qsl,
            sampled_token_ids=sampled,
            hidden_states=hidden,
            mm_outputs=mm_outputs,
            finished=finished,
            text_deltas=text_deltas,
            new_token_ids=new_token_ids,
        )

    def embed(self, spec: RequestSpec) -> torch.Tensor:
        """Pooling: mean of the prompt's hidden rows (deterministic)."""
        ids = tokenize(spec.prompt) or [0]
        n = len(ids)
        hidden = self._hidden(torch.full((n,), spec.seed, dtype=torch.int64), torch.arange(n, dtype=torch.int64))
        return hidden.mean(dim=0)

    def close(self) -> None:
        with self._lock:
            self._waiting.clear()
            self._running.clear()


# -- the fake vocoder (sine table) -------------------------------------------------

_TABLE_BITS = 12
_TABLE = np.round(np.sin(2 * np.pi * np.arange(1 << _TABLE_BITS) / (1 << _TABLE_BITS)) * 32767).astype(np.int64)
VOICES: tuple[str, ...] = ("default", "alloy", "echo", "fable", "onyx", "nova", "shimmer")


class FakeVocoder:
    """Deterministic integer vocoder: codes [T, Q] -> int16-valued samples."""

    def __init__(self, num_codebooks: int = 16, codec_vocab: int = 2048, overlap: int = 240) -> None:
        self.num_codebooks = num_codebooks
        self.codec_vocab = codec_vocab
        self.overlap = overlap
        c = np.arange(codec_vocab, dtype=np.int64)
        q = np.arange(num_codebooks, dtype=np.int64)[:, None]
        # phase increment per sample (table units << 8) and amplitude per (codebook, code)
        self._step = ((c[None, :] * 7 + q * 131) % 997 + 20 + q * 40) << 8  # [Q, V]
        self._amp = ((c[None, :] * 13 + q * 17) % 64 + 16) // (q + 1)  # [Q, V]

    def _voice_offset(self, voice: str) -> int:
        return (VOICES.index(voice) if voice in VOICES else 0) * 37

    def _synth(self, codes: np.ndarray, first_frame: int, voice_offset: int, length: int) -> np.ndarray:
        """Raw sum of sinusoids for each frame over `length` samples: [T, length]."""
        t = (np.arange(codes.shape[0], dtype=np.int64)[:, None] + first_frame) * SAMPLES_PER_FRAME
        t = t + np.arange(length, dtype=np.int64)[None, :]  # global sample index
        acc = np.zeros((codes.shape[0], length), dtype=np.int64)
        for q in range(self.num_codebooks):
            step = self._step[q, codes[:, q]][:, None] + (voice_offset << 8)
            amp = self._amp[q, codes[:, q]][:, None]
            acc += amp * _TABLE[((step * t) >> 8) & ((1 << _TABLE_BITS) - 1)]
        return acc >> 10

    def decode(self, codes: np.ndarray, first_frame: int, voice: str = "default") -> np.ndarray:
        """Decode frames [first_frame, first_frame + T) -> float32 [T * 1920].

        Frame k's first `overlap` samples crossfade from frame k-1's sound,
        so frame k depends on frames k-1 and k: the caller passes at least one
        frame of left context (or starts at frame 0).
        """
        codes = np.asarray(codes, dtype=np.int64).reshape(-1, self.num_codebooks) % self.codec_vocab
        voice_offset = self._voice_offset(voice)
        cur = self._synth(codes, first_frame, voice_offset, SAMPLES_PER_FRAME)
        ov = self.overlap
        if codes.shape[0] > 1:
            # previous frame's sinusoids continued into this frame's first samples
            prev = self._synth(codes[:-1], first_frame + 1, voice_offset, ov)
            # synthesize with the previous frame's codes at this frame's times
            fade = np.arange(ov, dtype=np.int64)[None, :]
            cur[1:, :ov] = (cur[1:, :ov] * fade + prev * (ov - fade)) // ov
        out = np.clip(cur, -32768, 32767).reshape(-1)
        return (out.astype(np.float32) / np.float32(32768.0)).astype(np.float32)


class FakeVocoderStream:
    """One request's audio from the fake vocoder: frames in, samples out.

    Each push re-decodes up to ``left_context`` earlier frames (inside the
    vocoder's receptive field, so chunked audio equals whole-sequence audio).
    """

    def __init__(self, vocoder: FakeVocoder, voice: str, left_context: int) -> None:
        self.vocoder = vocoder
        self.voice = voice
        self.left_context = left_context
        self.frames = np.zeros((0, vocoder.num_codebooks), dtype=np.int64)

    def push(self, codes: np.ndarray) -> np.ndarray:
        start = self.frames.shape[0]
        self.frames = np.concatenate([self.frames, np.asarray(codes, dtype=np.int64).reshape(-1, self.frames.shape[1])])
        ctx_start = max(0, start - self.left_context)
        audio = self.vocoder.decode(self.frames[ctx_start:], ctx_start, self.voice)
        return audio[(start - ctx_start) * SAMPLES_PER_FRAME :]


class FakeVocoderFactory:
    """The fake vocoder behind the streaming-vocoder interface the
    generation stage uses: ``new_stream(voice)``, ``voices``, ``sample_rate``,
    ``num_codebooks``, ``codebook_size``."""

    sample_rate = SAMPLE_RATE_HZ
    frames_per_second = SAMPLE_RATE_HZ / SAMPLES_PER_FRAME
    voices = VOICES

    def __init__(self, num_codebooks: int = 16, codec_vocab: int = 2048, left_context: int = 25) -> None:
        self.vocoder = FakeVocoder(num_codebooks=num_codebooks, codec_vocab=codec_vocab)
        self.num_codebooks = num_codebooks
        self.codebook_size = codec_vocab
        self.left_context = left_context

    def new_stream(self, voice: str) -> FakeVocoderStream:
        return FakeVocoderStream(self.vocoder, voice, self.left_context)

    def worker_spec(self) -> tuple[str, dict]:
        """How a code2wav worker process rebuilds this vocoder (factory path, kwargs)."""
        return (
            "decoder_svc.testing.fake_engine:FakeVocoderFactory",
            {"num_codebooks": self.num_codebooks, "codec_vocab": self.codebook_size, "left_context": self.left_context},
        )


def fake_vocoder(profile, talker=None) -> FakeVocoderFactory:
    """The fake vocoder for a pipeline of `profile`: the codec of its audio
    stage's engine (`talker`: its ``num_codebooks`` and ``codec_vocab``;
    the fake talker's when it does not say) and the generation stage's left
    context. What ``--engine fake`` and a pipeline built by hand (tests,
    benchmarks) speak with."""
    return FakeVocoderFactory(
        num_codebooks=getattr(talker, "num_codebooks", 16),
        codec_vocab=getattr(talker, "codec_vocab", 2048),
        left_context=profile.stages[-1].codec_left_context_frames,
    )
