"""`--explain CHECK`: what a check sends and what it expects, without a target.

Messages are the ones the check builds at run time, decoded and abbreviated
(tensors show dtype, shape and their first values). Handles name an arena
the explanation creates for the purpose under `omni-<deployment>`, as the
kit does when it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from materializer_svc.conformance import vectors
from materializer_svc.conformance.cases import ALL_CASES, Case, CaseContext, make_probe, probe_plan
from materializer_svc.conformance.checks import (
    ARENA_PROBES,
    DEFAULT_GOLDEN,
    ERROR_STREAM_READINESS_MS,
    SKIPPED_V1,
    check_names,
)
from materializer_svc.conformance.client import place
from materializer_svc.conformance.compare import render, summary
from omni_common.shm_arena import ShmArena
from omni_serving.v1 import materializer_pb2

FULL_STEPS = 2  # snapshots of a golden scenario shown in full; the rest one line each


def _open(prefix: str, plans, readiness_ms: int, name: str) -> materializer_pb2.MaterializeRequest:
    return materializer_pb2.MaterializeRequest(
        open=materializer_pb2.MaterializeStreamOpen(
            shm_prefix=prefix,
            stages=list(plans),
            readiness_timeout_ms=readiness_ms,
            client_name=name,
        )
    )


def _block(title: str, msg, indent: int = 4) -> str:
    body = render(msg, indent)
    return f"  {title}\n{body}" if body else f"  {title} (all fields at their defaults)"


_OPEN_DOCS = {
    "open/wrong_prefix": (
        "open.shm_prefix = '<prefix>-other' (another deployment)",
        "the call ends with FAILED_PRECONDITION and a non-empty status message; no answer",
    ),
    "open/not_first": (
        "a snapshot as the first message (no open)",
        "the call ends with INVALID_ARGUMENT and a non-empty status message",
    ),
    "open/missing": (
        "nothing: the kit half-closes the stream before any message",
        "the call ends with INVALID_ARGUMENT and a non-empty status message",
    ),
    "open/twice": (
        "open, a good probe step (answered exactly), then a second open",
        "the probe step is answered; then the call ends with INVALID_ARGUMENT",
    ),
    "open/bad_plan": (
        "open whose plan's routes[0].destination is PAYLOAD_DESTINATION_UNSPECIFIED",
        "the call ends with INVALID_ARGUMENT and a non-empty status message",
    ),
}

_STATIC = {
    "info": (
        "GetMaterializerInfo {} (no arena_probe)",
        'implementation non-empty; contract = "omni_serving.v1"; shm_prefix = "omni-<deployment>"; '
        "supports_shm and supports_inline both true. If this check fails no other check runs.",
    ),
    "v2/identity": (
        "GetMaterializerInfo {} twice",
        "contract_version >= 2; instance_id non-empty and equal in both answers; start_time_unix_ms "
        "equal in both answers and between 1577836800000 (2020-01-01) and the kit's clock + 300 s; "
        f"draining false. Contract version 1 implementations: '{SKIPPED_V1}'.",
    ),
    "golden/load": (
        "nothing (reads --golden DIR, default the vectors shipped with the kit)",
        "manifest.json of format 1 for contract omni_serving.v1, every file's sha256 as listed",
    ),
    "golden/connector_signals": (
        "nothing more: judges the answers of every golden/* stream that ran",
        "each MaterializedStep.connector_signals equals its own snapshot's connector_output.signals, "
        "in order (never another step's)",
    ),
    "golden/slot_releases": (
        "nothing more: judges the answers of every golden/* stream that ran",
        "golden/shm: each answer releases exactly the one (region, slot, generation) its snapshot "
        "names; golden/inline: no releases",
    ),
    "readiness/late_mark": (
        "open (readiness_timeout_ms 5000), then a probe step whose slot is marked ready 150 ms "
        "after the snapshot is sent",
        "the step is answered (not refused) with the probe's payloads",
    ),
    "stream/cancel_then_reconnect": (
        "open (readiness_timeout_ms 2000), a good probe step, a probe whose slot is never marked "
        "ready, a good probe queued behind it; the kit cancels the call 100 ms later, opens a new "
        "stream and sends probe steps 1, 2, 3 (step ids restart on a new stream)",
        "each of the 3 steps on the new stream is answered exactly within 5 s; the new stream ends "
        "OK after half-close; active_streams returns to its value before the check",
    ),
    "stream/concurrent_isolation": (
        "two streams at once: the busiest golden scenario through the arena, and a stream of bad "
        "steps (region_unknown, stale_generation, readiness_never_marked, offset_u64_max, "
        "undeclared_stage) each followed by a good probe",
        "the golden stream's answers are exact and release their slots; every bad step gets its code",
    ),
    "info/counters": (
        "GetMaterializerInfo {} (also once before the first open/ check)",
        "steps_materialized and steps_failed grew by at least the steps and StepErrors the kit "
        "received; active_streams back to its value at the start within 5 s",
    ),
}


def _explain_case(case: Case, arena: ShmArena) -> str:
    last_id = 1
    built = case.build(CaseContext(arena, last_id + 1, last_id))
    try:
        lines = [
            f"{case.name}: {case.doc}",
            "Sends (on one stream that serves the whole bad-step matrix, after a good step "
            f"{last_id} of stage 0):",
            _block(
                "open:",
                _open(
                    arena.prefix, [probe_plan()], ERROR_STREAM_READINESS_MS, "conformance/errors"
                ),
            ),
            _block("snapshot:", built.snapshot),
            "Expects:",
            f"  StepError {{step_id: {built.snapshot.step_id}, stage_id: {built.snapshot.stage_id}, "
            f"code: {case.code.name} ({case.code.value[0]})}}",
            "  message: non-empty; with --strict-messages it must contain "
            f"{case.hint!r} (case-insensitive)",
            "  released_slots: no duplicates, only slots the snapshot names, and at least "
            f"{[list(k) for k in built.must_release] or 'nothing (inline only)'}",
            "Then, on the same stream: a good probe step (answered exactly) and a "
            "GetMaterializerInfo call that must succeed.",
        ]
    finally:
        for lease in built.leases:
            arena.release(lease.slot, lease.generation)
    return "\n".join(lines)


def _explain_golden(name: str, scenarios: Sequence[vectors.Scenario], prefix: str) -> str:
    _, mode, sc_name = name.split("/", 2)
    sc = next(s for s in scenarios if s.name == sc_name)
    open_req = materializer_pb2.MaterializeRequest()
    open_req.CopyFrom(sc.open)
    open_req.open.shm_prefix = prefix
    how = (
        "tensors inline, as in the golden file"
        if mode == "inline"
        else "every tensor of a snapshot copied into one arena slot, sent as handles (slot taken as "
        "gRPC pulls the request; the kit keeps sending without waiting for answers)"
    )
    lines = [
        f"{name}: {sc.description}",
        f"Sends one stream: open, then {len(sc.snapshots)} snapshots ({how}), then half-close.",
        _block("open:", open_req),
    ]
    for i, (snap, want) in enumerate(zip(sc.snapshots, sc.expected, strict=True)):
        if i < FULL_STEPS:
            lines.append(_block(f"snapshot [{i}]:", snap))
            lines.append(
                _block(f"expected answers[{i}] (released_slots compared separately):", want)
            )
        else:
            lines.append(
                f"  snapshot [{i}]: step {snap.step_id} stage {snap.stage_id}, "
                f"{len(snap.request_ids)} requests, {len(snap.multimodal_outputs)} multimodal outputs"
                f" -> {summary(want.step)}"
            )
    lines += [
        "Expects:",
        "  one MaterializedStep per snapshot, in order, equivalent to the golden answer after "
        "normalisation (a set-but-empty MultimodalPayload equals an unset one; unknown fields are "
        "ignored); a mismatch is reported at its first differing field path",
        "  released_slots: none (inline) or exactly the snapshot's slot (shm), checked by "
        "golden/slot_releases",
        "  the call ends OK after the last answer",
    ]
    return "\n".join(lines)


def _explain_probe(name: str, prefix: str) -> str:
    kind = name.rsplit("/", 1)[1]
    want, sends = ARENA_PROBES[kind]
    want_name = materializer_pb2.ArenaProbeResult.Name(want)
    return "\n".join(
        [
            f"{name}:",
            f"Sends: GetMaterializerInfo {{arena_probe: {sends}}} (segment names under {prefix}-arena-"
            " unless stated otherwise)",
            f"Expects: arena_probe = {want_name}"
            + (
                "; ARENA_PROBE_RESULT_UNSUPPORTED instead when the implementation reports supports_shm = false"
                if kind != "unset"
                else ""
            )
            + ". A segment the kit made still exists afterwards, byte for byte unchanged.",
            f"Contract version 1 implementations: '{SKIPPED_V1}'.",
        ]
    )


def explain(
    pattern: str, *, deployment: str = "explain", golden_dir: str | Path | None = None
) -> str:
    """The explanation of every check whose name is `pattern` or starts with it.

    Raises KeyError when no check matches.
    """
    golden = Path(golden_dir) if golden_dir is not None else DEFAULT_GOLDEN
    scenarios = (
        vectors.load_golden(golden) if (golden / vectors.MANIFEST).exists() else vectors.generate()
    )
    names = check_names([s.name for s in scenarios])
    picked = [n for n in names if n == pattern] or [n for n in names if n.startswith(pattern)]
    if not picked:
        raise KeyError(pattern)
    prefix = f"omni-{deployment}"
    cases = {c.name: c for c in ALL_CASES}
    out: list[str] = []
    arena: ShmArena | None = None
    try:
        for name in picked:
            if name in cases:
                if arena is None:
                    arena = ShmArena(prefix, 4, 256 * 1024)
                out.append(_explain_case(cases[name], arena))
            elif name.startswith(("golden/inline/", "golden/shm/")):
                out.append(_explain_golden(name, scenarios, prefix))
            elif name.startswith("v2/arena_probe/"):
                out.append(_explain_probe(name, prefix))
            elif name in _OPEN_DOCS:
                sends, expects = _OPEN_DOCS[name]
                plan_open = _open(prefix, [probe_plan()], 5000, "conformance")
                if name == "open/bad_plan":
                    plan_open.open.stages[0].routes[
                        0
                    ].destination = materializer_pb2.PAYLOAD_DESTINATION_UNSPECIFIED
                elif name == "open/wrong_prefix":
                    plan_open.open.shm_prefix = f"{prefix}-other"
                text = [f"{name}:", f"Sends: {sends}"]
                if name not in ("open/missing", "open/not_first"):
                    text.append(_block("open:", plan_open))
                text.append(f"Expects: {expects}")
                out.append("\n".join(text))
            elif name in ("readiness/late_mark",):
                sends, expects = _STATIC[name]
                if arena is None:
                    arena = ShmArena(prefix, 4, 256 * 1024)
                placed = place(arena, make_probe(1).snapshot, mark_ready=False)
                try:
                    out.append(
                        "\n".join(
                            [
                                f"{name}:",
                                f"Sends: {sends}",
                                _block("snapshot:", placed.snapshot),
                                f"Expects: {expects}",
                                _block("expected answer (equivalent to):", make_probe(1).expected),
                            ]
                        )
                    )
                finally:
                    arena.release(placed.lease.slot, placed.lease.generation)
            else:
                sends, expects = _STATIC[name]
                out.append(f"{name}:\nSends: {sends}\nExpects: {expects}")
    finally:
        if arena is not None:
            arena.close()
    return "\n\n".join(out)
