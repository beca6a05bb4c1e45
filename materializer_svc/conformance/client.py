"""The kit's side of the wire: a bidi stream driven step by step, and the
arena writer that turns inline snapshots into shared-memory ones.

The kit talks to the implementation under test like a decoder does, with the
plain generated protobuf classes and a grpc channel; it never imports the
implementation.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from omni_common.server import client_options, client_target
from omni_common.shm_arena import ShmArena, SlotLease
from omni_common.tensor_wire import decode_inline
from omni_serving.v1 import materializer_pb2, materializer_pb2_grpc, snapshot_pb2, tensor_pb2

MATERIALIZE = "/omni_serving.v1.MaterializerService/Materialize"
_CLOSE = object()


class StreamEnded(Exception):
    """The call ended (status OK when the server closed it normally)."""

    def __init__(self, code: grpc.StatusCode | None, details: str) -> None:
        super().__init__(f"{getattr(code, 'name', code)}: {details}")
        self.code = code
        self.details = details or ""


class NoAnswer(Exception):
    """No response within the timeout."""


def open_channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(client_target(target), options=client_options())


def info(
    channel: grpc.Channel, timeout_s: float = 5.0, arena_probe: str = ""
) -> materializer_pb2.GetMaterializerInfoResponse:
    stub = materializer_pb2_grpc.MaterializerServiceStub(channel)
    return stub.GetMaterializerInfo(
        materializer_pb2.GetMaterializerInfoRequest(arena_probe=arena_probe), timeout=timeout_s
    )


Outgoing = materializer_pb2.MaterializeRequest | Callable[[], materializer_pb2.MaterializeRequest]


class Stream:
    """One Materialize call: send requests when you like, receive with a timeout.

    Responses are kept as raw bytes too (`recv_raw`), so comparisons can be
    made on what came over the wire. A callable may be sent instead of a
    request: it is called when gRPC pulls the request (after earlier ones
    went out), which lets a sender take arena slots lazily, as a decoder does.
    """

    def __init__(
        self,
        channel: grpc.Channel,
        first: Outgoing | None = None,
        *,
        deadline_s: float = 120.0,
    ) -> None:
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._in: queue.SimpleQueue = queue.SimpleQueue()
        if first is not None:
            self._out.put(first)
        call = channel.stream_stream(
            MATERIALIZE,
            request_serializer=materializer_pb2.MaterializeRequest.SerializeToString,
            response_deserializer=None,  # raw bytes: the kit compares them itself
        )
        self.call = call(self._requests(), timeout=deadline_s)
        self.ended: StreamEnded | None = None
        self._reader = threading.Thread(target=self._read, name="conformance-recv", daemon=True)
        self._reader.start()

    def _requests(self):
        while True:
            item = self._out.get()
            if item is _CLOSE:
                return
            yield item() if callable(item) else item

    def _read(self) -> None:
        try:
            for raw in self.call:
                self._in.put(raw)
            self._in.put(StreamEnded(grpc.StatusCode.OK, ""))
        except grpc.RpcError as exc:
            self._in.put(StreamEnded(exc.code(), exc.details()))
        finally:
            self._out.put(_CLOSE)  # unblock the request thread

    # -- sending -------------------------------------------------------------------
    def send(self, item: Outgoing) -> None:
        self._out.put(item)

    def send_snapshot(self, snap: snapshot_pb2.StepSnapshot) -> None:
        self._out.put(materializer_pb2.MaterializeRequest(snapshot=snap))

    def close_send(self) -> None:
        self._out.put(_CLOSE)

    def cancel(self) -> None:
        self.call.cancel()
        self._out.put(_CLOSE)

    # -- receiving -----------------------------------------------------------------
    def recv_raw(self, timeout_s: float) -> bytes:
        if self.ended is not None:
            raise self.ended
        try:
            item = self._in.get(timeout=timeout_s)
        except queue.Empty:
            raise NoAnswer(f"no response within {timeout_s:g}s") from None
        if isinstance(item, StreamEnded):
            self.ended = item
            raise item
        return item

    def recv(self, timeout_s: float) -> materializer_pb2.MaterializeResponse:
        return materializer_pb2.MaterializeResponse.FromString(self.recv_raw(timeout_s))

    def wait_end(self, timeout_s: float) -> StreamEnded:
        """The call's final status; responses still pending are an error."""
        try:
            raw = self.recv_raw(timeout_s)
        except StreamEnded as end:
            return end
        resp = materializer_pb2.MaterializeResponse.FromString(raw)
        raise AssertionError(f"expected the call to end, got a response: {resp.WhichOneof('kind')}")


# --------------------------------------------------------------------------
# Arena side (the kit is the writer, like a decoder)
# --------------------------------------------------------------------------

_TENSOR_FIELDS = (
    "sampled_token_ids",
    "logprobs",
    "prompt_logprobs",
    "query_start_loc",
    "hidden_states",
)


@dataclass
class Placed:
    """A snapshot whose tensors live in one arena slot."""

    snapshot: snapshot_pb2.StepSnapshot
    lease: SlotLease

    @property
    def release(self) -> tuple[str, int, int]:
        return (self.lease.arena.name, self.lease.slot, self.lease.generation)


def tensor_refs(snap: snapshot_pb2.StepSnapshot) -> list[tensor_pb2.TensorRef]:
    refs = [getattr(snap, f) for f in _TENSOR_FIELDS if snap.HasField(f)]
    return refs + [st.tensor for st in snap.multimodal_outputs]


def place(
    arena: ShmArena,
    snap: snapshot_pb2.StepSnapshot,
    *,
    mark_ready: bool = True,
    acquire_timeout_s: float | None = 30.0,
) -> Placed:
    """Copy every inline tensor of `snap` into one fresh slot; handles replace bytes."""
    lease = arena.acquire(acquire_timeout_s)
    out = snapshot_pb2.StepSnapshot()
    out.CopyFrom(snap)
    try:
        for ref in tensor_refs(out):
            if ref.WhichOneof("data") == "inline_data":
                ref.CopyFrom(lease.write(decode_inline(ref)))
    except BaseException:
        arena.release(lease.slot, lease.generation)
        raise
    if mark_ready:
        lease.mark_ready()
    return Placed(out, lease)


def release_key(r: materializer_pb2.SlotRelease) -> tuple[str, int, int]:
    return (r.region, r.slot, r.generation)
