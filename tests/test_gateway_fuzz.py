"""Property-based fuzzing of the gateway and the materializer (hypothesis).

Gateway: random and mutated `Speak` and `Generate` requests against a real
stack in processes, all on Unix sockets: materializer, fake-engine decoder,
gateway. Requests are built field by field (huge, unicode and control-char
strings, NaN/inf/out-of-range sampling parameters, unknown enum values,
random voices), or sent as raw bytes through a generic channel call
(random bytes, or a valid request's bytes flipped, cut and spliced). An
oracle that knows the gateway's documented checks says which fields of a
request are invalid; every answer must be:

* OK only for a request the oracle finds valid, with a well-formed stream;
* INVALID_ARGUMENT naming a field the oracle finds invalid (or, for bytes
  that do not parse, ``request: ...``);
* RESOURCE_EXHAUSTED only for the documented response cap (``output_kind``)
  or the request size limit; ALREADY_EXISTS only for a reused request id;
* never INTERNAL, UNKNOWN, UNAVAILABLE or DEADLINE_EXCEEDED (no hang: every
  call has a deadline); status messages at most 512 characters, one line,
  without socket paths or Python class names.

Materializer: random and mutated `StepSnapshot`s (inline or in a real
shared-memory arena) on one long `Materialize` stream to a real materializer
process: every step is answered in-band, never with INTERNAL or UNKNOWN, and
a good probe step placed every 50 examples is answered exactly.

At the end each service must still be running, SERVING, and serving a
normal request correctly (the same bytes as before the fuzzing).

Also: 1,000 random and mutated JSON bodies to the HTTP facade (never a
500, always OpenAI's error shape).

Counts: 10,000 gateway requests (in batches of 1,000) and 10,000 snapshots
(about 150 s and 40 s on two busy cores). With CI=true the gateway requests
stop early if the next batch would take them past 25 s (at least 1,000 calls), and the materializer
gets 1,500 snapshots;
``OMNI_SOAK_FULL=1`` runs the full count there too (``test_fuzz_gateway_requests_soak``,
marked ``soak``). OMNI_FUZZ_EXAMPLES=N sets every
count (a quick local run).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from fakes import remove_dir, short_socket_dir
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from materializer_svc.conformance.cases import make_probe, probe_plan
from materializer_svc.conformance.checks import payload_only
from materializer_svc.conformance.client import NoAnswer, Stream, StreamEnded, place
from omni_common import shm_arena
from omni_common.modality import OutputModality, UnknownModalityError
from omni_common.server import wait_for_health_sync
from omni_common.shm_arena import ShmArena
from omni_serving.v1 import (
    common_pb2,
    decoder_pb2,
    decoder_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    materializer_pb2,
    snapshot_pb2,
    tensor_pb2,
)

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
CI = os.environ.get("CI", "").lower() == "true"
FULL_REQUESTS = 10_000
FULL_SNAPSHOTS = 10_000
HTTP_REQUESTS = 1_000
BATCH = 1_000
CI_BUDGET_S = 25.0
"""Under CI=true the gateway requests stop before a batch would take the run past this."""
CI_SNAPSHOTS = 1_500
"""Under CI=true (without OMNI_SOAK_FULL=1) the materializer gets this many snapshots."""
SOAK_FULL = os.environ.get("OMNI_SOAK_FULL") == "1"
_OVERRIDE = int(os.environ.get("OMNI_FUZZ_EXAMPLES", "0"))


def examples(full: int) -> int:
    return _OVERRIDE or full


# The fuzzed gateway's limits: short texts keep a valid request fast with the
# fake engine (about 2.5 ms of audio work per UTF-8 byte); a small response
# cap makes CUMULATIVE outputs reach it often.
MAX_TEXT_CHARS = 48
MAX_RESPONSE_BYTES = 256 * 1024
CALL_DEADLINE_S = 30.0
MAX_DETAILS = 512
GATEWAY = "/omni_serving.v1.OmniGatewayService"
NATIVE_RATE = 24000

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_LEAKS = re.compile(r"unix:|\.sock|<class|Traceback|/tmp/|object at 0x|site-packages")


# ---------------------------------------------------------------------------
# Processes.


class Proc:
    """A service process in its own session; stopped by its own pid."""

    def __init__(self, argv: list[str], log: Path, *, stdout: bool = False) -> None:
        self.log = log
        self._log_file = log.open("wb")
        self.proc = subprocess.Popen(
            argv,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(log.parent)},
            cwd=REPO,
            stdout=subprocess.PIPE if stdout else self._log_file,
            stderr=self._log_file,
            start_new_session=True,
            text=True,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(10)
        self._log_file.close()
        return self.proc.returncode


def healthy(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return response.status == health_pb2.HealthCheckResponse.SERVING


@dataclass
class FuzzStack:
    directory: Path
    deployment: str
    gateway: str
    decoder: str
    voices: tuple[str, ...]
    http_port: int
    procs: dict[str, Proc] = field(default_factory=dict)


@pytest.fixture(scope="module")
def stack() -> Iterator[FuzzStack]:
    directory = short_socket_dir()
    deployment = f"fuzz{os.getpid()}"
    mat, dec, gw = (f"unix://{directory / n}.sock" for n in ("mat", "dec", "gw"))
    py = sys.executable
    common = ["--deployment", deployment, "--log-level", "WARNING"]
    procs: dict[str, Proc] = {}
    try:
        procs["materializer"] = Proc(
            [py, "-m", "materializer_svc", "--listen", mat, *common], directory / "mat.log"
        )
        wait_for_health_sync(mat, 120)
        procs["decoder"] = Proc(
            [py, "-m", "decoder_svc", "--listen", dec, "--engine", "fake", "--profile", "tts",
             "--materializer", mat, *common],
            directory / "dec.log",
        )  # fmt: skip
        wait_for_health_sync(dec, 120)
        procs["gateway"] = Proc(
            [py, "-m", "gateway", "--listen", gw, "--decoder", dec,
             "--max-text-chars", str(MAX_TEXT_CHARS),
             "--max-response-bytes", str(MAX_RESPONSE_BYTES), "--http-port", "0",
             "--log-level", "WARNING"],
            directory / "gw.log",
        )  # fmt: skip
        wait_for_health_sync(gw, 60)
        with grpc.insecure_channel(dec) as channel:
            info = decoder_pb2_grpc.DecoderServiceStub(channel).GetDecoderInfo(
                decoder_pb2.GetDecoderInfoRequest(), timeout=10
            )
        http_port = 0
        for _ in range(500):  # the "listening" line follows health by a moment
            found = re.search(r"HTTP on port (\d+)", (directory / "gw.log").read_text())
            if found:
                http_port = int(found.group(1))
                break
            time.sleep(0.02)
        assert http_port, "the gateway did not print its HTTP port"
        yield FuzzStack(directory, deployment, gw, dec, tuple(info.voices), http_port, procs)
    finally:
        for name in ("gateway", "decoder", "materializer"):
            if name in procs:
                procs[name].stop()
        shm_arena.sweep_stale(f"omni-{deployment}")
        remove_dir(directory)


# ---------------------------------------------------------------------------
# Strategies: gateway requests.

_SPECIAL_FLOATS = [0.0, -0.0, 1.0, 2.0, 2.0000002, 1e-45, 3.4e38, -1.0, 0.5, 1.5]
_NONFINITE = [math.nan, math.inf, -math.inf]


def floats32() -> st.SearchStrategy[float]:
    return st.one_of(
        st.floats(0.0, 2.0, width=32),
        st.sampled_from(_SPECIAL_FLOATS + _NONFINITE),
        st.floats(width=32, allow_nan=True, allow_infinity=True),
    )


def strings(max_size: int = 80) -> st.SearchStrategy[str]:
    """Unicode text (control characters, RTL marks, astral planes) and huge repeats."""
    huge = st.builds(lambda c, n: c * n, st.characters(), st.integers(MAX_TEXT_CHARS, 20_000))
    return st.one_of(
        st.text(max_size=max_size),
        st.text(st.characters(codec="ascii"), max_size=max_size),
        st.sampled_from(["", " ", "\t\n\u3000", "\x00", "hello there", "\u202eevil"]),
        huge,
    )


def sampling_params() -> st.SearchStrategy[common_pb2.SamplingParams | None]:
    @st.composite
    def build(draw: st.DrawFn) -> common_pb2.SamplingParams:
        out = common_pb2.SamplingParams(
            max_tokens=draw(st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1))),
            temperature=draw(floats32()),
            top_p=draw(floats32()),
            top_k=draw(st.one_of(st.integers(-2, 50), st.integers(-(2**31), 2**31 - 1))),
            first_chunk_frames=draw(st.one_of(st.just(0), st.integers(0, 30), st.integers(0, 2**32 - 1))),
        )
        seed = draw(st.one_of(st.none(), st.integers(0, 1000), st.integers(0, 2**64 - 1)))
        if seed is not None:
            out.seed = seed
        return out

    return st.one_of(st.none(), build())


def voices(known: tuple[str, ...]) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(("", *known)), strings(200))


def request_ids() -> st.SearchStrategy[str]:
    return st.one_of(st.just(""), st.text(max_size=40), strings(300))


def enums(valid: list[int]) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(valid), st.integers(-(2**31), 2**31 - 1))


_MODALITIES = ["", "audio", "speech", "text", "text+audio", "text,speech", "image", "latent",
               "text+", "smell", "AUDIO ", "audio+image+text+latent"]  # fmt: skip


def valid_texts() -> st.SearchStrategy[str]:
    return st.text(min_size=1, max_size=MAX_TEXT_CHARS).filter(str.strip)


def valid_sampling_params() -> st.SearchStrategy[common_pb2.SamplingParams | None]:
    @st.composite
    def build(draw: st.DrawFn) -> common_pb2.SamplingParams:
        out = common_pb2.SamplingParams(
            max_tokens=draw(st.integers(0, 40)),
            temperature=draw(st.floats(0.0, 2.0, width=32)),
            top_p=draw(st.floats(0.0, 1.0, width=32)),
            top_k=draw(st.integers(0, 100)),
            first_chunk_frames=draw(st.integers(0, 25)),
        )
        seed = draw(st.one_of(st.none(), st.integers(0, 2**63 - 1)))
        if seed is not None:
            out.seed = seed
        return out

    return st.one_of(st.none(), build())


def _apply(request: object, name: str, value: object) -> None:
    if name == "sampling_params":
        request.ClearField("sampling_params")
        if value is not None:
            request.sampling_params.CopyFrom(value)
    elif name == "messages":  # a conversation (drawn with or without the prompt)
        del request.messages[:]
        request.messages.extend(value)
    else:
        setattr(request, name, value)


def conversations() -> st.SearchStrategy[list]:
    """Any turns: roles valid or not, parts with text or empty, any number."""
    part = st.one_of(strings().map(lambda t: common_pb2.ContentPart(text=t)), st.just(common_pb2.ContentPart()))
    turn = st.builds(lambda role, parts: common_pb2.ChatMessage(role=role, content=parts),
                     st.one_of(st.sampled_from(["system", "user", "assistant"]), strings(20)),
                     st.lists(part, max_size=3))
    return st.lists(turn, max_size=5)


@st.composite
def speak_requests(draw: st.DrawFn, known: tuple[str, ...]) -> gateway_pb2.SpeakRequest:
    """A valid request with 0 to 3 of its fields replaced by anything."""
    request = gateway_pb2.SpeakRequest(
        request_id=draw(st.one_of(st.just(""), st.uuids().map(str))),
        text=draw(valid_texts()),
        voice=draw(st.sampled_from(("", *known))),
        sample_rate_hz=draw(st.sampled_from([0, NATIVE_RATE])),
        encoding=draw(st.sampled_from([0, 1])),
    )
    _apply(request, "sampling_params", draw(valid_sampling_params()))
    wild = {
        "request_id": request_ids(),
        "text": strings(),
        "voice": voices(known),
        "sample_rate_hz": st.integers(0, 2**32 - 1),
        "encoding": enums([0, 1]),
        "sampling_params": sampling_params(),
    }
    for name in draw(_corrupted(list(wild))):
        _apply(request, name, draw(wild[name]))
    return request


@st.composite
def generate_requests(
    draw: st.DrawFn, known: tuple[str, ...]
) -> gateway_pb2.OmniGatewayServiceGenerateRequest:
    """A valid request with 0 to 3 of its fields replaced by anything."""
    request = gateway_pb2.OmniGatewayServiceGenerateRequest(
        request_id=draw(st.one_of(st.just(""), st.uuids().map(str))),
        prompt=draw(valid_texts()),
        output_modalities=draw(st.sampled_from(["", "audio", "speech", "text+audio", "AUDIO "])),
        output_kind=draw(st.sampled_from([0, 1, 2, 3])),
        voice=draw(st.sampled_from(("", *known))),
    )
    _apply(request, "sampling_params", draw(valid_sampling_params()))
    wild = {
        "request_id": request_ids(),
        "prompt": strings(),
        "output_modalities": st.one_of(st.sampled_from(_MODALITIES), strings(100)),
        "output_kind": enums([0, 1, 2, 3]),
        "voice": voices(known),
        "sampling_params": sampling_params(),
        "messages": conversations(),
    }
    for name in draw(_corrupted(list(wild))):
        _apply(request, name, draw(wild[name]))
    return request


def _corrupted(names: list[str]) -> st.SearchStrategy[list[str]]:
    """Which fields to replace: none in about a third of the requests."""
    return st.sampled_from([0, 0, 1, 1, 2, 3]).flatmap(
        lambda n: st.lists(st.sampled_from(names), min_size=n, max_size=n, unique=True)
    )


@st.composite
def mutated_bytes(draw: st.DrawFn, valid: bytes) -> bytes:
    """`valid` with a few bytes flipped, cut, inserted or duplicated."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "dup", "truncate"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= draw(st.integers(1, 255))
        elif op == "cut" and data:
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "dup" and data:
            data[pos:pos] = data[pos : pos + draw(st.integers(1, 16))]
        elif op == "truncate":
            del data[pos:]
    return bytes(data)


@dataclass
class Call:
    method: str  # "Speak" or "Generate"
    request: object  # a request message, or bytes
    cancel_after: int | None = None


@st.composite
def calls(draw: st.DrawFn, known: tuple[str, ...]) -> Call:
    method = draw(st.sampled_from(["Speak", "Generate"]))
    structured = speak_requests(known) if method == "Speak" else generate_requests(known)
    form = draw(st.sampled_from(["fields", "fields", "mutated", "random", "huge"]))
    if form == "fields":
        request: object = draw(structured)
    elif form == "mutated":
        request = draw(mutated_bytes(draw(structured).SerializeToString()))
    elif form == "random":
        request = draw(st.binary(max_size=300))
    else:  # over the gateway's 1 MiB request limit, or just under it
        request = draw(st.sampled_from([b"\x0a", b"\x12", b"\xff"])) * draw(
            st.sampled_from([2**20 + 100, 200_000])
        )
    cancel_after = draw(st.sampled_from([None] * 8 + [1, 2]))
    return Call(method, request, cancel_after)


# ---------------------------------------------------------------------------
# The oracle: which fields of a request break the gateway's documented checks.


def _bad_float(value: float, low: float, high: float) -> bool:
    return not (math.isfinite(value) and low <= value <= high)


def invalid_fields(request: object, known: tuple[str, ...]) -> set[str]:
    bad: set[str] = set()
    rid = request.request_id
    if rid and (len(rid) > 128 or not rid.isprintable()):
        bad.add("request_id")
    text_field = "text" if isinstance(request, gateway_pb2.SpeakRequest) else "prompt"
    text = getattr(request, text_field)
    conversation = not isinstance(request, gateway_pb2.SpeakRequest) and len(request.messages) > 0
    if conversation:
        # the fuzzed deployment (tts) has no text stage: every conversation is refused, naming
        # whichever of its fields is checked first
        bad.add("messages")
        for i, turn in enumerate(request.messages):
            bad |= {f"messages[{i}].role", f"messages[{i}].content"}
            bad |= {f"messages[{i}].content[{j}]" for j in range(len(turn.content))}
    if len(text) > MAX_TEXT_CHARS or (not text.strip() and not conversation):
        bad.add(text_field)
    if request.voice and request.voice not in known:
        bad.add("voice")
    if request.HasField("sampling_params"):
        sp = request.sampling_params
        if _bad_float(sp.temperature, 0.0, 2.0):
            bad.add("sampling_params.temperature")
        if _bad_float(sp.top_p, 0.0, 1.0):
            bad.add("sampling_params.top_p")
        if sp.top_k < 0:
            bad.add("sampling_params.top_k")
        if sp.HasField("seed") and sp.seed >= 2**63:
            bad.add("sampling_params.seed")
        # the fake-engine deployment's maximum is 300 s
        if _bad_float(sp.max_audio_seconds, 0.0, 300.0):
            bad.add("sampling_params.max_audio_seconds")
        # the tts profile's chunk of 25 frames (a deployment without audio is refused for the modality)
        if sp.first_chunk_frames > 25:
            bad.add("sampling_params.first_chunk_frames")
    # the tts deployment takes no instructions (blank ones are none)
    if request.instructions.strip() or len(request.instructions) > MAX_TEXT_CHARS:
        bad.add("instructions")
    if isinstance(request, gateway_pb2.SpeakRequest):
        if request.sample_rate_hz not in (0, NATIVE_RATE):
            bad.add("sample_rate_hz")
        if request.encoding not in (0, 1):
            bad.add("encoding")
    else:
        modalities = request.output_modalities
        try:
            if len(modalities) > 64 or (
                OutputModality.from_string(modalities or "audio") != OutputModality.AUDIO
            ):
                bad.add("output_modalities")  # the tts deployment produces audio only
        except UnknownModalityError:
            bad.add("output_modalities")
        if request.output_kind not in (0, 1, 2, 3):
            bad.add("output_kind")
    return bad


# ---------------------------------------------------------------------------
# Running one call and judging it.


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: list = field(default_factory=list)
    cancelled: bool = False


def run_call(channel: grpc.Channel, call: Call) -> Outcome:
    response_type = (
        gateway_pb2.SpeakResponse
        if call.method == "Speak"
        else gateway_pb2.OmniGatewayServiceGenerateResponse
    )
    raw = isinstance(call.request, bytes)
    method = channel.unary_stream(
        f"{GATEWAY}/{call.method}",
        request_serializer=None if raw else type(call.request).SerializeToString,
        response_deserializer=response_type.FromString,
    )
    stream = method(call.request, timeout=CALL_DEADLINE_S)
    responses = []
    try:
        for response in stream:
            responses.append(response)
            if call.cancel_after is not None and len(responses) >= call.cancel_after:
                stream.cancel()
                return Outcome(grpc.StatusCode.CANCELLED, "", responses, cancelled=True)
    except grpc.RpcError as exc:
        return Outcome(exc.code(), exc.details() or "", responses)
    return Outcome(grpc.StatusCode.OK, "", responses)


def parsed(call: Call) -> object | None:
    """The request the gateway sees, or None when its bytes do not parse."""
    if not isinstance(call.request, bytes):
        return call.request
    cls = gateway_pb2.SpeakRequest if call.method == "Speak" else None
    cls = cls or gateway_pb2.OmniGatewayServiceGenerateRequest
    try:
        return cls.FromString(call.request)
    except Exception:  # noqa: BLE001  any parse failure: the gateway must say INVALID_ARGUMENT
        return None


def check_stream(call: Call, outcome: Outcome) -> None:
    if call.method == "Speak":
        chunks = outcome.responses
        assert [c.sequence_number for c in chunks] == list(range(len(chunks)))
        assert all(c.sample_rate_hz == NATIVE_RATE and c.encoding == 1 for c in chunks)
        if not outcome.cancelled:
            assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
            assert len({c.request_id for c in chunks}) == 1
    elif not outcome.cancelled:
        assert outcome.responses and outcome.responses[-1].output.finished
        assert all(not r.output.finished for r in outcome.responses[:-1])
    assert all(r.ByteSize() <= MAX_RESPONSE_BYTES for r in outcome.responses)


def judge(call: Call, outcome: Outcome, known: tuple[str, ...]) -> str:
    """Assert the outcome is right for the call; return its label for the tally."""
    code, details = outcome.code, outcome.details
    assert code not in (
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.UNIMPLEMENTED,
    ), f"{code.name}: {details!r}"
    assert len(details) <= MAX_DETAILS, f"{len(details)} characters"
    assert not _CONTROL.search(details), f"control character in {details!r}"
    assert not _LEAKS.search(details), f"internals in {details!r}"
    assert "larger than max" not in details or "Sent message" not in details
    request = parsed(call)
    if request is None:
        assert code is grpc.StatusCode.INVALID_ARGUMENT or (
            code is grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details
        ), f"unparseable bytes: {code.name}: {details!r}"
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            assert details.startswith(f"request: not a valid {call.method} request message")
        return f"{code.name} (unparseable)"
    bad = invalid_fields(request, known)
    if code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
        assert outcome.cancelled or code is grpc.StatusCode.OK
        assert not bad, f"accepted a request with invalid {sorted(bad)}: {request!r:.300}"
        check_stream(call, outcome)
        return "CANCELLED (by client)" if outcome.cancelled else "OK"
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        if details.startswith("decoder: INVALID_ARGUMENT: "):
            return "INVALID_ARGUMENT (decoder)"
        field_name = details.split(":", 1)[0]
        assert field_name in bad, f"refused {field_name!r}, but the invalid fields are {bad}"
        return f"INVALID_ARGUMENT {field_name}"
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        assert details.startswith("output_kind: ") or "larger than max" in details, details
        if details.startswith("output_kind: "):
            assert not bad and request.output_kind in (2, 3), details
        return "RESOURCE_EXHAUSTED " + ("output cap" if "output_kind" in details else "size")
    if code is grpc.StatusCode.ALREADY_EXISTS:
        assert request.request_id, details  # only a client's own id can clash
        return "ALREADY_EXISTS"
    raise AssertionError(f"unexpected {code.name}: {details!r}")


def reference_speak(target: str) -> bytes:
    with grpc.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.OmniGatewayServiceStub(channel)
        request = gateway_pb2.SpeakRequest(
            request_id="ref", text="the reference request", voice="", sample_rate_hz=0
        )
        request.sampling_params.seed = 7
        chunks = list(stub.Speak(request, timeout=60))
    assert chunks[-1].final and chunks[0].request_id == "ref"
    return b"".join(c.audio for c in chunks)


def fuzz_gateway(stack: FuzzStack, examples: int, *, budget_s: float | None = None) -> None:
    """`examples` calls in batches; with a budget, stop before a batch would overrun it."""
    reference = reference_speak(stack.gateway)
    assert reference
    tally: Counter[str] = Counter()
    channel = grpc.insecure_channel(stack.gateway)  # default options: a 4 MiB receive limit
    started = time.monotonic()

    def batch(size: int) -> None:
        @settings(
            max_examples=size,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            print_blob=True,
        )
        @given(call=calls(stack.voices))
        def one(call: Call) -> None:
            tally[judge(call, run_call(channel, call), stack.voices)] += 1

        one()

    done = 0
    try:
        while done < examples:
            batch_started = time.monotonic()
            batch(min(BATCH, examples - done))
            done = sum(tally.values())
            elapsed, last = time.monotonic() - started, time.monotonic() - batch_started
            if budget_s is not None and done < examples and elapsed + last > budget_s:
                print(f"\ngateway fuzz: stopping at {done} calls: the {budget_s:g}s budget")
                break
    finally:
        channel.close()
        took = time.monotonic() - started
        print(f"\ngateway fuzz: {sum(tally.values())} calls in {took:.1f}s")
        for label, n in sorted(tally.items()):
            print(f"  {n:6d}  {label}")

    assert done >= (BATCH if budget_s is not None else examples)
    check_still_serving(stack, reference)


def check_still_serving(stack: FuzzStack, reference: bytes) -> None:
    for name, proc in stack.procs.items():
        assert proc.alive(), f"{name} exited during the fuzzing; see {proc.log}"
    assert healthy(stack.gateway) and healthy(stack.decoder)
    assert reference_speak(stack.gateway) == reference, "a normal request changed its answer"
    errors = [
        line for line in (stack.directory / "gw.log").read_text().splitlines() if "ERROR" in line
    ]
    assert not errors, "the gateway logged errors:\n" + "\n".join(errors[:5])


@pytest.mark.timeout(1800)
def test_fuzz_gateway_requests(stack: FuzzStack) -> None:
    fuzz_gateway(stack, examples(FULL_REQUESTS), budget_s=CI_BUDGET_S if CI else None)


@pytest.mark.soak
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not CI, reason="outside CI, test_fuzz_gateway_requests already runs the full count")
@pytest.mark.skipif(os.environ.get("OMNI_SOAK_FULL") != "1",
                    reason="under CI=true the full count runs with OMNI_SOAK_FULL=1")
def test_fuzz_gateway_requests_soak(stack: FuzzStack) -> None:
    """The full count under CI=true, where test_fuzz_gateway_requests is cut short."""
    fuzz_gateway(stack, examples(FULL_REQUESTS))


# ---------------------------------------------------------------------------
# The HTTP facade: random JSON bodies and headers.

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def speech_bodies(draw: st.DrawFn, known: tuple[str, ...]) -> bytes:
    """An OpenAI speech body, valid or with 0 to 3 fields replaced by any JSON value."""
    body: dict[str, object] = {
        "model": "omni",
        "input": draw(valid_texts()),
        "voice": draw(st.sampled_from(("", *known))),
        "response_format": draw(st.sampled_from(["pcm", "wav"])),
        "stream": draw(st.booleans()),
    }
    for name in draw(
        _corrupted(["model", "input", "voice", "response_format", "speed", "stream", "seed"])
    ):
        wild = st.one_of(
            json_values,
            strings(),
            st.integers(-(2**70), 2**70),
            st.just(10**400),
            st.sampled_from([math.nan, math.inf, 0.25, 4.0, 2**63, 2**64, -1]),
        )
        body[name] = draw(wild)
    form = draw(st.sampled_from(["json"] * 8 + ["mutated", "deep"]))
    encoded = json.dumps(body, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    if form == "mutated":
        return draw(mutated_bytes(encoded))
    if form == "deep":  # nesting beyond Python's recursion limit
        return b"[" * 100_000 + b"]" * 100_000
    return encoded


def fuzz_http(stack: FuzzStack, examples: int) -> None:
    tally: Counter[str] = Counter()
    started = time.monotonic()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(
        body=speech_bodies(stack.voices),
        # Control characters in a header are refused by aiohttp's parser itself
        # (a plain-text 400 before the application runs): not drawn here.
        request_id=st.one_of(
            st.none(),
            st.text(st.characters(codec="latin-1", exclude_categories=["Cc"]), max_size=200),
        ),
    )
    def one(body: bytes, request_id: str | None) -> None:
        headers = {"Content-Type": "application/json"}
        if request_id is not None:
            headers["X-Request-Id"] = request_id
        conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=CALL_DEADLINE_S)
        try:
            conn.request("POST", "/v1/audio/speech", body=body, headers=headers)
            response = conn.getresponse()
            content = response.read()
        finally:
            conn.close()
        status = response.status
        assert status in (200, 400, 409, 413), f"{status}: {content[:300]!r}"
        if status == 200:
            assert content, "an empty 200"
            tally["200"] += 1
            return
        error = json.loads(content)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        message = error["message"]
        assert len(message) <= MAX_DETAILS and not _LEAKS.search(message), message
        tally[f"{status} {error['param'] or message.split(':', 1)[0][:30]}"] += 1

    try:
        one()
    finally:
        print(f"\nHTTP fuzz: {sum(tally.values())} requests in {time.monotonic() - started:.1f}s")
        for label, n in sorted(tally.items()):
            print(f"  {n:6d}  {label}")
    assert sum(tally.values()) >= examples


@pytest.mark.timeout(900)
def test_fuzz_http_speech(stack: FuzzStack) -> None:
    reference = reference_speak(stack.gateway)
    fuzz_http(stack, examples(HTTP_REQUESTS))
    check_still_serving(stack, reference)


# ---------------------------------------------------------------------------
# Materializer: random and mutated snapshots on one stream.


_TENSOR_FIELDS = ("sampled_token_ids", "logprobs", "prompt_logprobs", "query_start_loc",
                  "hidden_states")  # fmt: skip


@st.composite
def tensor_mutation(draw: st.DrawFn, ref: tensor_pb2.TensorRef, region: str) -> None:
    op = draw(st.sampled_from(["dtype", "shape", "inline", "shm", "clear"]))
    if op == "dtype":
        ref.dtype = draw(enums(list(range(11))))
    elif op == "shape":
        del ref.shape[:]
        ref.shape.extend(
            draw(
                st.lists(
                    st.one_of(st.integers(-2, 8), st.integers(-(2**63), 2**63 - 1)), max_size=5
                )
            )
        )
    elif op == "inline":
        ref.inline_data = draw(st.binary(max_size=300))
    elif op == "shm":
        handle = ref.shm
        what = draw(st.sampled_from(["region", "offset", "byte_size", "slot", "generation"]))
        if what == "region":
            handle.region = draw(
                st.one_of(
                    st.sampled_from(
                        [region, region + "x", "../etc/passwd", "/dev/shm/x", "", "omni-other-a"]
                    ),
                    st.text(max_size=60),
                )
            )
        elif what == "slot":
            handle.slot = draw(st.one_of(st.integers(0, 10), st.integers(0, 2**32 - 1)))
        else:
            setattr(handle, what, draw(st.one_of(st.integers(0, 4096), st.integers(0, 2**64 - 1))))
    else:
        ref.Clear()


def mutate(snap: snapshot_pb2.StepSnapshot, data: st.DataObject, region: str) -> None:
    """Apply one random change to `snap`."""
    uint32 = st.one_of(st.integers(0, 10), st.integers(0, 2**32 - 1))
    op = data.draw(
        st.sampled_from(
            ["step_id", "stage_id", "request_ids", "batch_indices", "num_sampled_tokens",
             "num_scheduled_tokens", "spans", "finished", "downstream", "tensor", "tensor",
             "tensor", "mm_add", "mm_layout", "mm_name", "signals", "spec"]
        )
    )  # fmt: skip
    if op == "step_id":
        snap.step_id = data.draw(st.one_of(st.integers(0, 2**20), st.integers(0, 2**64 - 1)))
    elif op == "stage_id":
        snap.stage_id = data.draw(uint32)
    elif op in ("request_ids", "finished", "downstream"):
        name = {"finished": "finished_request_ids", "downstream": "downstream_request_ids"}.get(
            op, op
        )
        target = getattr(snap, name)
        del target[:]
        target.extend(
            data.draw(st.lists(st.one_of(st.just("p0"), st.text(max_size=20)), max_size=6))
        )
    elif op in ("batch_indices", "num_sampled_tokens", "num_scheduled_tokens"):
        target = getattr(snap, op)
        del target[:]
        target.extend(data.draw(st.lists(uint32, max_size=6)))
    elif op == "spans":
        del snap.scheduled_spans[:]
        for start, end in data.draw(st.lists(st.tuples(uint32, uint32), max_size=4)):
            snap.scheduled_spans.add(start=start, end=end)
    elif op == "tensor":
        fields = [f for f in _TENSOR_FIELDS] + [
            f"mm{i}" for i in range(len(snap.multimodal_outputs))
        ]
        which = data.draw(st.sampled_from(fields))
        ref = (
            snap.multimodal_outputs[int(which[2:])].tensor
            if which.startswith("mm")
            else getattr(snap, which)
        )
        data.draw(tensor_mutation(ref, region))
    elif op == "mm_add":
        added = snap.multimodal_outputs.add(
            name=data.draw(st.sampled_from(["probe", "extra", ""])),
            layout=data.draw(enums([0, 1, 2])),
        )
        added.tensor.CopyFrom(snap.multimodal_outputs[0].tensor)
    elif op in ("mm_layout", "mm_name") and snap.multimodal_outputs:
        target_mm = snap.multimodal_outputs[0]
        if op == "mm_layout":
            target_mm.layout = data.draw(enums([0, 1, 2]))
        else:
            target_mm.name = data.draw(st.text(max_size=20))
    elif op == "signals":
        snap.connector_output.signals.add(
            request_id=data.draw(st.text(max_size=10)),
            kind=data.draw(st.text(max_size=10)),
            value=data.draw(st.integers(0, 2**64 - 1)),
        )
    elif op == "spec":
        snap.spec_decode.num_draft_tokens.extend(data.draw(st.lists(uint32, max_size=4)))
        snap.spec_decode.num_accepted_tokens.extend(data.draw(st.lists(uint32, max_size=4)))


@pytest.fixture(scope="module")
def materializer() -> Iterator[tuple[str, str, Proc]]:
    directory = short_socket_dir()
    deployment = f"mfuzz{os.getpid()}"
    target = f"unix://{directory / 'mat.sock'}"
    proc = Proc(
        [sys.executable, "-m", "materializer_svc", "--listen", target, "--deployment",
         deployment, "--log-level", "WARNING"],
        directory / "mat.log",
    )  # fmt: skip
    try:
        wait_for_health_sync(target, 120)
        yield target, f"omni-{deployment}", proc
    finally:
        proc.stop()
        shm_arena.sweep_stale(f"omni-{deployment}")
        remove_dir(directory)


class SnapshotStream:
    """One Materialize stream as a decoder drives it; reopened when a step id runs out."""

    READINESS_MS = 20

    def __init__(self, channel: grpc.Channel, prefix: str) -> None:
        self.channel, self.prefix = channel, prefix
        self.stream: Stream | None = None
        self.next_step = 1
        self.reopen()

    def reopen(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
        first = materializer_pb2.MaterializeRequest(
            open=materializer_pb2.MaterializeStreamOpen(
                shm_prefix=self.prefix,
                stages=[probe_plan()],
                readiness_timeout_ms=self.READINESS_MS,
                client_name="fuzz",
            )
        )
        self.stream = Stream(self.channel, first, deadline_s=3600)
        self.next_step = 1

    def answer(self, snap: snapshot_pb2.StepSnapshot) -> materializer_pb2.MaterializeResponse:
        assert self.stream is not None
        self.stream.send_snapshot(snap)
        try:
            resp = self.stream.recv(10.0)
        except (NoAnswer, StreamEnded) as exc:
            raise AssertionError(f"no answer to a snapshot: {exc}") from exc
        self.next_step = max(self.next_step, snap.step_id) + 1
        if self.next_step >= 2**62:
            self.reopen()
        return resp


def fuzz_materializer(target: str, prefix: str, proc: Proc, examples: int) -> None:
    tally: Counter[str] = Counter()
    channel = grpc.insecure_channel(target)
    arena = ShmArena(prefix, 8, 64 * 1024)
    stream = SnapshotStream(channel, prefix)
    started = time.monotonic()
    count = 0

    def good_step() -> None:
        probe = make_probe(stream.next_step)
        placed = place(arena, probe.snapshot)
        try:
            resp = stream.answer(placed.snapshot)
        finally:
            arena.release(placed.lease.slot, placed.lease.generation)
        assert resp.WhichOneof("kind") == "step", resp.error.message
        assert payload_only(resp.step) == probe.expected

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(placement=st.sampled_from(["inline", "shm", "shm", "bytes"]), data=st.data())
    def one(placement: str, data: st.DataObject) -> None:
        nonlocal count
        count += 1
        if count % 50 == 0:
            good_step()
        # What is drawn must not depend on the stream's state (hypothesis replays
        # examples): build from step 1, and give the step its id after drawing.
        snap = make_probe(1).snapshot
        ready = data.draw(st.sampled_from([True] * 9 + [False]))
        lease = None
        if placement == "shm":
            placed = place(arena, snap, mark_ready=ready)
            snap, lease = placed.snapshot, placed.lease
        try:  # the slot goes back whatever happens, a drawing that stops early included
            for _ in range(data.draw(st.integers(0, 5))):
                mutate(snap, data, arena.name)
            if placement == "bytes":
                raw = data.draw(mutated_bytes(snap.SerializeToString()))
                try:
                    snap = snapshot_pb2.StepSnapshot.FromString(raw)
                except Exception:  # noqa: BLE001  bytes that do not parse never reach the service
                    snap = snapshot_pb2.StepSnapshot(step_id=1)
            if snap.step_id == 1:  # not mutated: the next id on the stream
                snap.step_id = stream.next_step
            resp = stream.answer(snap)
        finally:
            if lease is not None:
                arena.release(lease.slot, lease.generation)
        kind = resp.WhichOneof("kind")
        if kind == "step":
            tally["step"] += 1
            return
        assert kind == "error", resp
        code = next(c for c in grpc.StatusCode if c.value[0] == resp.error.code)
        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (
            f"{code.name}: {resp.error.message}"
        )
        assert (resp.error.step_id, resp.error.stage_id) == (snap.step_id, snap.stage_id)
        tally[f"{code.name} {resp.error.message.split(':', 1)[0][:40]}"] += 1

    try:
        one()
        good_step()
    finally:
        took = time.monotonic() - started
        if stream.stream is not None:
            stream.stream.cancel()
        channel.close()
        arena.close()
        print(f"\nmaterializer fuzz: {sum(tally.values())} snapshots in {took:.1f}s")
        for label, n in sorted(tally.items()):
            print(f"  {n:6d}  {label}")
    assert sum(tally.values()) >= examples
    assert proc.alive(), f"the materializer exited; see {proc.log}"
    assert healthy(target)


@pytest.mark.timeout(900)
def test_fuzz_materializer_snapshots(materializer) -> None:
    target, prefix, proc = materializer
    fuzz_materializer(target, prefix, proc, examples(CI_SNAPSHOTS if CI and not SOAK_FULL else FULL_SNAPSHOTS))
