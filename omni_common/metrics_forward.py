"""Metrics of child processes, served by their parent's /metrics.

A service whose work runs in child processes (the decoder's stage processes
and code2wav workers) serves one /metrics endpoint. Each child takes a
`snapshot` of its own registry (plain, picklable tuples) and sends it on the
channel it already has to its parent (a status message); the parent keeps the
latest snapshot of each child in a `Forwarded` store, and a `MergedRegistry`
serves its own series and every child's, the child's labelled with where it
came from (``stage="talker"``). Nothing is written to disk: a directory of
per-process files (prometheus_client's multiprocess mode) would keep the
files of dead processes across restarts.

Counters, histograms and summaries stay monotonic across a child's restart:
when a child is `retire`d (it exited), its last cumulative values become an
offset that the next process of the same source adds to its own. Gauges are
the live child's value; a retired child's gauges disappear with it.

Families are merged by name: a series the parent also has (its own link's
fallback counter, say) and a child's end up in one family, so the exposition
never repeats a family's HELP/TYPE lines. The ``_created`` samples (a
process's start time per series) are not forwarded: they would say when a
child started, not when the series did.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import Metric

# (family name, type, documentation, [(sample name, labels, value), ...])
FamilySnapshot = tuple[str, str, str, list[tuple[str, dict[str, str], float]]]

_CUMULATIVE_TYPES = frozenset({"counter", "histogram", "summary"})
# sample suffixes of cumulative families that are themselves cumulative (a histogram's
# buckets, count and sum; a counter's total)
_CUMULATIVE_SUFFIXES = ("_total", "_count", "_sum", "_bucket")


def snapshot(registry: Any = REGISTRY, *, prefix: str = "omni_",
             exclude: Iterable[str] = ()) -> list[FamilySnapshot]:
    """This process's series whose family name starts with `prefix`, except
    the families named in `exclude` (those the parent records itself)."""
    skip = frozenset(exclude)
    out: list[FamilySnapshot] = []
    for family in registry.collect():
        if not family.name.startswith(prefix) or family.name in skip:
            continue
        samples = [(s.name, dict(s.labels), float(s.value)) for s in family.samples
                   if not s.name.endswith("_created")]
        if samples:
            out.append((family.name, family.type, family.documentation, samples))
    return out


def _key(sample: str, labels: Mapping[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    return sample, tuple(sorted(labels.items()))


def _cumulative(family_type: str, sample: str) -> bool:
    return family_type in _CUMULATIVE_TYPES and sample.endswith(_CUMULATIVE_SUFFIXES)


class Forwarded:
    """The latest snapshot of each child, by source (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, tuple[dict[str, str], list[FamilySnapshot]]] = {}
        # source -> sample key -> (family, type, doc, the cumulative value its dead processes reached)
        self._offsets: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], tuple[str, str, str, float]]] = {}

    def update(self, source: str, labels: Mapping[str, str], families: list[FamilySnapshot]) -> None:
        """A child's latest snapshot; `labels` are added to each of its series."""
        with self._lock:
            self._live[source] = (dict(labels), families)

    def retire(self, source: str) -> None:
        """The child ended: its cumulative values carry over to the next
        process of this source; its gauges go."""
        with self._lock:
            entry = self._live.pop(source, None)
            if entry is None:
                return
            labels, families = entry
            offsets = self._offsets.setdefault(source, {})
            for name, typ, doc, samples in families:
                for sample, sample_labels, value in samples:
                    if not _cumulative(typ, sample):
                        continue
                    k = _key(sample, {**sample_labels, **labels})
                    prev = offsets.get(k)
                    offsets[k] = (name, typ, doc, (prev[3] if prev else 0.0) + value)

    def families(self) -> dict[str, Metric]:
        """Every forwarded series, labelled, as families by name."""
        merged: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[str, str, str, float]] = {}
        with self._lock:
            for offsets in self._offsets.values():
                for k, (name, typ, doc, value) in offsets.items():
                    prev = merged.get(k)
                    merged[k] = (name, typ, doc, value + (prev[3] if prev else 0.0))
            for labels, families in self._live.values():
                for name, typ, doc, samples in families:
                    for sample, sample_labels, value in samples:
                        k = _key(sample, {**sample_labels, **labels})
                        prev = merged.get(k)
                        add = prev[3] if prev is not None and _cumulative(typ, sample) else 0.0
                        merged[k] = (name, typ, doc, value + add)
        out: dict[str, Metric] = {}
        for (sample, label_items), (name, typ, doc, value) in merged.items():
            family = out.get(name)
            if family is None:
                family = out[name] = Metric(name, doc, typ)
            family.add_sample(sample, dict(label_items), value)
        return out


FORWARDED = Forwarded()
"""This process's store of its children's series (what its /metrics serves
through `MergedRegistry(FORWARDED)`)."""


class MergedRegistry:
    """What /metrics serves: this process's registry with the children's
    series merged into it by family (`generate_latest(MergedRegistry(...))`)."""

    def __init__(self, forwarded: Forwarded, registry: Any = REGISTRY) -> None:
        self.forwarded = forwarded
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        children = self.forwarded.families()
        for family in self.registry.collect():
            extra = children.pop(family.name, None)
            if extra is not None:
                family.samples.extend(extra.samples)
            yield family
        yield from children.values()
