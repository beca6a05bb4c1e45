"""Stop sequences, piece by piece: the checks (``omni_common.stop_strings``)
and the watch over a text stage's steps (``decoder_svc.stops``). Served:
``tests/test_lengths_and_endings.py`` (fake engine, every route's refusals)
and ``tests/test_omni_input.py`` (vLLM: the speech stops where the text does,
against the reference)."""

from __future__ import annotations

import random

import pytest

from decoder_svc.stops import HeldStep, StopWatch
from omni_common.errors import InvalidArgumentError
from omni_common.stop_strings import check_stops


def _run(stops: tuple[str, ...], pieces: list[str], finished: bool = True):
    """Feed one step per piece (its index as the token id); (released steps in
    order, the step index at which each release happened, stopped)."""
    watch = StopWatch(stops)
    out: list[HeldStep] = []
    when: list[int] = []
    for i, piece in enumerate(pieces):
        got = watch.push(HeldStep(piece, (i,), {"rows": i}))
        out += got
        when += [i] * len(got)
        if watch.stopped:
            return out, when, True
    if finished:
        rest = watch.flush()
        out += rest
        when += [len(pieces)] * len(rest)
    return out, when, False


def test_text_without_a_stop_passes_whole_and_holds_only_what_could_begin_one():
    out, when, stopped = _run(("END",), ["a", "b", "E", "N", "x", "E"])
    assert not stopped and "".join(s.text for s in out) == "abENxE"
    # "E" and "EN" could begin "END": held until "x" shows they do not; the last "E" until the finish
    assert when == [0, 1, 4, 4, 4, 6]


@pytest.mark.parametrize("pieces,stops,text,ids,cut_text", [
    (["he", "llo", " wor", "ld"], ("lo w",), "hel", [0, 1], "l"),  # begins mid-token: that token keeps "l"
    (["he", "llo", " wor", "ld"], ("llo",), "he", [0, 1], ""),  # begins at a token's start
    (["a", "b", "c", "d"], ("bc", "c"), "a", [0, 1], ""),  # the earliest sequence wins
    (["ab", "cd"], ("a",), "", [0], ""),  # in the first step: no text at all
    (["x", "", "yz"], ("yz",), "x", [0, 1, 2], ""),  # an empty step before the stop goes whole
])
def test_a_stop_releases_what_is_before_it_and_cuts_its_step(pieces, stops, text, ids, cut_text):
    out, _, stopped = _run(stops, pieces)
    assert stopped
    assert "".join(s.text for s in out) == text
    assert [s.ids[0] for s in out] == ids  # the step the stop begins in goes on (the talker's unspoken last id)
    assert out[-1].text == cut_text
    assert [s.tensors["rows"] for s in out] == ids


def test_a_stop_spanning_many_steps_holds_them_all_until_it_completes():
    pieces = ["The", " cap", "ital", " is", " Par", "is", "."]
    watch = StopWatch((" is Paris!",))
    released = []
    for i, p in enumerate(pieces):
        released.append(len(watch.push(HeldStep(p, (i,)))))
        if i == 5:
            assert watch.held == 3  # " is", " Par", "is" might still be the sequence
    assert released == [1, 1, 1, 0, 0, 0, 4] and not watch.stopped


def test_randomised_against_a_plain_search():
    rng = random.Random(7)
    alphabet = "ab c"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 10)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)] if text else []
        stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))})
        out, when, stopped = _run(stops, pieces)
        at = None  # as generation sees it: the first step whose text so far holds a sequence ends it there
        end = 0
        for p in pieces:
            end += len(p)
            found = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
            if found:
                at = min(found)
                break
        got = "".join(s.text for s in out)
        if at is None:
            assert not stopped and got == text
        else:
            assert stopped and got == text[:at], (text, stops, pieces)
        # nothing released was later cut: every release is a prefix of the final text
        for i in range(len(out)):
            assert got.startswith("".join(s.text for s in out[: i + 1]))


@pytest.mark.parametrize("values,field,words", [
    (["a"] * 5, "s", "at most 4"),
    (["ok", ""], "s[1]", "is empty"),
    (["x" * 129], "s[0]", "at most 128"),
    (["\ud800"], "s[0]", "not valid Unicode"),
])
def test_checks(values, field, words):
    with pytest.raises(InvalidArgumentError) as err:
        check_stops(values, "s")
    assert err.value.field == field and words in str(err.value)
    assert check_stops(["a", "b c"], "s") == ("a", "b c")
