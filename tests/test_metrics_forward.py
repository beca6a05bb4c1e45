"""omni_common.metrics_forward: child registries merged into the parent's /metrics (unit, own registries)."""

from __future__ import annotations

import pickle

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from omni_common.metrics_forward import Forwarded, MergedRegistry, snapshot


def child_registry():
    reg = CollectorRegistry()
    fallback = Counter("omni_decoder_fallback_steps_total", "steps built in-process", ["reason"], registry=reg)
    mode = Gauge("omni_decoder_materializer_mode", "1 for the current mode", ["mode"], registry=reg)
    gap = Histogram("omni_decoder_step_gap_seconds", "gap", ["stage"], registry=reg, buckets=(0.1, 1.0))
    Counter("other_total", "not ours", registry=reg).inc()
    return reg, fallback, mode, gap


def values(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_snapshot_is_plain_and_filtered():
    reg, fallback, mode, gap = child_registry()
    fallback.labels("stall").inc(3)
    mode.labels("remote").set(1)
    gap.labels("talker").observe(0.05)
    snap = snapshot(reg, exclude={"omni_decoder_step_gap_seconds"})
    assert pickle.loads(pickle.dumps(snap)) == snap
    names = [f[0] for f in snap]
    assert names == ["omni_decoder_fallback_steps", "omni_decoder_materializer_mode"], names
    samples = dict(((s, tuple(sorted(lab.items()))), v) for _, _, _, ss in snap for s, lab, v in ss)
    assert samples == {("omni_decoder_fallback_steps_total", (("reason", "stall"),)): 3.0,
                       ("omni_decoder_materializer_mode", (("mode", "remote"),)): 1.0}, samples


def test_parent_and_children_merge_into_one_family_with_a_stage_label():
    parent = CollectorRegistry()
    own = Counter("omni_decoder_fallback_steps_total", "steps built in-process", ["reason"], registry=parent)
    own.labels("no_slot").inc(2)
    reg, fallback, mode, _ = child_registry()
    fallback.labels("stall").inc(5)
    mode.labels("in_process").set(1)
    fwd = Forwarded()
    fwd.update("stage:talker", {"stage": "talker"}, snapshot(reg))
    text = generate_latest(MergedRegistry(fwd, parent)).decode()
    assert text.count("# TYPE omni_decoder_fallback_steps_total counter") == 1, text
    got = values(text)
    assert got[("omni_decoder_fallback_steps_total", (("reason", "no_slot"),))] == 2.0
    assert got[("omni_decoder_fallback_steps_total", (("reason", "stall"), ("stage", "talker")))] == 5.0
    assert got[("omni_decoder_materializer_mode", (("mode", "in_process"), ("stage", "talker")))] == 1.0


def test_counters_stay_monotonic_across_a_child_restart_and_gauges_go_with_it():
    fwd = Forwarded()
    reg, fallback, mode, gap = child_registry()
    fallback.labels("stall").inc(4)
    mode.labels("remote").set(1)
    gap.labels("talker").observe(0.5)
    fwd.update("stage:talker", {"stage": "talker"}, snapshot(reg))
    fwd.retire("stage:talker")
    text = generate_latest(MergedRegistry(fwd, CollectorRegistry())).decode()
    got = values(text)
    assert got[("omni_decoder_fallback_steps_total", (("reason", "stall"), ("stage", "talker")))] == 4.0
    assert not any(k[0] == "omni_decoder_materializer_mode" for k in got), "a dead child's gauge stays"
    reg2, fallback2, mode2, gap2 = child_registry()  # the restarted process counts from 0
    fallback2.labels("stall").inc(1)
    gap2.labels("talker").observe(0.5)
    mode2.labels("remote").set(1)
    fwd.update("stage:talker", {"stage": "talker"}, snapshot(reg2))
    got = values(generate_latest(MergedRegistry(fwd, CollectorRegistry())).decode())
    assert got[("omni_decoder_fallback_steps_total", (("reason", "stall"), ("stage", "talker")))] == 5.0
    assert got[("omni_decoder_step_gap_seconds_count", (("stage", "talker"),))] == 2.0
    assert got[("omni_decoder_step_gap_seconds_bucket", (("le", "1.0"), ("stage", "talker")))] == 2.0
    assert got[("omni_decoder_materializer_mode", (("mode", "remote"), ("stage", "talker")))] == 1.0
