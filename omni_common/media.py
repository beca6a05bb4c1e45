"""Audio and images a client sends (a conversation's media parts), decoded for a model.

Images (:func:`decode_image`): PNG or JPEG, recognised from their headers,
at most ``max_pixels`` pixels as sent (checked from the header, before the
pixels are decoded), converted to RGB; a file that does not decode whole is
refused.

``decode_audio`` turns the bytes of one audio part into float32 mono
samples at the rate a model's audio tower reads (16 kHz for Qwen3-Omni):

- files: WAV (PCM 8/16/24/32-bit or float), FLAC, MP3 and Ogg Vorbis,
  recognised from their own headers (``format`` names what the client says
  it sent; a file that is something else is refused, not guessed at);
- ``pcm16``: raw little-endian 16-bit mono samples at ``sample_rate``.

Several channels are averaged; another sample rate is resampled with a
windowed-sinc filter (:func:`resample`). Whatever is wrong with the input
(no bytes, a format we do not read, a corrupt or truncated file, silence of
zero length, too long) is an ``InvalidArgumentError`` naming the part's
field, with what is wrong; nothing of the input is kept.
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from omni_common.errors import InvalidArgumentError

__all__ = ["AUDIO_FORMATS", "IMAGE_FORMATS", "AudioInput", "ImageInput", "decode_audio", "decode_image", "resample"]

IMAGE_FORMATS = ("PNG", "JPEG")
"""Image files a part may hold."""

AUDIO_FORMATS = ("wav", "flac", "mp3", "ogg", "pcm16")
"""Values of ``AudioContent.format`` (empty: a file, recognised from its header)."""

# libsndfile's names for the containers it recognised
_CONTAINER = {"WAV": "wav", "WAVEX": "wav", "RF64": "wav", "FLAC": "flac", "MP3": "mp3", "OGG": "ogg"}
# MP3 decoders may give a few frames fewer than the header's count (encoder delay)
_MP3_SLACK_FRAMES = 2304


@dataclass(frozen=True)
class AudioInput:
    """One audio part of a request, as sent (decoded by :func:`decode_audio`)."""

    data: bytes
    format: str = ""
    sample_rate: int = 0
    field: str = "audio"  # the part's field, for error messages


@dataclass(frozen=True)
class ImageInput:
    """One image part of a request, as sent (decoded by :func:`decode_image`)."""

    data: bytes
    field: str = "image"  # the part's field, for error messages


def decode_image(part: ImageInput, *, max_pixels: int) -> np.ndarray:
    """``part`` as an RGB image, uint8 [height, width, 3]."""
    from PIL import Image, UnidentifiedImageError

    field = f"{part.field}.data"
    if not part.data:
        raise InvalidArgumentError(field, "is empty")
    try:
        img = Image.open(io.BytesIO(part.data))
    except Image.DecompressionBombError:
        raise InvalidArgumentError(field, f"has too many pixels; the deployment takes at most {max_pixels}") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise InvalidArgumentError(field, "is not an image file we read (PNG, JPEG)") from None
    with img:
        if img.format not in IMAGE_FORMATS:
            raise InvalidArgumentError(field, f"is a {img.format} image; formats: PNG, JPEG")
        width, height = img.size
        if width <= 0 or height <= 0:
            raise InvalidArgumentError(field, f"has no pixels ({width}x{height})")
        if width * height > max_pixels:
            raise InvalidArgumentError(
                field, f"is {width}x{height} = {width * height} pixels; the deployment takes at most {max_pixels}"
            )
        try:
            img.load()  # a cut-short file fails here
            rgb = img.convert("RGB")
        except (OSError, ValueError, SyntaxError) as exc:
            raise InvalidArgumentError(field, f"is corrupt or cut short: {_short(exc)}") from None
    return np.asarray(rgb, dtype=np.uint8).copy()


def decode_audio(part: AudioInput, *, rate: int, max_seconds: float) -> np.ndarray:
    """``part`` as float32 mono samples at ``rate`` Hz (at most ``max_seconds`` long)."""
    field = part.field
    fmt = part.format.lower()
    if fmt and fmt not in AUDIO_FORMATS:
        raise InvalidArgumentError(f"{field}.format", f"unknown format {fmt!r}; formats: {', '.join(AUDIO_FORMATS)}")
    if not part.data:
        raise InvalidArgumentError(f"{field}.data", "is empty")
    if fmt == "pcm16":
        if part.sample_rate <= 0:
            raise InvalidArgumentError(f"{field}.sample_rate", "raw pcm16 needs its sample rate (> 0)")
        if len(part.data) % 2:
            raise InvalidArgumentError(f"{field}.data", f"{len(part.data)} bytes is not whole 16-bit samples")
        _check_length(len(part.data) // 2, part.sample_rate, max_seconds, field)
        samples = np.frombuffer(part.data, dtype="<i2").astype(np.float32) / 32768.0
        source_rate = part.sample_rate
    else:
        samples, source_rate = _read_file(part, fmt, max_seconds)
    if samples.size == 0:
        raise InvalidArgumentError(f"{field}.data", "holds no audio samples")
    if not np.isfinite(samples).all():
        raise InvalidArgumentError(f"{field}.data", "holds samples that are not finite numbers")
    if source_rate != rate:
        samples = resample(samples, source_rate, rate)
    return np.ascontiguousarray(samples, dtype=np.float32)


def _check_length(frames: int, rate: int, max_seconds: float, field: str) -> None:
    seconds = frames / rate
    if seconds > max_seconds:
        raise InvalidArgumentError(
            f"{field}.data", f"is {seconds:.2f} s of audio; the deployment takes at most {max_seconds:g} s per part"
        )


def _read_file(part: AudioInput, fmt: str, max_seconds: float) -> tuple[np.ndarray, int]:
    import soundfile as sf

    field = part.field
    try:
        f = sf.SoundFile(io.BytesIO(part.data))
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(
            f"{field}.data", f"is not an audio file we read (WAV, FLAC, MP3, Ogg Vorbis): {_short(exc)}"
        ) from None
    with f:
        found = _CONTAINER.get(f.format)
        if found is None:
            raise InvalidArgumentError(f"{field}.data", f"is a {f.format} file; formats: WAV, FLAC, MP3, Ogg Vorbis")
        if fmt and fmt != found:
            raise InvalidArgumentError(f"{field}.format", f"says {fmt!r} but the data is a {found.upper()} file")
        if f.samplerate <= 0 or f.channels <= 0:
            raise InvalidArgumentError(f"{field}.data", "has no sample rate or no channels in its header")
        if f.frames <= 0:
            raise InvalidArgumentError(f"{field}.data", "holds no audio samples (empty or cut short)")
        _check_length(f.frames, f.samplerate, max_seconds, field)
        if found == "wav":
            _check_wav_complete(part.data, field)
        try:
            samples = f.read(dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError) as exc:
            raise InvalidArgumentError(f"{field}.data", f"is corrupt or cut short: {_short(exc)}") from None
        slack = _MP3_SLACK_FRAMES if found == "mp3" else 0
        if samples.shape[0] + slack < f.frames:
            raise InvalidArgumentError(
                f"{field}.data",
                f"is cut short: its header says {f.frames} samples, it holds {samples.shape[0]}",
            )
        rate = int(f.samplerate)
    return samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0], rate


def _check_wav_complete(data: bytes, field: str) -> None:
    """A RIFF/WAVE file whose data chunk says more bytes than the file holds is cut short
    (libsndfile reads what is there without a word)."""
    if len(data) < 12 or data[:4] not in (b"RIFF", b"RF64") or data[8:12] != b"WAVE":
        return  # WAVEX / RF64 variants: trust libsndfile's count
    pos = 12
    while pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], struct.unpack("<I", data[pos + 4:pos + 8])[0]
        if cid == b"data":
            held = len(data) - pos - 8
            if size != 0xFFFFFFFF and size > held:
                raise InvalidArgumentError(
                    f"{field}.data", f"is cut short: its data chunk says {size} bytes, the file holds {held}"
                )
            return
        pos += 8 + size + (size & 1)


def _short(exc: BaseException) -> str:
    text = str(exc).replace("<_io.BytesIO object", "<bytes").split(":")[-1].strip()
    return text[:120] or type(exc).__name__


def resample(samples: np.ndarray, source_rate: int, rate: int) -> np.ndarray:
    """``samples`` (1-D) from ``source_rate`` to ``rate`` Hz: a Hann-windowed
    sinc low-pass (zero crossings at the lower rate's Nyquist, 99%) applied as
    one polyphase convolution; ``ceil(n * rate / source_rate)`` samples out."""
    import torch

    g = math.gcd(int(source_rate), int(rate))
    up, down = int(rate) // g, int(source_rate) // g
    kernels, width = _sinc_kernels(down, up)
    x = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
    n = x.shape[0]
    padded = torch.nn.functional.pad(x[None, None], (width, width + down))
    with torch.inference_mode():
        out = torch.nn.functional.conv1d(padded, kernels, stride=down)  # [1, up, frames]
    out = out[0].t().reshape(-1)
    return out[: math.ceil(n * up / down)].numpy().copy()


@lru_cache(maxsize=8)
def _sinc_kernels(down: int, up: int, zeros: int = 6, rolloff: float = 0.99):  # noqa: ANN202
    """One filter per output phase: [up, 1, taps] float32, and the left padding."""
    import torch

    cutoff = min(down, up) * rolloff
    width = math.ceil(zeros * down / cutoff)
    idx = torch.arange(-width, width + down, dtype=torch.float64)[None, None] / down
    t = (torch.arange(0, -up, -1, dtype=torch.float64)[:, None, None] / up + idx) * cutoff
    t = t.clamp(-zeros, zeros)
    window = torch.cos(t * math.pi / zeros / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / torch.where(t == 0, torch.ones_like(t), t))
    return (sinc * window * (cutoff / down)).to(torch.float32), width
