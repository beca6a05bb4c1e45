"""Where a talker step goes: the forward, the code predictor, the output path.

From the decoders' /metrics (the talker stage process's series, forwarded
there), read before and after a level: the step (``omni_decoder_step_seconds``:
forward and sample, the code predictor inside), the code predictor
(``omni_decoder_code_predictor_seconds``, host time) and the critical-path
gap between sampling a step and launching the next
(``omni_decoder_step_gap_seconds``: the output path's share of the step loop).
A talker step is step + gap; its parts are the forward (step minus code
predictor), the code predictor, and the output path (gap).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable
from typing import Any

FAMILIES = {
    "omni_decoder_step_seconds": "step",
    "omni_decoder_step_gap_seconds": "gap",
    "omni_decoder_code_predictor_seconds": "code_predictor",
}
STAGE = "talker"


def parse(text: str, stage: str = STAGE) -> dict[str, float]:
    """Sums and counts of the three families for `stage`, from one /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {f"{part}_{kind}": 0.0 for part in FAMILIES.values() for kind in ("s", "n")}
    for family in text_string_to_metric_families(text):
        part = FAMILIES.get(family.name)
        if part is None:
            continue
        for s in family.samples:
            if s.labels.get("stage") != stage:
                continue
            if s.name.endswith("_sum"):
                out[f"{part}_s"] += s.value
            elif s.name.endswith("_count"):
                out[f"{part}_n"] += s.value
    return out


def snapshot(metrics_urls: Iterable[str], stage: str = STAGE) -> dict[str, float] | None:
    """The sums of every decoder's /metrics (None: none answered)."""
    total: dict[str, float] | None = None
    for url in metrics_urls:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                got = parse(resp.read().decode(), stage)
        except OSError:
            continue
        total = got if total is None else {k: total[k] + v for k, v in got.items()}
    return total


def shares(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """A level's talker steps: how many, ms per step, and the share of each
    part (None when there is nothing to compare, or no talker step ran)."""
    if not before or not after:
        return None
    d = {k: after[k] - before[k] for k in after}
    steps, total = d["step_n"], d["step_s"] + d["gap_s"]
    if steps <= 0 or total <= 0:
        return None
    forward = max(d["step_s"] - d["code_predictor_s"], 0.0)
    return {
        "steps": int(steps),
        "step_ms": total / steps * 1e3,
        "forward_share": forward / total,
        "code_predictor_share": d["code_predictor_s"] / total,
        "output_path_share": d["gap_s"] / total,
    }
