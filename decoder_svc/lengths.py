"""What a deployment produces and how long: caps, defaults, the runaway guard.

`DeploymentSettings` is built once at startup from the engine's facts (codec
frame rate, the stages' contexts, the model's sampling defaults, what the
loaded stages produce) and the decoder's options (``--default-audio-seconds``,
``--max-audio-seconds``, ``--default-text-tokens``, ``--repetition-window-s``,
``--repetition-max-period``). It answers ``GetDecoderInfo`` (output
modalities, ``DeploymentLimits``, instructions support, model name) and turns
a request's ``max_tokens`` / ``max_audio_seconds`` into each AR stage's token
cap (docs/decoder.md, "Lengths and endings").

`RepetitionGuard` watches one request's codec stream (codebook 0 of each
frame): when the last ``window`` frames are one short cycle (period at most
``max_period`` frames) repeated, the request is ended with finish reason
"repetition".
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from dataclasses import dataclass

from omni_common.errors import InvalidArgumentError
from omni_common.modality import OutputModality
from omni_serving.v1 import common_pb2

DEFAULT_AUDIO_SECONDS = 60.0
"""Audio cap of a request that sets no max_audio_seconds (``--default-audio-seconds``)."""
MAX_AUDIO_SECONDS_CEILING = 300.0
"""``--max-audio-seconds`` when not given: the talker's context, at most this."""
DEFAULT_TEXT_TOKENS = 512
"""Text tokens of a request that sets no max_tokens (``--default-text-tokens``)."""
DEFAULT_INPUT_AUDIO_PARTS = 4
"""Audio parts a request may carry (``--max-input-audio-parts``), where the first stage reads audio."""
DEFAULT_INPUT_AUDIO_SECONDS = 60.0
"""Longest audio part, in seconds (``--max-input-audio-seconds``)."""
DEFAULT_INPUT_IMAGE_PARTS = 4
"""Image parts a request may carry (``--max-input-image-parts``), where the first stage reads images."""
DEFAULT_INPUT_IMAGE_PIXELS = 36_000_000
"""Most pixels of an image part as sent (``--max-input-image-pixels``; the model's processor resizes it)."""
DEFAULT_REPETITION_WINDOW_S = 4.0
"""Seconds of codec frames the runaway guard looks at (``--repetition-window-s``)."""
DEFAULT_REPETITION_MAX_PERIOD = 8
"""Longest cycle, in frames, the runaway guard counts as a loop (``--repetition-max-period``)."""

STOP, LENGTH, REPETITION, ABORT = "stop", "length", "repetition", "abort"

FRAME_TOLERANCE = 1e-3
"""Frames forgiven when a cap in seconds is turned into frames: requests carry
max_audio_seconds as a float32, whose rounding (at most ~2e-4 frames at
300 s) must not cost a frame."""
FLOAT32_EPS = 2.0**-23
"""Relative rounding of a float32: a cap sent as the maximum itself is accepted."""


@dataclass(frozen=True)
class EngineFacts:
    """What the loaded engine says about itself."""

    frames_per_second: float
    """Codec frames per second of audio (12.5 for Qwen3-Omni: 24 kHz, 1920 samples a frame)."""
    audio_context_tokens: int
    """Context of the stage that emits codec frames (the talker): prompt + frames."""
    text_context_tokens: int
    """Context of the text stage (the thinker); 0 without one."""
    default_temperature: float
    default_top_p: float
    default_top_k: int
    model: str
    audio_input_rate: int = 0
    """Samples per second the first stage's audio tower reads (0: it reads no audio)."""
    image_input: bool = False
    """The first stage reads images (a vision tower and an image processor)."""
    speech_instructions: bool = False
    """The speaking stage takes style instructions (a text-to-speech model's voices)."""
    languages: tuple[str, ...] = ()
    """Languages a request may name (a text-to-speech model's), besides "auto"."""


@dataclass(frozen=True)
class Options:
    """The decoder's length and guard options; None = computed from the engine."""

    default_audio_seconds: float | None = None
    max_audio_seconds: float | None = None
    default_text_tokens: int | None = None
    repetition_window_s: float = DEFAULT_REPETITION_WINDOW_S
    repetition_max_period: int = DEFAULT_REPETITION_MAX_PERIOD
    max_input_audio_parts: int = DEFAULT_INPUT_AUDIO_PARTS
    max_input_audio_seconds: float = DEFAULT_INPUT_AUDIO_SECONDS
    max_input_image_parts: int = DEFAULT_INPUT_IMAGE_PARTS
    max_input_image_pixels: int = DEFAULT_INPUT_IMAGE_PIXELS


@dataclass(frozen=True)
class DeploymentSettings:
    """Caps, defaults and capabilities of one deployment (see the module docstring)."""

    profile: str
    output_modalities: OutputModality
    supports_instructions: bool
    model: str
    frames_per_second: float
    default_audio_seconds: float
    max_audio_seconds: float
    default_text_tokens: int
    max_text_tokens: int
    context_tokens: int
    audio_context_tokens: int
    default_temperature: float
    default_top_p: float
    default_top_k: int
    repetition_window: int
    """Frames; 0 = the guard is off."""
    repetition_max_period: int
    max_first_chunk_frames: int = 0
    """Largest first audio chunk a request may ask for (the generation
    stage's codec_chunk_frames; 0: no audio)."""
    audio_input_rate: int = 0
    """The first stage's audio input rate (EngineFacts.audio_input_rate; 0: no audio input)."""
    max_input_audio_parts: int = 0
    """Audio parts a request may carry (0: the deployment takes no audio input)."""
    max_input_audio_seconds: float = 0.0
    """Longest audio part accepted, in seconds."""
    max_input_image_parts: int = 0
    """Image parts a request may carry (0: the deployment takes no image input)."""
    max_input_image_pixels: int = 0
    """Most pixels of an image part as sent."""
    speech_instructions: bool = False
    """A text spoken as written takes style instructions (EngineFacts.speech_instructions)."""
    languages: tuple[str, ...] = ()
    """EngineFacts.languages."""

    @property
    def has_text_stage(self) -> bool:
        return self.max_text_tokens > 0

    @classmethod
    def build(
        cls,
        *,
        profile: str,
        output_modalities: OutputModality,
        supports_instructions: bool,
        facts: EngineFacts,
        options: Options | None = None,
    ) -> DeploymentSettings:
        """Settings from the engine's facts and the options; a bad option is an
        InvalidArgumentError naming it (the decoder stops before serving)."""
        o = options or Options()
        fps = float(facts.frames_per_second)
        if not (math.isfinite(fps) and fps > 0):
            raise InvalidArgumentError("frames_per_second", f"must be > 0, got {fps}")
        # the talker's prompt takes at least one position of its context
        context_s = math.floor(max(0, facts.audio_context_tokens - 1) / fps * 100) / 100
        max_s = o.max_audio_seconds
        if max_s is None:
            max_s = min(MAX_AUDIO_SECONDS_CEILING, context_s)
        elif not (math.isfinite(max_s) and max_s > 0):
            raise InvalidArgumentError("--max-audio-seconds", f"must be > 0, got {max_s}")
        elif max_s > context_s:
            raise InvalidArgumentError(
                "--max-audio-seconds",
                f"{max_s:g} s is {math.ceil(max_s * fps)} codec frames, beyond the talker's context of "
                f"{facts.audio_context_tokens} tokens ({context_s:g} s at {fps:g} frames per second)",
            )
        default_s = o.default_audio_seconds
        if default_s is None:
            default_s = min(DEFAULT_AUDIO_SECONDS, max_s)
        elif not (math.isfinite(default_s) and 0 < default_s <= max_s):
            raise InvalidArgumentError(
                "--default-audio-seconds",
                f"must be in (0, {max_s:g}] (--max-audio-seconds), got {default_s}",
            )
        text_ctx = int(facts.text_context_tokens)
        max_text = max(0, text_ctx - 1)
        default_text = o.default_text_tokens
        if max_text == 0:
            default_text = 0
        elif default_text is None:
            default_text = min(DEFAULT_TEXT_TOKENS, max_text)
        elif not 0 < default_text <= max_text:
            raise InvalidArgumentError(
                "--default-text-tokens",
                f"must be in [1, {max_text}] (the thinker's context of {text_ctx} tokens), got {default_text}",
            )
        if not (math.isfinite(o.repetition_window_s) and o.repetition_window_s >= 0):
            raise InvalidArgumentError(
                "--repetition-window-s", f"must be >= 0 (0 = off), got {o.repetition_window_s}"
            )
        window = round(o.repetition_window_s * fps)
        period = int(o.repetition_max_period)
        if window and period < 1:
            raise InvalidArgumentError("--repetition-max-period", f"must be >= 1, got {period}")
        if window and window < 2 * period:
            raise InvalidArgumentError(
                "--repetition-window-s",
                f"{o.repetition_window_s:g} s is {window} frames; it must hold at least two cycles of "
                f"--repetition-max-period ({period} frames), i.e. {2 * period} frames",
            )
        audio_parts, audio_s = _input_audio_limits(o, int(facts.audio_input_rate))
        image_parts, image_pixels = _input_image_limits(o, bool(facts.image_input))
        return cls(
            max_input_image_parts=image_parts,
            max_input_image_pixels=image_pixels,
            audio_input_rate=int(facts.audio_input_rate) if audio_parts else 0,
            max_input_audio_parts=audio_parts,
            max_input_audio_seconds=audio_s,
            profile=profile,
            output_modalities=output_modalities,
            supports_instructions=supports_instructions or facts.speech_instructions,
            speech_instructions=facts.speech_instructions,
            languages=tuple(facts.languages),
            model=facts.model,
            frames_per_second=fps,
            default_audio_seconds=float(default_s),
            max_audio_seconds=float(max_s),
            default_text_tokens=int(default_text),
            max_text_tokens=max_text,
            context_tokens=text_ctx if text_ctx else int(facts.audio_context_tokens),
            audio_context_tokens=int(facts.audio_context_tokens),
            default_temperature=float(facts.default_temperature),
            default_top_p=float(facts.default_top_p),
            default_top_k=int(facts.default_top_k),
            repetition_window=int(window),
            repetition_max_period=period if window else 0,
        )

    def audio_frames(self, max_audio_seconds: float) -> int:
        """The codec frames a request may produce: its cap (0 = the default)
        in frames, rounded down (the audio never exceeds the cap), at least 1."""
        seconds = max_audio_seconds or self.default_audio_seconds
        # requests carry a float32: 5.12 arrives as 5.1199999 (63.99999 frames)
        return max(1, math.floor(seconds * self.frames_per_second + FRAME_TOLERANCE))

    def limits_pb(self) -> common_pb2.DeploymentLimits:
        return common_pb2.DeploymentLimits(
            default_audio_seconds=self.default_audio_seconds,
            max_audio_seconds=self.max_audio_seconds,
            default_text_tokens=self.default_text_tokens,
            max_text_tokens=self.max_text_tokens,
            context_tokens=self.context_tokens,
            audio_frames_per_second=self.frames_per_second,
            default_temperature=self.default_temperature,
            default_top_p=self.default_top_p,
            default_top_k=self.default_top_k,
            max_first_chunk_frames=self.max_first_chunk_frames,
            max_input_audio_parts=self.max_input_audio_parts,
            max_input_audio_seconds=self.max_input_audio_seconds,
            max_input_image_parts=self.max_input_image_parts,
            max_input_image_pixels=self.max_input_image_pixels,
        )

    def new_guard(self) -> RepetitionGuard | None:
        if not self.repetition_window:
            return None
        return RepetitionGuard(self.repetition_window, self.repetition_max_period)


def _input_audio_limits(o: Options, rate: int) -> tuple[int, float]:
    """(audio parts, seconds per part) a request may send: the options where
    the first stage reads audio (``rate`` > 0), else none."""
    parts, seconds = int(o.max_input_audio_parts), float(o.max_input_audio_seconds)
    if parts < 0:
        raise InvalidArgumentError("--max-input-audio-parts", f"must be >= 0 (0 = no audio input), got {parts}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidArgumentError("--max-input-audio-seconds", f"must be > 0, got {seconds}")
    if rate <= 0 or parts == 0:
        return 0, 0.0
    return parts, seconds


def _input_image_limits(o: Options, takes_images: bool) -> tuple[int, int]:
    """(image parts, pixels per part) a request may send: the options where
    the first stage reads images, else none."""
    parts, pixels = int(o.max_input_image_parts), int(o.max_input_image_pixels)
    if parts < 0:
        raise InvalidArgumentError("--max-input-image-parts", f"must be >= 0 (0 = no image input), got {parts}")
    if pixels <= 0:
        raise InvalidArgumentError("--max-input-image-pixels", f"must be > 0, got {pixels}")
    if not takes_images or parts == 0:
        return 0, 0
    return parts, pixels


def deployment_modalities(roles: Iterable[str]) -> tuple[OutputModality, bool]:
    """(what a pipeline of AR stages with these engine roles produces, whether
    it takes instructions): a thinker writes text and reads a chat prompt
    (instructions go in its system turn); a talker's frames become audio."""
    roles = list(roles)
    produced = OutputModality(0)
    if "thinker" in roles:
        produced |= OutputModality.TEXT
    if "talker" in roles:
        produced |= OutputModality.AUDIO
    return produced, bool(roles) and roles[0] == "thinker"


def facts_of(backends: list, vocoder, *, model: str = "") -> EngineFacts:
    """Facts from the AR stages' backends (in pipeline order) and the vocoder.

    Backends may say ``role``, ``max_model_len`` (their context) and, for the
    stage that samples the audio, ``sampling_defaults`` (temperature, top_p,
    top_k) and ``model_name``; missing ones take the fake engine's values.
    """
    audio = backends[-1]
    first = backends[0]
    text_ctx = (
        int(getattr(first, "max_model_len", 0)) if getattr(first, "role", "") == "thinker" else 0
    )
    temperature, top_p, top_k = getattr(audio, "sampling_defaults", (0.9, 1.0, 50))
    return EngineFacts(
        frames_per_second=float(getattr(vocoder, "frames_per_second", 12.5)),
        audio_context_tokens=int(getattr(audio, "max_model_len", 8192)),
        text_context_tokens=text_ctx,
        default_temperature=float(temperature),
        default_top_p=float(top_p),
        default_top_k=int(top_k),
        model=model or str(getattr(audio, "model_name", "") or "fake"),
        audio_input_rate=int(getattr(first, "audio_input_rate", 0) or 0),
        image_input=bool(getattr(first, "image_input", False)),
        speech_instructions=bool(getattr(audio, "speech_instructions", False)),
        languages=tuple(sorted(getattr(audio, "languages", ()) or ())),
    )


def _check_finite(value: float, field: str) -> None:
    if not math.isfinite(value):
        raise InvalidArgumentError(field, f"must be a finite number, got {value}")


def check_request(spec, settings: DeploymentSettings) -> None:
    """A request (a ``RequestSpec``) against what the deployment produces and
    allows; every refusal names the field (``sampling_params.*`` for the
    sampling controls, as in GenerateRequest)."""
    sp = "sampling_params"
    if spec.task == "generate":
        asked = spec.modality
        missing = asked & ~settings.output_modalities
        if missing:
            raise InvalidArgumentError(
                "output_modalities",
                f"this deployment (profile {settings.profile}) produces "
                f"{settings.output_modalities.to_string()}; {missing.to_string()} cannot be produced",
            )
    if spec.instructions and not settings.supports_instructions:
        raise InvalidArgumentError(
            "instructions",
            f"this deployment (profile {settings.profile}) does not take instructions: it has no "
            "text stage whose prompt could carry them",
        )
    if spec.messages and not settings.has_text_stage:
        raise InvalidArgumentError(
            "messages",
            f"this deployment (profile {settings.profile}) speaks its input as is: a conversation needs "
            "a text stage (a profile with a thinker, such as omni); send prompt",
        )
    if getattr(spec, "stop", ()) and (spec.verbatim or not settings.has_text_stage):
        raise InvalidArgumentError(
            f"{sp}.stop",
            "a text spoken as written has no text stage whose text a stop sequence could end"
            if spec.verbatim else
            f"this deployment (profile {settings.profile}) has no text stage whose text a stop sequence could end",
        )
    seconds = float(spec.max_audio_seconds)
    _check_finite(seconds, f"{sp}.max_audio_seconds")
    if seconds < 0:
        raise InvalidArgumentError(
            f"{sp}.max_audio_seconds", f"must be >= 0 (0 = the default), got {seconds:g}"
        )
    if seconds > settings.max_audio_seconds * (1 + FLOAT32_EPS):  # float32 on the wire
        raise InvalidArgumentError(
            f"{sp}.max_audio_seconds",
            f"{seconds:g} s is above this deployment's maximum of {settings.max_audio_seconds:g} s",
        )
    if spec.max_tokens < 0:
        raise InvalidArgumentError(f"{sp}.max_tokens", f"must be >= 0, got {spec.max_tokens}")
    first = int(spec.first_chunk_frames)
    if spec.task == "generate" and spec.modality & OutputModality.AUDIO and not 0 <= first <= settings.max_first_chunk_frames:
        raise InvalidArgumentError(
            f"{sp}.first_chunk_frames",
            f"must be in [0, {settings.max_first_chunk_frames}] (0 = the deployment's choice; at most its "
            f"steady chunk of {settings.max_first_chunk_frames} codec frames), got {first}",
        )
    # (a text spoken as written: max_tokens caps its codec frames, as on a deployment without a text stage)
    if settings.has_text_stage and not spec.verbatim and spec.max_tokens > settings.max_text_tokens:
        raise InvalidArgumentError(
            f"{sp}.max_tokens",
            f"{spec.max_tokens} is above this deployment's maximum of {settings.max_text_tokens} text tokens "
            f"(the thinker's context is {settings.context_tokens})",
        )
    for name in ("temperature", "top_p"):
        _check_finite(float(getattr(spec, name)), f"{sp}.{name}")


class RepetitionGuard:
    """Detects a codec stream stuck in a loop (one request's codebook-0 ids).

    Trips when the last ``window`` frames are periodic with a period ``p <=
    max_period``: every one of the last ``window - p`` frames equals the frame
    ``p`` before it. Kept incrementally: per period, the run of frames that
    matched the frame ``p`` back. Real speech does not repeat one short cycle
    of codes for seconds on end; a pause is one or a few codes repeated, so
    the window (4 s by default) must be longer than the longest pause that
    should pass.
    """

    def __init__(self, window: int, max_period: int) -> None:
        if window < 2 * max_period or max_period < 1:
            raise ValueError(f"window {window} must hold two cycles of max_period {max_period}")
        self.window = window
        self.max_period = max_period
        self._history: collections.deque[int] = collections.deque(maxlen=max_period)
        self._runs = [0] * (max_period + 1)
        self.frames = 0
        self.period = 0  # the cycle found, once tripped

    def push(self, codes: Iterable[int]) -> bool:
        """Add frames (codebook-0 ids, in order); True once the stream loops."""
        hist, runs, window = self._history, self._runs, self.window
        for code in codes:
            c = int(code)
            n = len(hist)
            for p in range(1, self.max_period + 1):
                if p <= n and hist[n - p] == c:
                    runs[p] += 1
                    if runs[p] >= window - p and not self.period:
                        self.period = p  # the shortest cycle found
                else:
                    runs[p] = 0
            hist.append(c)
            self.frames += 1
            if self.period:
                return True
        return False


__all__ = [
    "ABORT",
    "DEFAULT_AUDIO_SECONDS",
    "DEFAULT_REPETITION_MAX_PERIOD",
    "DEFAULT_REPETITION_WINDOW_S",
    "DEFAULT_TEXT_TOKENS",
    "LENGTH",
    "MAX_AUDIO_SECONDS_CEILING",
    "REPETITION",
    "STOP",
    "DeploymentSettings",
    "EngineFacts",
    "Options",
    "RepetitionGuard",
    "check_request",
    "deployment_modalities",
    "facts_of",
]
