"""Which kinds of output a request or a model produces.

`OutputModality` is a bit-flag set: any combination is written with `|`
(``TEXT | AUDIO``) and no composite members exist. It belongs to the edges of
the system: parsing configuration and request fields, choosing an
accumulation strategy once per request, and labelling results. Hot loops do
not branch on it.

The flag values are the proto `OutputModality` values in
``omni_serving/v1/payload.proto``, so a set crosses the wire as the list of
its members' values (`to_proto` / `from_proto`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable

from omni_common.errors import InvalidArgumentError

# Accepted spellings that are not member names, mapped to the member name.
_ALIASES: dict[str, str] = {
    "speech": "audio",
    "audios": "audio",
    "images": "image",
    "latents": "latent",
}

# Separators between parts of a modality string: "text+audio", "image,text".
_SEPARATORS = re.compile(r"[+,]")

DEFAULT_FIELD = "output_modalities"


class UnknownModalityError(InvalidArgumentError):
    """A modality name or proto value that is not one we know.

    The message names the field, the offending value, and every spelling
    that would have been accepted.
    """

    def __init__(self, value: object, *, field: str = DEFAULT_FIELD, within: str | None = None):
        where = f" in {within!r}" if within is not None else ""
        super().__init__(field, f"unknown modality {value!r}{where}; {_supported_text()}")
        self.value = value


class OutputModality(enum.Flag):
    """A set of output kinds; values equal the proto enum values."""

    TEXT = 1
    IMAGE = 2
    AUDIO = 4
    LATENT = 8

    @classmethod
    def from_string(cls, s: str | None, *, field: str = DEFAULT_FIELD) -> OutputModality:
        """Parse a free-text modality set such as ``"text+audio"`` or ``"image,text"``.

        Case and surrounding spaces are ignored; parts are separated by ``+``
        or ``,``; aliases such as ``speech`` are accepted. A missing or blank
        string means text. An empty part (``"text+"``) or an unknown name
        raises `UnknownModalityError` naming `field`.
        """
        if s is None or not s.strip():
            return cls.TEXT
        parts = _SEPARATORS.split(s)
        result = cls(0)
        for raw in parts:
            part = raw.strip().lower()
            name = _ALIASES.get(part, part)
            member = cls.__members__.get(name.upper()) if name else None
            if member is None:
                within = s if len(parts) > 1 else None
                raise UnknownModalityError(part, field=field, within=within)
            result |= member
        return result

    @classmethod
    def from_proto(cls, values: Iterable[int], *, field: str = DEFAULT_FIELD) -> OutputModality:
        """Combine repeated proto enum values into one set.

        No values means text. ``OUTPUT_MODALITY_UNSPECIFIED`` (0) inside a
        non-empty list, or a value this build does not know, is refused.
        """
        result = cls(0)
        seen_any = False
        for value in values:
            seen_any = True
            member = _BY_VALUE.get(int(value))
            if member is None:
                raise UnknownModalityError(int(value), field=field)
            result |= member
        return result if seen_any else cls.TEXT

    def to_proto(self) -> list[int]:
        """The proto enum value of each member in the set, ascending."""
        return [m.value for m in _MEMBERS if m in self]

    def names(self) -> list[str]:
        """Lowercase member names in value order, e.g. ``["text", "audio"]``."""
        return [m.name.lower() for m in _MEMBERS if m.name and m in self]

    def to_string(self) -> str:
        """Canonical text form, e.g. ``"text+audio"``; `from_string` parses it back."""
        return "+".join(self.names())

    def __str__(self) -> str:
        return self.to_string()

    @property
    def has_text(self) -> bool:
        """True when text is one of the outputs."""
        return OutputModality.TEXT in self

    @property
    def has_multimodal(self) -> bool:
        """True when anything other than text is among the outputs."""
        return bool(self & ~OutputModality.TEXT)


# Single members in value order (iteration over the class yields exactly these).
_MEMBERS: tuple[OutputModality, ...] = tuple(OutputModality)
_BY_VALUE: dict[int, OutputModality] = {m.value: m for m in _MEMBERS}


def _supported_text() -> str:
    names = ", ".join(m.name.lower() for m in OutputModality if m.name)
    return f"supported: {names} (aliases: {', '.join(_ALIASES)})"


__all__ = ["DEFAULT_FIELD", "OutputModality", "UnknownModalityError"]
