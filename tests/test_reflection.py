"""gRPC server reflection, v1 and v1alpha, on the three real services.

The client here behaves as grpcurl does: it asks ``grpc.reflection.v1``
first and would fall back to ``v1alpha`` on UNIMPLEMENTED; the test fails if
the fallback was needed. The two protocols' messages are the same on the
wire, so the v1alpha message classes serve both.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2

from omni_stack.config import StackConfig
from omni_stack.stack import Stack

pytestmark = pytest.mark.e2e

V1 = "grpc.reflection.v1.ServerReflection"
V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
HEALTH = "grpc.health.v1.Health"
SERVICES = {
    "gateway": "omni_serving.v1.OmniGatewayService",
    "decoder": "omni_serving.v1.DecoderService",
    "materializer": "omni_serving.v1.MaterializerService",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    s = Stack(
        StackConfig(
            engine="fake",
            runtime_dir=str(tmp_path_factory.mktemp("rt")),
            port=0,
            http_port=0,
            log_level="WARNING",
        )
    )
    s.start()
    yield s
    assert s.stop() == []


def targets(stack: Stack) -> dict[str, str]:
    materializer = stack.materializer_target
    assert materializer is not None
    return {
        "gateway": stack.gateway_target,
        "decoder": stack.decoder_target,
        "materializer": materializer,
    }


def reflect(
    target: str, request: reflection_pb2.ServerReflectionRequest, service: str | None = None
) -> tuple[str, reflection_pb2.ServerReflectionResponse]:
    """(protocol used, answer): v1 first, v1alpha on UNIMPLEMENTED (unless `service` is fixed)."""
    with grpc.insecure_channel(target) as channel:
        for name in (service,) if service else (V1, V1ALPHA):
            call = channel.stream_stream(
                f"/{name}/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            try:
                (answer,) = list(call(iter([request]), timeout=10))
            except grpc.RpcError as exc:
                if exc.code() is grpc.StatusCode.UNIMPLEMENTED and service is None:
                    continue
                raise
            return name, answer
    raise AssertionError(f"{target}: neither reflection protocol answered")


def file_pool(answer: reflection_pb2.ServerReflectionResponse) -> descriptor_pool.DescriptorPool:
    """A fresh pool with the files of a file_descriptor_response (dependencies first)."""
    files = []
    for raw in answer.file_descriptor_response.file_descriptor_proto:
        proto = descriptor_pb2.FileDescriptorProto()
        proto.ParseFromString(raw)
        files.append(proto)
    pool = descriptor_pool.DescriptorPool()
    pending = {f.name: f for f in files}
    while pending:
        ready = [f for f in pending.values() if all(d not in pending for d in f.dependency)]
        assert ready, f"unresolvable dependencies in {sorted(pending)}"
        for proto in ready:
            pool.Add(proto)
            del pending[proto.name]
    return pool


@pytest.mark.parametrize("role", ["gateway", "decoder", "materializer"])
def test_v1_lists_the_services(stack: Stack, role: str) -> None:
    target = targets(stack)[role]
    used, answer = reflect(target, reflection_pb2.ServerReflectionRequest(list_services=""))
    assert used == V1, f"{role}: v1 reflection is not served (fell back to {used})"
    names = {s.name for s in answer.list_services_response.service}
    assert names == {SERVICES[role], HEALTH, V1, V1ALPHA}, f"{role}: {names=}"
    # v1alpha, for older clients, gives the same list.
    _, old = reflect(target, reflection_pb2.ServerReflectionRequest(list_services=""), V1ALPHA)
    assert {s.name for s in old.list_services_response.service} == names


@pytest.mark.parametrize("role", ["gateway", "decoder", "materializer"])
def test_v1_describes_the_service(stack: Stack, role: str) -> None:
    target = targets(stack)[role]
    service = SERVICES[role]
    used, answer = reflect(
        target, reflection_pb2.ServerReflectionRequest(file_containing_symbol=service)
    )
    assert used == V1
    assert not answer.HasField("error_response"), answer.error_response
    described = file_pool(answer).FindServiceByName(service)
    from omni_serving.v1 import decoder_pb2, gateway_pb2, materializer_pb2

    module = {"gateway": gateway_pb2, "decoder": decoder_pb2, "materializer": materializer_pb2}
    local = module[role].DESCRIPTOR.services_by_name[service.rpartition(".")[2]]
    assert [m.name for m in described.methods] == [m.name for m in local.methods]
    assert [m.input_type.full_name for m in described.methods] == [
        m.input_type.full_name for m in local.methods
    ]


def test_v1_describes_itself(stack: Stack) -> None:
    used, answer = reflect(
        stack.gateway_target, reflection_pb2.ServerReflectionRequest(file_containing_symbol=V1)
    )
    assert used == V1
    assert not answer.HasField("error_response"), answer.error_response
    service = file_pool(answer).FindServiceByName(V1)
    assert service.file.name == "grpc/reflection/v1/reflection.proto"
    (method,) = service.methods
    assert method.name == "ServerReflectionInfo"
    assert method.input_type.full_name == "grpc.reflection.v1.ServerReflectionRequest"
    assert method.output_type.full_name == "grpc.reflection.v1.ServerReflectionResponse"
    assert method.client_streaming and method.server_streaming
    # The message definitions match v1alpha's field for field (what makes one handler serve both).
    for message in service.file.message_types_by_name.values():
        alpha = reflection_pb2.DESCRIPTOR.message_types_by_name[message.name]
        assert [(f.name, f.number, f.type) for f in message.fields] == [
            (f.name, f.number, f.type) for f in alpha.fields
        ], message.name


def test_unknown_symbol_is_not_found(stack: Stack) -> None:
    _, answer = reflect(
        stack.decoder_target,
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.such.Service"),
    )
    assert answer.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
