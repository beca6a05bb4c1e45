"""Stop sequences of a request (``SamplingParams.stop``): checked the same way
by the gateway and the decoder; matched by ``decoder_svc.stops``."""

from __future__ import annotations

from collections.abc import Iterable

from omni_common.errors import InvalidArgumentError

__all__ = ["MAX_STOPS", "MAX_STOP_CHARS", "check_stops"]

MAX_STOPS = 4
"""Stop sequences a request may give (OpenAI's limit)."""
MAX_STOP_CHARS = 128
"""Longest stop sequence, in characters."""


def check_stops(values: Iterable[str], field: str = "sampling_params.stop") -> tuple[str, ...]:
    """The stop sequences, each non-empty and at most MAX_STOP_CHARS, at most MAX_STOPS."""
    stops = tuple(values)
    if len(stops) > MAX_STOPS:
        raise InvalidArgumentError(field, f"has {len(stops)} sequences; at most {MAX_STOPS}")
    for i, s in enumerate(stops):
        if not s:
            raise InvalidArgumentError(f"{field}[{i}]", "is empty")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidArgumentError(f"{field}[{i}]", f"has {len(s)} characters; at most {MAX_STOP_CHARS}")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgumentError(f"{field}[{i}]", "is not valid Unicode") from None
    return stops
