"""The engine facts a stage process reported, as a backend's attributes.

``ReportedFacts`` gives ``StageProcess`` (``.proxy``) the attributes the
pipeline reads of a backend (``role``, ``max_model_len``, ``hidden_size``,
...) from the ``StageFacts`` its process sent when it was ready (``.messages``).
A fact the process did not report raises AttributeError, so a reader's
default applies as for a backend without that attribute.
"""

from __future__ import annotations

from typing import Any

from decoder_svc.stage.messages import StageFacts


class ReportedFacts:
    """Backend attributes over ``self._facts`` (None until the process is ready)."""

    _facts: StageFacts | None

    def engine_facts(self) -> dict[str, Any]:
        return dict(self._facts.engine_facts) if self._facts is not None else {}

    def _fact(self, name: str) -> Any:
        """A fact of the stage's engine as its process reported it; an
        AttributeError when it did not (the reader's default then applies,
        as for a backend without that attribute)."""
        value = getattr(self._facts, name, None)
        if value is None:
            raise AttributeError(name)
        return value

    @property
    def role(self) -> str:
        return self._fact("role")

    @property
    def max_model_len(self) -> int:
        return self._fact("max_model_len")

    @property
    def sampling_defaults(self) -> tuple[float, float, int]:
        return self._fact("sampling_defaults")

    @property
    def model_name(self) -> str:
        return self._fact("model_name")

    @property
    def num_codebooks(self) -> int:
        return self._fact("num_codebooks")

    @property
    def codec_vocab(self) -> int:
        return self._fact("codec_vocab")

    @property
    def streams_input(self) -> bool:
        return self._fact("streams_input")

    @property
    def min_input_tokens(self) -> int:
        return self._fact("min_input_tokens")

    @property
    def hidden_size(self) -> int:
        return self._fact("hidden_size")

    @property
    def audio_input_rate(self) -> int:
        return self._fact("audio_input_rate")

    @property
    def image_input(self) -> bool:
        return self._fact("image_input")

    @property
    def speech_instructions(self) -> bool:
        return self._fact("speech_instructions")

    @property
    def languages(self) -> tuple[str, ...]:
        return self._fact("languages")
