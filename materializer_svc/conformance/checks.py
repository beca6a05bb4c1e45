"""The checks: drive an implementation over the wire and judge every answer.

`run_conformance` is the entry point for code (pytest included); the CLI
prints its results. Every check is independent: a failure is reported and
the next check starts on a fresh stream. Answers are compared as decoded,
normalised messages (`compare.py`); a mismatch is reported at its first
differing field path. The `v2/*` checks run only against implementations
that report contract_version 2 or more; for others they are skipped.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from materializer_svc.conformance import vectors
from materializer_svc.conformance.cases import (
    ALL_CASES,
    HANDLE_CASES,
    STEP_CASES,
    Built,
    Case,
    CaseContext,
    make_probe,
    probe_plan,
)
from materializer_svc.conformance.client import (
    NoAnswer,
    Placed,
    Stream,
    StreamEnded,
    info,
    open_channel,
    place,
    release_key,
    tensor_refs,
)
from materializer_svc.conformance.compare import code_name, first_difference
from materializer_svc.conformance.compare import summary as msg_summary
from materializer_svc.conformance.vectors import Scenario
from omni_common.errors import OmniError
from omni_common.shm_arena import (
    ENTRY_BYTES,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    SHM_DIR,
    VERSION,
    ShmArena,
)
from omni_serving.v1 import materializer_pb2, snapshot_pb2, tensor_pb2

DEFAULT_GOLDEN = Path(__file__).resolve().parent / "golden"
ERROR_STREAM_READINESS_MS = 300


SKIPPED_V1 = "skipped: implementation reports contract_version 1"


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str = ""
    seconds: float = 0.0
    skipped: bool = False  # not applicable to this implementation; counts as passed

    def line(self) -> str:
        status = "SKIP" if self.skipped else "PASS" if self.passed else "FAIL"
        tail = f"  {self.detail}" if self.detail else ""
        return f"{status}  {self.name:<44} {self.seconds:6.2f}s{tail}"


class CheckFailed(AssertionError):
    pass


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise CheckFailed(message)


_code_name = code_name


def diff_steps(
    want: materializer_pb2.MaterializedStep,
    got: materializer_pb2.MaterializedStep,
    path: str = "step",
) -> str | None:
    """`path: expected X, got Y` at the first field where two materialized
    steps differ after normalisation; None if they are equivalent."""
    return first_difference(want, got, path)


def payload_only(step: materializer_pb2.MaterializedStep) -> materializer_pb2.MaterializedStep:
    """The step without released_slots (compared separately)."""
    out = materializer_pb2.MaterializedStep()
    out.CopyFrom(step)
    out.ClearField("released_slots")
    return out


@dataclass
class StreamRun:
    """What one scenario run received, for checks and for callers."""

    responses: list[materializer_pb2.MaterializeResponse] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    release_problems: list[str] = field(default_factory=list)
    signal_problems: list[str] = field(default_factory=list)


class Kit:
    """One conformance run against one target. Use as a context manager."""

    def __init__(
        self,
        target: str,
        deployment: str,
        *,
        golden_dir: str | Path | None = None,
        strict_messages: bool = False,
        timeout_s: float = 30.0,
        num_slots: int = 32,
        slot_bytes: int = 256 * 1024,
    ) -> None:
        self.target = target
        self.prefix = f"omni-{deployment}"
        self.golden_dir = Path(golden_dir) if golden_dir is not None else DEFAULT_GOLDEN
        self.strict_messages = strict_messages
        self.timeout_s = timeout_s
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.golden_note = ""
        self.steps_seen = 0
        self.errors_seen = 0
        self._count_lock = threading.Lock()

    def __enter__(self) -> Kit:
        self.channel = open_channel(self.target)
        self.arena = ShmArena(self.prefix, self.num_slots, self.slot_bytes)
        return self

    def __exit__(self, *exc: object) -> None:
        self.channel.close()
        self.arena.close()

    # -- helpers -------------------------------------------------------------------------
    def scenarios(self) -> list[Scenario]:
        if (self.golden_dir / vectors.MANIFEST).exists():
            self.golden_note = f"golden vectors from {self.golden_dir}"
            return vectors.load_golden(self.golden_dir)
        self.golden_note = "golden vectors generated in memory (no manifest found)"
        return vectors.generate()

    def open_request(
        self,
        plans: Sequence[materializer_pb2.StagePlan],
        readiness_ms: int = 5000,
        name: str = "conformance",
    ) -> materializer_pb2.MaterializeRequest:
        return materializer_pb2.MaterializeRequest(
            open=materializer_pb2.MaterializeStreamOpen(
                shm_prefix=self.prefix,
                stages=list(plans),
                readiness_timeout_ms=readiness_ms,
                client_name=name,
            )
        )

    def stream(self, first: materializer_pb2.MaterializeRequest | None) -> Stream:
        return Stream(self.channel, first, deadline_s=max(120.0, 4 * self.timeout_s))

    def _count(self, resp: materializer_pb2.MaterializeResponse) -> None:
        with self._count_lock:
            if resp.WhichOneof("kind") == "step":
                self.steps_seen += 1
            else:
                self.errors_seen += 1

    def recv(
        self, stream: Stream, timeout_s: float | None = None
    ) -> materializer_pb2.MaterializeResponse:
        """The next answer. The kit's streams open without contract_version
        (version 1), so a StreamDraining on them breaks the contract."""
        resp = stream.recv(timeout_s or self.timeout_s)
        if resp.WhichOneof("kind") == "draining":
            raise CheckFailed(
                f"StreamDraining {msg_summary(resp.draining)} sent on a stream whose open did not "
                "set contract_version (version 1 senders never get it)"
            )
        if resp.WhichOneof("kind") is None:
            raise CheckFailed("a MaterializeResponse with none of step, error, draining set")
        self._count(resp)
        return resp

    # -- scenario streams ----------------------------------------------------------------
    def run_scenario(self, sc: Scenario, *, shm: bool) -> StreamRun:
        """Send a whole scenario eagerly (slots taken as gRPC pulls requests) while
        reading answers, as a decoder does; judge each answer."""
        run = StreamRun()
        placed: list[Placed] = []
        open_req = materializer_pb2.MaterializeRequest()
        open_req.CopyFrom(sc.open)
        open_req.open.shm_prefix = self.prefix
        stream = self.stream(open_req)

        def lazily(
            snap: snapshot_pb2.StepSnapshot,
        ) -> Callable[[], materializer_pb2.MaterializeRequest]:
            def make() -> materializer_pb2.MaterializeRequest:
                p = place(self.arena, snap, acquire_timeout_s=self.timeout_s)
                placed.append(p)
                return materializer_pb2.MaterializeRequest(snapshot=p.snapshot)

            return make

        try:
            for snap in sc.snapshots:
                stream.send(
                    lazily(snap) if shm else materializer_pb2.MaterializeRequest(snapshot=snap)
                )
            stream.close_send()
            for i, (snap, want) in enumerate(zip(sc.snapshots, sc.expected, strict=True)):
                try:
                    resp = self.recv(stream)
                except (StreamEnded, NoAnswer, CheckFailed) as exc:
                    run.problems.append(f"answers[{i}] (step {snap.step_id}): {exc}")
                    return run
                run.responses.append(resp)
                self._judge(i, snap, want, resp, placed[i] if shm else None, run)
                if shm:
                    self.arena.release(placed[i].lease.slot, placed[i].lease.generation)
            try:
                end = stream.wait_end(self.timeout_s)
                if end.code != grpc.StatusCode.OK:
                    run.problems.append(f"stream ended with {end} after the last answer")
            except (AssertionError, NoAnswer) as exc:
                run.problems.append(f"after the last answer: {exc}")
        finally:
            if run.problems:
                stream.cancel()
            for p in placed:
                self.arena.release(p.lease.slot, p.lease.generation)
        return run

    def _judge(
        self,
        i: int,
        snap: snapshot_pb2.StepSnapshot,
        want: materializer_pb2.MaterializeResponse,
        resp: materializer_pb2.MaterializeResponse,
        placed: Placed | None,
        run: StreamRun,
    ) -> None:
        where = f"answers[{i}]"
        if resp.WhichOneof("kind") != "step":
            e = resp.error
            run.problems.append(
                f"{where} (step {snap.step_id}): StepError {_code_name(e.code)} for step "
                f"{e.step_id}: {e.message}"
            )
            return
        got = resp.step
        if (got.step_id, got.stage_id) != (snap.step_id, snap.stage_id):
            run.problems.append(
                f"{where}: answered step {got.step_id} stage {got.stage_id}, expected step "
                f"{snap.step_id} stage {snap.stage_id} (answers out of order?)"
            )
            return
        difference = first_difference(want.step, payload_only(got), f"{where}.step")
        if difference is not None:
            run.problems.append(difference)
        releases = [release_key(r) for r in got.released_slots]
        wanted = [placed.release] if placed is not None else []
        if sorted(releases) != sorted(wanted):
            run.release_problems.append(f"{where}: released {releases}, want {wanted}")
        if list(got.connector_signals) != list(snap.connector_output.signals):
            run.signal_problems.append(
                f"{where}: signals {[(s.request_id, s.kind, s.value) for s in got.connector_signals]}, "
                f"want {[(s.request_id, s.kind, s.value) for s in snap.connector_output.signals]}"
            )

    # -- the bad-step matrix ---------------------------------------------------------------
    def run_cases(
        self, cases: Sequence[Case], *, client: str = "conformance/errors"
    ) -> list[CheckResult]:
        """Each case on one long stream, each followed by a good step on the
        same stream and an info call; a stream that dies is reopened."""
        results = []
        stream, step_id = None, 0
        for case in cases:
            t0 = time.monotonic()
            if stream is None:
                stream = self.stream(
                    self.open_request([probe_plan()], ERROR_STREAM_READINESS_MS, client)
                )
                step_id = 0
            try:
                if step_id == 0:
                    # Every bad step follows a good one on its stream, so a case
                    # such as step_id_not_increasing has a previous step to repeat.
                    step_id = 1
                    self._good_step(stream, step_id, "that starts the stream")
                step_id = self._one_case(stream, case, step_id)
                results.append(CheckResult(case.name, True, case.code.name, time.monotonic() - t0))
            except (CheckFailed, StreamEnded, NoAnswer, OmniError) as exc:
                results.append(CheckResult(case.name, False, str(exc), time.monotonic() - t0))
                stream.cancel()
                stream = None
        if stream is not None:
            stream.close_send()
            with contextlib.suppress(AssertionError, NoAnswer):
                stream.wait_end(self.timeout_s)
        return results

    def _one_case(self, stream: Stream, case: Case, last_id: int) -> int:
        bad_id = last_id + 1
        built: Built = case.build(CaseContext(self.arena, bad_id, last_id))
        try:
            stream.send_snapshot(built.snapshot)
            resp = self.recv(stream)
        finally:
            for lease in built.leases:
                self.arena.release(lease.slot, lease.generation)
        _require(
            resp.WhichOneof("kind") == "error",
            f"answer: expected StepError {case.code.name}, got step {msg_summary(resp.step)}",
        )
        err = resp.error
        _require(
            err.code == case.code.value[0],
            f"error.code: expected {case.code.name}, got {_code_name(err.code)} "
            f"(message {err.message!r})",
        )
        _require(
            (err.step_id, err.stage_id) == (built.snapshot.step_id, built.snapshot.stage_id),
            f"error.step_id/stage_id: expected {built.snapshot.step_id}/{built.snapshot.stage_id}, "
            f"got {err.step_id}/{err.stage_id}",
        )
        _require(bool(err.message.strip()), "error.message: expected a reason, got an empty string")
        if self.strict_messages:
            _require(
                case.hint.lower() in err.message.lower(),
                f"error.message: expected it to contain {case.hint!r} (--strict-messages), "
                f"got {err.message!r}",
            )
        got = [release_key(r) for r in err.released_slots]
        named = {(h.region, h.slot, h.generation) for h in _handles(built.snapshot)}
        missing = [k for k in built.must_release if k not in got]
        _require(not missing, f"StepError does not release {missing} (released {got})")
        _require(len(got) == len(set(got)), f"duplicate releases {got}")
        _require(all(k in named for k in got), f"released {got}, not all named by the snapshot")
        # The same stream still works, and so does the service.
        good_id = max(bad_id, built.snapshot.step_id) + 1
        self._good_step(stream, good_id, f"after {case.name}")
        info(self.channel, self.timeout_s)
        return good_id

    def _good_step(
        self, stream: Stream, step_id: int, why: str, *, recv_timeout_s: float | None = None
    ) -> None:
        probe = make_probe(step_id)
        placed = place(self.arena, probe.snapshot, acquire_timeout_s=self.timeout_s)
        try:
            stream.send_snapshot(placed.snapshot)
            resp = self.recv(stream, recv_timeout_s)
        finally:
            self.arena.release(placed.lease.slot, placed.lease.generation)
        if resp.WhichOneof("kind") != "step":
            raise CheckFailed(
                f"good step {why}: expected a step, got StepError {_code_name(resp.error.code)}: "
                f"{resp.error.message}"
            )
        difference = diff_steps(probe.expected, payload_only(resp.step))
        if difference is not None:
            raise CheckFailed(f"good step {why}: {difference}")
        releases = [release_key(r) for r in resp.step.released_slots]
        _require(
            releases == [placed.release],
            f"good step {why}: released {releases}, want {[placed.release]}",
        )

    # -- the checks ------------------------------------------------------------------------
    def check_info(self) -> str:
        r = info(self.channel, self.timeout_s)
        _require(bool(r.implementation), "implementation is empty")
        _require(
            r.contract == vectors.CONTRACT, f"contract {r.contract!r}, want {vectors.CONTRACT!r}"
        )
        _require(
            r.shm_prefix == self.prefix,
            f"shm_prefix {r.shm_prefix!r}, want {self.prefix!r} (--deployment?)",
        )
        _require(
            r.supports_shm and r.supports_inline,
            f"supports_shm={r.supports_shm} supports_inline={r.supports_inline}",
        )
        return f"{r.implementation} {r.version}"

    # -- contract version 2: identity and the arena probe ---------------------------------
    def check_v2_identity(self) -> str:
        """instance_id set and stable, start time plausible and stable, not draining."""
        a = info(self.channel, self.timeout_s)
        b = info(self.channel, self.timeout_s)
        now_ms = time.time() * 1e3
        _require(
            a.contract_version >= 2,
            f"contract_version: expected 2 or more, got {a.contract_version}",
        )
        _require(bool(a.instance_id.strip()), 'instance_id: expected a non-empty id, got ""')
        _require(
            a.instance_id == b.instance_id,
            f"instance_id: expected the same id from two calls to one process, got "
            f"{a.instance_id!r} then {b.instance_id!r}",
        )
        _require(
            EARLIEST_START_MS <= a.start_time_unix_ms <= now_ms + CLOCK_SLACK_MS,
            f"start_time_unix_ms: expected Unix epoch milliseconds between "
            f"{EARLIEST_START_MS} (2020-01-01) and now + {CLOCK_SLACK_MS // 1000} s "
            f"({now_ms + CLOCK_SLACK_MS:.0f}), got {a.start_time_unix_ms}",
        )
        _require(
            a.start_time_unix_ms == b.start_time_unix_ms,
            f"start_time_unix_ms: expected the same value from two calls, got "
            f"{a.start_time_unix_ms} then {b.start_time_unix_ms}",
        )
        _require(
            not a.draining, "draining: expected false (the kit's target is not stopping), got true"
        )
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(a.start_time_unix_ms / 1e3))
        return (
            f"contract_version {a.contract_version}, instance_id {a.instance_id!r}, "
            f"started {started}, supports_drain={str(a.supports_drain).lower()}"
        )

    def check_arena_probe(self, kind: str) -> str:
        """GetMaterializerInfo(arena_probe=...) for one kind of segment (ARENA_PROBES)."""
        supports_shm = info(self.channel, self.timeout_s).supports_shm
        want = ARENA_PROBES[kind][0]
        if kind != "unset" and not supports_shm:
            want = materializer_pb2.ARENA_PROBE_RESULT_UNSUPPORTED
        with _probe_segment(self, kind) as (name, path):
            before = path.read_bytes() if path is not None else None
            got = info(self.channel, self.timeout_s, arena_probe=name).arena_probe
            if path is not None:
                _require(path.exists(), f"the probed segment {name!r} was unlinked by the probe")
                _require(path.read_bytes() == before, f"the probed segment {name!r} was written to")
        _require(
            got == want,
            f"arena_probe for {name!r}: expected {_probe_name(want)}, got {_probe_name(got)}",
        )
        return f"{_probe_name(got)} for {name!r}" if name else _probe_name(got)

    def _expect_refused(self, stream: Stream, code: grpc.StatusCode) -> str:
        try:
            end = stream.wait_end(self.timeout_s)
        except NoAnswer as exc:
            stream.cancel()
            raise CheckFailed(f"call still open: {exc}") from None
        _require(end.code == code, f"call ended with {end}, want {code.name}")
        _require(bool(end.details.strip()), "status without a message")
        return code.name

    def check_open_wrong_prefix(self) -> str:
        req = self.open_request([probe_plan()])
        req.open.shm_prefix = f"{self.prefix}-other"
        return self._expect_refused(self.stream(req), grpc.StatusCode.FAILED_PRECONDITION)

    def check_open_not_first(self) -> str:
        first = materializer_pb2.MaterializeRequest(snapshot=make_probe(1).snapshot)
        return self._expect_refused(self.stream(first), grpc.StatusCode.INVALID_ARGUMENT)

    def check_open_missing(self) -> str:
        stream = self.stream(None)
        stream.close_send()
        return self._expect_refused(stream, grpc.StatusCode.INVALID_ARGUMENT)

    def check_open_twice(self) -> str:
        stream = self.stream(self.open_request([probe_plan()]))
        self._good_step(stream, 1, "before the second open")
        stream.send(self.open_request([probe_plan()]))
        return self._expect_refused(stream, grpc.StatusCode.INVALID_ARGUMENT)

    def check_open_bad_plan(self) -> str:
        plan = probe_plan()
        plan.routes[0].destination = materializer_pb2.PAYLOAD_DESTINATION_UNSPECIFIED
        return self._expect_refused(
            self.stream(self.open_request([plan])), grpc.StatusCode.INVALID_ARGUMENT
        )

    def check_late_readiness(self) -> str:
        """A slot marked ready while the implementation waits is read, not refused."""
        stream = self.stream(self.open_request([probe_plan()], 5000, "conformance/readiness"))
        probe = make_probe(1)
        placed = place(self.arena, probe.snapshot, mark_ready=False)
        timer = threading.Timer(0.15, placed.lease.mark_ready)
        try:
            t0 = time.monotonic()
            stream.send_snapshot(placed.snapshot)
            timer.start()
            resp = self.recv(stream)
            waited = time.monotonic() - t0
        finally:
            timer.cancel()
            self.arena.release(placed.lease.slot, placed.lease.generation)
            stream.close_send()
        with contextlib.suppress(AssertionError, NoAnswer, StreamEnded):
            stream.wait_end(self.timeout_s)
        _require(
            resp.WhichOneof("kind") == "step",
            f"StepError {_code_name(resp.error.code)}: {resp.error.message}",
        )
        difference = diff_steps(probe.expected, payload_only(resp.step))
        _require(difference is None, str(difference))
        return f"answered after {waited * 1e3:.0f} ms"

    def check_cancel_reconnect(self) -> str:
        """Cancel a stream while a step waits on readiness; a new stream works at once."""
        before = info(self.channel, self.timeout_s).active_streams
        stream = self.stream(self.open_request([probe_plan()], 2000, "conformance/cancel"))
        self._good_step(stream, 1, "before cancel")
        stuck = place(self.arena, make_probe(2).snapshot, mark_ready=False)
        queued = place(self.arena, make_probe(3).snapshot)
        stream.send_snapshot(stuck.snapshot)
        stream.send_snapshot(queued.snapshot)
        time.sleep(0.1)
        stream.cancel()
        try:
            t0 = time.monotonic()
            fresh = self.stream(self.open_request([probe_plan()], 2000, "conformance/cancel"))
            for step_id in (1, 2, 3):  # a new stream starts its own step ids
                self._good_step(
                    fresh, step_id, "on the new stream", recv_timeout_s=min(self.timeout_s, 5.0)
                )
            took = time.monotonic() - t0
            fresh.close_send()
            end = fresh.wait_end(self.timeout_s)
            _require(end.code == grpc.StatusCode.OK, f"new stream ended with {end}")
        finally:
            for p in (stuck, queued):
                self.arena.release(p.lease.slot, p.lease.generation)
        now = self._active_streams_settle(before)
        _require(now <= before, f"active_streams {now} after the cancelled stream, want {before}")
        return f"new stream served 3 steps in {took * 1e3:.0f} ms"

    def _active_streams_settle(self, want: int, within_s: float = 5.0) -> int:
        """Poll active_streams until it is at most `want` (streams end asynchronously)."""
        deadline = time.monotonic() + within_s
        while True:
            now = info(self.channel, self.timeout_s).active_streams
            if now <= want or time.monotonic() > deadline:
                return now
            time.sleep(0.05)

    def check_concurrent_isolation(self, scenario: Scenario) -> str:
        """Errors on one stream leave a second, concurrent stream untouched."""
        noisy: list[CheckResult] = []
        picks = [c for c in HANDLE_CASES + STEP_CASES if c.name.split("/")[1] in _NOISY]
        thread = threading.Thread(
            target=lambda: noisy.extend(self.run_cases(picks, client="conformance/noisy"))
        )
        thread.start()
        try:
            run = self.run_scenario(scenario, shm=True)
        finally:
            thread.join(120)
        bad = [r for r in noisy if not r.passed]
        if run.problems or run.release_problems:
            raise CheckFailed(f"clean stream: {(run.problems + run.release_problems)[0]}")
        if bad:
            raise CheckFailed(f"noisy stream: {bad[0].name}: {bad[0].detail}")
        return f"{len(scenario.snapshots)} clean steps next to {len(picks)} failing ones"


EARLIEST_START_MS = 1_577_836_800_000  # 2020-01-01T00:00:00Z
CLOCK_SLACK_MS = 300_000  # a start time up to 5 minutes ahead of the kit's clock is accepted

_R = materializer_pb2
# kind -> (expected result from an implementation with supports_shm, what the kit sends)
ARENA_PROBES: dict[str, tuple[int, str]] = {
    "unset": (_R.ARENA_PROBE_RESULT_UNSPECIFIED, "no arena_probe (empty string)"),
    "mapped": (_R.ARENA_PROBE_RESULT_MAPPED, "the kit's own arena (a live, valid arena)"),
    "not_found": (
        _R.ARENA_PROBE_RESULT_NOT_FOUND,
        "a well-formed name under the prefix that no segment has",
    ),
    "not_an_arena": (
        _R.ARENA_PROBE_RESULT_INVALID,
        "a 4096-byte segment of zeros under the prefix (bad magic)",
    ),
    "short_segment": (
        _R.ARENA_PROBE_RESULT_INVALID,
        "a 32-byte segment under the prefix (smaller than the 64-byte header)",
    ),
    "wrong_version": (
        _R.ARENA_PROBE_RESULT_INVALID,
        "a valid header with version 2 (the arena format is version 1)",
    ),
    "inconsistent_header": (
        _R.ARENA_PROBE_RESULT_INVALID,
        "magic and version right, data_offset + num_slots * slot_bytes past the segment's size",
    ),
    "outside_prefix": (
        _R.ARENA_PROBE_RESULT_INVALID,
        "a valid, live arena under another deployment prefix",
    ),
    "malformed_name": (_R.ARENA_PROBE_RESULT_INVALID, 'the path-like name "../x" (never opened)'),
}
V2_CHECKS = ["v2/identity"] + [f"v2/arena_probe/{k}" for k in ARENA_PROBES]


def _probe_name(value: int) -> str:
    return (
        materializer_pb2.ArenaProbeResult.Name(value)
        if value in materializer_pb2.ArenaProbeResult.values()
        else str(value)
    )


@contextlib.contextmanager
def _probe_segment(kit: Kit, kind: str):
    """(name to probe, path of a segment the kit made for it or None); the
    segment is removed afterwards."""
    nonce = secrets.token_hex(4)
    if kind == "unset":
        yield "", None
        return
    if kind == "mapped":
        yield kit.arena.name, None
        return
    if kind == "malformed_name":
        yield "../x", None
        return
    if kind == "not_found":
        name = f"{kit.prefix}-arena-0-{nonce}"
        _require(not (SHM_DIR / name).exists(), f"{name} exists")
        yield name, None
        return
    if kind == "outside_prefix":
        with ShmArena(f"{kit.prefix}-other", 1, 64) as other:
            yield other.name, None
        return
    if kind == "not_an_arena":
        data = bytes(4096)
    elif kind == "short_segment":
        data = MAGIC + bytes(24)
    elif kind == "wrong_version":
        data = _arena_header(version=VERSION + 1)
    elif kind == "inconsistent_header":
        data = _arena_header(slot_bytes=1 << 20)
    else:
        raise KeyError(kind)
    path = SHM_DIR / f"{kit.prefix}-arena-0-probe{nonce}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    try:
        yield path.name, path
    finally:
        path.unlink(missing_ok=True)


def _arena_header(*, version: int = VERSION, slot_bytes: int = 64) -> bytes:
    """A 4096-byte segment with an arena header for 2 slots (and no owner record)."""
    num_slots = 2
    data_offset = HEADER_BYTES + ENTRY_BYTES * num_slots
    buf = bytearray(4096)
    HEADER.pack_into(buf, 0, MAGIC, version, num_slots, slot_bytes, data_offset)
    return bytes(buf)


_NOISY = {
    "region_unknown",
    "stale_generation",
    "readiness_never_marked",
    "offset_u64_max",
    "undeclared_stage",
}


def _handles(snap: snapshot_pb2.StepSnapshot) -> list[tensor_pb2.ShmHandle]:
    return [r.shm for r in tensor_refs(snap) if r.WhichOneof("data") == "shm"]


def _timed(name: str, fn: Callable[[], str]) -> CheckResult:
    t0 = time.monotonic()
    try:
        detail = fn()
        return CheckResult(name, True, detail or "", time.monotonic() - t0)
    except (CheckFailed, StreamEnded, NoAnswer, OmniError, vectors.GoldenError) as exc:
        return CheckResult(name, False, str(exc), time.monotonic() - t0)
    except OSError as exc:  # the kit could not make a segment it needs, for example
        return CheckResult(name, False, f"kit: {exc}", time.monotonic() - t0)
    except grpc.RpcError as exc:
        return CheckResult(
            name, False, f"rpc failed: {exc.code()}: {exc.details()}", time.monotonic() - t0
        )


def check_names(scenario_names: Sequence[str] | None = None) -> list[str]:
    """The names of every check, in run order."""
    names = [n for n in (scenario_names or [f().name for f in vectors.SCENARIOS])]
    out = ["info", *V2_CHECKS] + [
        f"open/{k}" for k in ("wrong_prefix", "not_first", "missing", "twice", "bad_plan")
    ]
    out += ["golden/load"] + [f"golden/{mode}/{n}" for mode in ("inline", "shm") for n in names]
    out += ["golden/connector_signals", "golden/slot_releases"]
    out += [c.name for c in ALL_CASES]
    out += [
        "readiness/late_mark",
        "stream/cancel_then_reconnect",
        "stream/concurrent_isolation",
        "info/counters",
    ]
    return out


def run_conformance(
    target: str,
    deployment: str,
    *,
    golden_dir: str | Path | None = None,
    strict_messages: bool = False,
    timeout_s: float = 30.0,
    only: Sequence[str] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Run the kit against `target`; return one result per check.

    `only` keeps the checks whose name starts with one of its prefixes.
    `on_result` is called as each result is known (the CLI prints them).
    """
    results: list[CheckResult] = []

    def wanted(name: str) -> bool:
        return not only or any(name.startswith(p) for p in only)

    def add(result: CheckResult) -> None:
        results.append(result)
        if on_result is not None:
            on_result(result)

    with Kit(
        target,
        deployment,
        golden_dir=golden_dir,
        strict_messages=strict_messages,
        timeout_s=timeout_s,
    ) as kit:
        first = _timed("info", kit.check_info)
        add(first)
        if not first.passed:
            return results  # nothing else can work against this target
        baseline = info(kit.channel, timeout_s)
        seen0 = (kit.steps_seen, kit.errors_seen)

        contract_version = baseline.contract_version or 1
        v2 = [("v2/identity", kit.check_v2_identity)] + [
            (f"v2/arena_probe/{k}", lambda k=k: kit.check_arena_probe(k)) for k in ARENA_PROBES
        ]
        for name, fn in v2:
            if not wanted(name):
                continue
            if contract_version < 2:
                add(CheckResult(name, True, SKIPPED_V1, skipped=True))
            else:
                add(_timed(name, fn))

        for name, fn in (
            ("open/wrong_prefix", kit.check_open_wrong_prefix),
            ("open/not_first", kit.check_open_not_first),
            ("open/missing", kit.check_open_missing),
            ("open/twice", kit.check_open_twice),
            ("open/bad_plan", kit.check_open_bad_plan),
        ):
            if wanted(name):
                add(_timed(name, fn))

        scenarios: list[Scenario] = []
        needs_vectors = [
            n
            for n in check_names()
            if n.startswith("golden/") or n == "stream/concurrent_isolation"
        ]
        if any(wanted(n) for n in needs_vectors):
            t0 = time.monotonic()
            try:
                scenarios = kit.scenarios()
                add(
                    CheckResult(
                        "golden/load",
                        True,
                        f"{len(scenarios)} scenarios, {kit.golden_note}",
                        time.monotonic() - t0,
                    )
                )
            except vectors.GoldenError as exc:
                add(CheckResult("golden/load", False, str(exc), time.monotonic() - t0))
        signal_problems: list[str] = []
        release_problems: list[str] = []
        golden_steps = 0
        for mode in ("inline", "shm"):
            for sc in scenarios:
                name = f"golden/{mode}/{sc.name}"
                if not wanted(name):
                    continue
                t0 = time.monotonic()
                run = kit.run_scenario(sc, shm=mode == "shm")
                golden_steps += len(run.responses)
                signal_problems += run.signal_problems
                release_problems += [f"{sc.name} {p}" for p in run.release_problems]
                ok = not run.problems
                detail = (
                    f"{len(run.responses)}/{len(sc.snapshots)} steps equivalent to the golden answers"
                    if ok
                    else run.problems[0]
                )
                if len(run.problems) > 1:
                    detail += f" (+{len(run.problems) - 1} more)"
                add(CheckResult(name, ok, detail, time.monotonic() - t0))
        if wanted("golden/connector_signals") and golden_steps:
            add(
                CheckResult(
                    "golden/connector_signals",
                    not signal_problems,
                    signal_problems[0]
                    if signal_problems
                    else f"{golden_steps} answers carry exactly their step's signals",
                )
            )
        if wanted("golden/slot_releases") and golden_steps:
            add(
                CheckResult(
                    "golden/slot_releases",
                    not release_problems,
                    release_problems[0]
                    if release_problems
                    else "every answer releases exactly its snapshot's slots",
                )
            )

        cases = [c for c in ALL_CASES if wanted(c.name)]
        for result in kit.run_cases(cases):
            add(result)

        if wanted("readiness/late_mark"):
            add(_timed("readiness/late_mark", kit.check_late_readiness))
        if wanted("stream/cancel_then_reconnect"):
            add(_timed("stream/cancel_then_reconnect", kit.check_cancel_reconnect))
        if wanted("stream/concurrent_isolation") and scenarios:
            busiest = max(scenarios, key=lambda s: len(s.snapshots))
            add(
                _timed(
                    "stream/concurrent_isolation", lambda: kit.check_concurrent_isolation(busiest)
                )
            )

        if wanted("info/counters"):

            def counters() -> str:
                now = info(kit.channel, timeout_s)
                ok_steps = kit.steps_seen - seen0[0]
                failed = kit.errors_seen - seen0[1]
                d_ok = now.steps_materialized - baseline.steps_materialized
                d_failed = now.steps_failed - baseline.steps_failed
                _require(
                    d_ok >= ok_steps,
                    f"steps_materialized grew by {d_ok}, the kit received {ok_steps} steps",
                )
                _require(
                    d_failed >= failed,
                    f"steps_failed grew by {d_failed}, the kit received {failed} errors",
                )
                active = kit._active_streams_settle(baseline.active_streams)
                _require(
                    active <= baseline.active_streams,
                    f"active_streams {active}, want {baseline.active_streams}",
                )
                return f"+{d_ok} materialized, +{d_failed} failed, {active} streams open"

            add(_timed("info/counters", counters))
    return results


def summary(results: Sequence[CheckResult]) -> str:
    failed = [r for r in results if not r.passed]
    skipped = [r for r in results if r.skipped]
    passed = len(results) - len(failed) - len(skipped)
    return f"conformance: {passed} passed, {len(failed)} failed, {len(skipped)} skipped"
