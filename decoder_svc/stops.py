"""Stop sequences over a request's text stage, step by step (``StopWatch``).

A text stage (the thinker) samples one token per request and step; each
step brings the token's text (the detokenizer's delta), its id, and the rows
the next stage (the talker) reads. ``StopWatch.push`` takes a step and
answers which steps may go on now, to the client and to the talker:

- while the text's end could still be the beginning of a stop sequence
  (its longest suffix that is a proper prefix of one), the steps that
  overlap that suffix are held back: their text is not sent and the talker
  does not get their rows, so nothing a stop would cut has been shown or
  spoken;
- when a stop sequence appears, the steps wholly before it go, then the
  step in which it begins with its text cut where it begins, and the watch
  is stopped: the stage's request ends with finish reason "stop".

The talker's input keeps its invariant (rows = prompt + reply ids - 1: the
reply's last id is never spoken) because a step's rows are those of the
position it forwarded, the previous token's: releasing steps up to the one
in which the stop begins hands the talker every token before it, and that
token's id as the reply's unspoken last one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["HeldStep", "StopWatch"]


@dataclass
class HeldStep:
    """One step of a request on the text stage, as the router got it."""

    text: str
    ids: tuple[int, ...] = ()
    tensors: dict[str, Any] = field(default_factory=dict)  # the next stage's rows


class StopWatch:
    """One request's stop sequences (see the module docstring)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        assert stops, "a watch needs stop sequences"
        self.stops = stops
        self._held: list[HeldStep] = []
        self._text = ""  # the held steps' text
        self.stopped = False

    @property
    def held(self) -> int:
        """Steps held back now."""
        return len(self._held)

    def push(self, step: HeldStep) -> list[HeldStep]:
        """A new step; the steps that may go on now, in order (after a stop:
        the last one's text is cut where the sequence begins, and ``stopped``)."""
        assert not self.stopped, "the watch stopped"
        self._held.append(step)
        self._text += step.text
        at = self._first_stop()
        if at is not None:
            self.stopped = True
            return self._release_before(at)
        keep = self._tail_to_hold()
        out: list[HeldStep] = []
        while self._held and len(self._text) - len(self._held[0].text) >= keep:
            first = self._held.pop(0)
            self._text = self._text[len(first.text):]
            out.append(first)
        return out

    def flush(self) -> list[HeldStep]:
        """The stage ended by itself: every held step goes on."""
        out, self._held, self._text = self._held, [], ""
        return out

    def _first_stop(self) -> int | None:
        """Offset in the held text where the earliest stop sequence begins."""
        found = [i for i in (self._text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _tail_to_hold(self) -> int:
        """Characters at the end of the held text that begin some stop sequence."""
        text = self._text
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _release_before(self, at: int) -> list[HeldStep]:
        out: list[HeldStep] = []
        pos = 0
        for step in self._held:
            end = pos + len(step.text)
            if end <= at and (end < at or step.text):
                out.append(step)  # wholly before the stop
            else:  # the stop begins in this step (or right at its start)
                out.append(HeldStep(step.text[: max(0, at - pos)], step.ids, step.tensors))
                break
            pos = end
        self._held, self._text = [], ""
        return out
