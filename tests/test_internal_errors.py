"""Our own bugs reach a client as INTERNAL with an error id, never as its fault.

A real decoder gRPC server (an in-process `Pipeline` with the fake engine,
`DecoderServicer` behind `build_server` on a Unix socket): a function on the
request path is monkeypatched to raise a plain ValueError / KeyError /
TypeError (an injected bug). The client must get INTERNAL (not
INVALID_ARGUMENT, NOT_FOUND or UNKNOWN), a message with an error id and
nothing of the exception's text, and the server log must hold the same id
with the traceback. A real client mistake still gets INVALID_ARGUMENT naming
the field, and a request after the bug is served.

The materializer's in-band StepError for a bug is checked the same way
(`error_response`, what every materializer strategy answers a failed step
with).
"""

from __future__ import annotations

import logging
import re

import grpc
import pytest

import decoder_svc.servicer as servicer_mod
from decoder_svc.pipeline import Pipeline
from decoder_svc.profile import load_profile
from decoder_svc.server import SERVICE_NAME
from decoder_svc.servicer import DecoderServicer
from decoder_svc.testing.fake_engine import FakeBackend, fake_vocoder
from materializer_svc.session import error_response
from omni_common.errors import InvalidArgumentError
from omni_common.server import ServerConfig, build_server
from omni_serving.v1 import common_pb2, decoder_pb2, decoder_pb2_grpc, snapshot_pb2
from tests.fakes.fake_decoder import BackgroundLoop

ERROR_ID = re.compile(r"^internal error \(error id ([0-9a-f]{12})\); the server log has the details$")


@pytest.fixture
def decoder(tmp_path):
    """The target of a real decoder server (fake engine, in-process pipeline)."""
    profile = load_profile("tts")
    pipeline = Pipeline(
        profile,
        {"talker": FakeBackend()},
        vocoder=fake_vocoder(profile),
        materializer_target=None,
        shm_prefix="omni-interr",
        arena=None,
    )
    pipeline.start()
    servicer = DecoderServicer(pipeline, engine="fake", materializer_target="")
    loop = BackgroundLoop("internal-errors-test")
    server = None
    try:

        def register(s: grpc.aio.Server) -> None:
            decoder_pb2_grpc.add_DecoderServiceServicer_to_server(servicer, s)

        server, target, _ = loop.run(
            build_server(
                ServerConfig(address=f"unix://{tmp_path}/d.sock", service_name=SERVICE_NAME),
                register,
            )
        )
        yield target, pipeline
    finally:
        if server is not None:
            loop.run(server.stop(0))
        loop.close()
        pipeline.stop()


def generate(target: str, rid: str, prompt: str = "hello there", **sampling) -> list:
    with grpc.insecure_channel(target) as ch:
        request = decoder_pb2.GenerateRequest(
            request_id=rid, prompt=prompt, sampling_params=common_pb2.SamplingParams(**sampling)
        )
        return list(decoder_pb2_grpc.DecoderServiceStub(ch).Generate(request, timeout=30))


def check_internal(err: grpc.RpcError, caplog: pytest.LogCaptureFixture, secret: str) -> None:
    """INTERNAL, an error id and no exception text; the log has the id and the traceback."""
    assert err.code() == grpc.StatusCode.INTERNAL, f"{err.code()}: {err.details()}"
    details = err.details()
    match = ERROR_ID.match(details)
    assert match, f"not the internal message with an error id: {details!r}"
    assert secret not in details and "Error" not in details, details
    logged = [r for r in caplog.records if match.group(1) in r.getMessage()]
    assert len(logged) == 1, f"error id {match.group(1)} in {len(logged)} log records"
    assert logged[0].exc_info is not None, "the log record has no traceback"
    assert secret in str(logged[0].exc_info[1]), logged[0].exc_info


@pytest.mark.parametrize("bug", [ValueError, KeyError, TypeError])
def test_a_bug_in_request_parsing_is_internal(decoder, monkeypatch, caplog, bug) -> None:
    target, _ = decoder
    secret = "/srv/omni/secret.py: bad shape (3, 4)"

    def broken(*args, **kwargs):
        raise bug(secret)

    monkeypatch.setattr(servicer_mod, "spec_from_pb", broken)
    with caplog.at_level(logging.ERROR, logger=servicer_mod.__name__):
        with pytest.raises(grpc.RpcError) as info:
            generate(target, "bad")
    check_internal(info.value, caplog, secret)


def test_a_bug_in_the_engine_is_internal_and_the_next_request_is_served(
    decoder, monkeypatch, caplog
) -> None:
    target, pipeline = decoder
    backend = pipeline.backends["talker"]
    real = backend.add_request
    secret = "operands could not be broadcast together with shapes (7,) (9,)"

    def broken(spec):
        if spec.request_id == "bad":
            raise ValueError(secret)
        return real(spec)

    monkeypatch.setattr(backend, "add_request", broken)
    with caplog.at_level(logging.ERROR, logger=servicer_mod.__name__):
        with pytest.raises(grpc.RpcError) as info:
            generate(target, "bad")
    check_internal(info.value, caplog, secret)
    responses = generate(target, "good")
    assert responses and responses[-1].finished, f"the next request did not finish: {responses[-1:]}"
    assert pipeline.active_requests == 0, f"{pipeline.active_requests} requests left running"


def test_a_client_mistake_is_still_invalid_argument_naming_the_field(decoder) -> None:
    target, _ = decoder
    with pytest.raises(grpc.RpcError) as info:
        generate(target, "neg", top_k=-1)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert info.value.details().startswith("sampling_params.top_k:"), info.value.details()


def test_materializer_step_error_for_a_bug_is_internal_with_an_id(caplog) -> None:
    snap = snapshot_pb2.StepSnapshot(step_id=7, stage_id=1)
    secret = "index 9 is out of bounds for axis 0 with size 3 at /srv/x.py"
    with caplog.at_level(logging.ERROR, logger="materializer_svc.session"):
        error = error_response(snap, IndexError(secret)).error
    assert error.code == grpc.StatusCode.INTERNAL.value[0], error
    match = ERROR_ID.match(error.message)
    assert match and secret not in error.message, error.message
    assert any(match.group(1) in r.getMessage() and r.exc_info for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
    for bug in (ValueError("v"), KeyError("k"), TypeError("t")):
        code = error_response(snap, bug).error.code
        assert code == grpc.StatusCode.INTERNAL.value[0], f"{bug!r}: code {code}"
    client = error_response(snap, InvalidArgumentError("snapshot.hidden_states", "bad dtype")).error
    assert client.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], client
    assert client.message == "snapshot.hidden_states: bad dtype", client.message


def test_a_stage_process_sends_a_bug_as_internal_and_a_client_mistake_as_it_was() -> None:
    """What crosses a stage process's pipe: a bug becomes INTERNAL with the
    message its log record's id names (no class name, no text of ours); a
    client mistake keeps its class, field and message."""
    from decoder_svc.stage.messages import WireError

    bug = WireError.of(KeyError("talker.secret_path"), "internal error (error id abc); the server log has it")
    rebuilt = bug.rebuild()
    assert rebuilt.code == grpc.StatusCode.INTERNAL
    assert "secret_path" not in str(rebuilt) and "KeyError" not in str(rebuilt), rebuilt
    assert "error id abc" in str(rebuilt)
    mistake = WireError.of(InvalidArgumentError("sampling_params.top_k", "must be >= 0, got -1")).rebuild()
    assert isinstance(mistake, InvalidArgumentError) and mistake.code == grpc.StatusCode.INVALID_ARGUMENT
    assert mistake.field == "sampling_params.top_k" and "must be >= 0" in str(mistake), mistake
