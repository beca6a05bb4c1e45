"""The checks: drive an implementation over the wire and judge every answer.

`run_conformance` is the entry point for code (pytest included); the CLI
prints its results. Every check is independent: a failure is reported and
the next check starts on a fresh stream.
"""

from __future__ import annotations

import contextlib
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
from materializer_svc.conformance.vectors import Scenario, canonical
from omni_common.errors import OmniError
from omni_common.shm_arena import ShmArena
from omni_serving.v1 import materializer_pb2, snapshot_pb2, tensor_pb2

DEFAULT_GOLDEN = Path(__file__).resolve().parent / "golden"
ERROR_STREAM_READINESS_MS = 300


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        status = "PASS" if self.passed else "FAIL"
        tail = f"  {self.detail}" if self.detail else ""
        return f"{status}  {self.name:<44} {self.seconds:6.2f}s{tail}"


class CheckFailed(AssertionError):
    pass


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise CheckFailed(message)


def _code_name(code: int) -> str:
    for c in grpc.StatusCode:
        if c.value[0] == code:
            return c.name
    return str(code)


def diff_steps(
    want: materializer_pb2.MaterializedStep, got: materializer_pb2.MaterializedStep
) -> str:
    """Where two materialized steps first differ, in words."""
    if (got.step_id, got.stage_id) != (want.step_id, want.stage_id):
        return f"step/stage {got.step_id}/{got.stage_id}, want {want.step_id}/{want.stage_id}"
    if [r.request_id for r in got.requests] != [r.request_id for r in want.requests]:
        return f"requests {[r.request_id for r in got.requests]}, want {[r.request_id for r in want.requests]}"
    for w, g in zip(want.requests, got.requests, strict=True):
        if w.finished != g.finished:
            return f"request {w.request_id}: finished={g.finished}, want {w.finished}"
        for dest in ("inter_stage", "client"):
            wp, gp = getattr(w, dest), getattr(g, dest)
            wk, gk = [t.name for t in wp.tensors], [t.name for t in gp.tensors]
            if wk != gk:
                return f"request {w.request_id} {dest}: keys {gk}, want {wk}"
            for wt, gt in zip(wp.tensors, gp.tensors, strict=True):
                a, b = wt.tensor, gt.tensor
                if (a.dtype, list(a.shape)) != (b.dtype, list(b.shape)):
                    return (
                        f"request {w.request_id} {dest}[{wt.name}]: dtype {b.dtype} shape {list(b.shape)}, "
                        f"want dtype {a.dtype} shape {list(a.shape)}"
                    )
                if canonical(a) != canonical(b):
                    return f"request {w.request_id} {dest}[{wt.name}]: tensor bytes differ"
            if canonical(wp) != canonical(gp):
                return f"request {w.request_id} {dest}: metadata differs"
    if canonical(_signals(want)) != canonical(_signals(got)):
        return (
            f"connector_signals {list(got.connector_signals)}, want {list(want.connector_signals)}"
        )
    return "serialized bytes differ"


def _signals(step: materializer_pb2.MaterializedStep) -> materializer_pb2.MaterializedStep:
    return materializer_pb2.MaterializedStep(connector_signals=step.connector_signals)


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
        resp = stream.recv(timeout_s or self.timeout_s)
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
                except (StreamEnded, NoAnswer) as exc:
                    run.problems.append(f"answer {i} (step {snap.step_id}): {exc}")
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
        where = f"answer {i} (step {snap.step_id})"
        if resp.WhichOneof("kind") != "step":
            e = resp.error
            run.problems.append(
                f"{where}: StepError {_code_name(e.code)} for step {e.step_id}: {e.message}"
            )
            return
        got = resp.step
        if (got.step_id, got.stage_id) != (snap.step_id, snap.stage_id):
            run.problems.append(
                f"{where}: answered step {got.step_id} stage {got.stage_id} (out of order)"
            )
            return
        if canonical(payload_only(got)) != canonical(want.step):
            run.problems.append(f"{where}: {diff_steps(want.step, payload_only(got))}")
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
            resp.WhichOneof("kind") == "error", f"answered a step, want StepError {case.code.name}"
        )
        err = resp.error
        _require(
            err.code == case.code.value[0],
            f"StepError {_code_name(err.code)} ({err.message!r}), want {case.code.name}",
        )
        _require(
            (err.step_id, err.stage_id) == (built.snapshot.step_id, built.snapshot.stage_id),
            f"StepError for step {err.step_id} stage {err.stage_id}, want {built.snapshot.step_id}",
        )
        _require(bool(err.message.strip()), "StepError without a message")
        if self.strict_messages:
            _require(
                case.hint.lower() in err.message.lower(),
                f"message {err.message!r} lacks {case.hint!r}",
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
                f"good step {why}: StepError {_code_name(resp.error.code)}: {resp.error.message}"
            )
        got = payload_only(resp.step)
        if canonical(got) != canonical(probe.expected):
            raise CheckFailed(f"good step {why}: {diff_steps(probe.expected, got)}")
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
        _require(canonical(payload_only(resp.step)) == canonical(probe.expected), "payload differs")
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
    except grpc.RpcError as exc:
        return CheckResult(
            name, False, f"rpc failed: {exc.code()}: {exc.details()}", time.monotonic() - t0
        )


def check_names(scenario_names: Sequence[str] | None = None) -> list[str]:
    """The names of every check, in run order."""
    names = [n for n in (scenario_names or [f().name for f in vectors.SCENARIOS])]
    out = ["info"] + [
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
                    f"{len(run.responses)}/{len(sc.snapshots)} steps byte-identical"
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
    return f"conformance: {len(results) - len(failed)} passed, {len(failed)} failed"
