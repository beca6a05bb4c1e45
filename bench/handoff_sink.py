"""A MaterializerService that only receives: the far end of the handoff suite.

`python -m bench.handoff_sink --listen unix:///x.sock --deployment NAME`

For every snapshot it does what any materializer must do before it can build
anything: validate each tensor handle (dtype, shape, byte size; for shm the
region, bounds, generation), wait for the slot's readiness mark, read every
byte of every tensor (one pass, a 64-bit sum), check the generation again
after reading, and answer with an empty MaterializedStep (whose one connector
signal carries the receiver's own time, in nanoseconds). Nothing is built,
so the round trip measures the handoff itself. It speaks the same contract
as materializer_svc (a stream opened by MaterializeStreamOpen), so the
decoder-side code is the real one.
"""

from __future__ import annotations

import argparse
import time

import grpc
import numpy as np

from omni_common.server import ServerConfig, run_server
from omni_common.shm_arena import ArenaReader
from omni_common.tensor_wire import validate_ref
from omni_serving.v1 import materializer_pb2, materializer_pb2_grpc, snapshot_pb2, tensor_pb2

SERVICE_NAME = materializer_pb2.DESCRIPTOR.services_by_name["MaterializerService"].full_name
MAX_MESSAGE_BYTES = 256 * 2**20
RECEIVE_NS = "bench.receive_ns"


def read_all(buf) -> int:  # noqa: ANN001
    """Touch every byte once (a 64-bit wrapping sum)."""
    a = np.frombuffer(buf, dtype=np.uint8)
    n8 = a.size // 8 * 8
    total = int(a[:n8].view(np.uint64).sum(dtype=np.uint64)) if n8 else 0
    return total + int(a[n8:].sum())


def snapshot_refs(snap: snapshot_pb2.StepSnapshot) -> list[tensor_pb2.TensorRef]:
    refs = []
    if snap.HasField("sampled_token_ids"):
        refs.append(snap.sampled_token_ids)
    if snap.HasField("hidden_states"):
        refs.append(snap.hidden_states)
    refs += [t.tensor for t in snap.multimodal_outputs]
    return refs


class HandoffSink(materializer_pb2_grpc.MaterializerServiceServicer):
    def __init__(self, prefix: str) -> None:
        self.reader = ArenaReader(prefix)

    def receive(self, snap: snapshot_pb2.StepSnapshot, timeout_s: float) -> materializer_pb2.MaterializeResponse:
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        shm = []
        for ref in snapshot_refs(snap):
            validate_ref(ref)
            if ref.WhichOneof("data") == "shm":
                self.reader.wait_ready(ref.shm, deadline)
                read_all(self.reader.view(ref.shm))
                shm.append(ref.shm)
            else:
                read_all(ref.inline_data)
        for h in shm:
            self.reader.verify_unchanged(h)
        # the receiver's own time, reported back in a connector signal (this
        # receiver builds no payloads, so the field is free for it)
        spent = snapshot_pb2.ConnectorSignal(request_id="bench", kind=RECEIVE_NS, value=int((time.perf_counter() - t0) * 1e9))
        return materializer_pb2.MaterializeResponse(
            step=materializer_pb2.MaterializedStep(step_id=snap.step_id, stage_id=snap.stage_id, connector_signals=[spent])
        )

    async def Materialize(self, request_iterator, context: grpc.aio.ServicerContext):  # noqa: ANN001
        it = aiter(request_iterator)
        first = await anext(it, None)
        if first is None or first.WhichOneof("kind") != "open":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "open: the first message must open the stream")
            return
        self.reader.prune()
        timeout_s = (first.open.readiness_timeout_ms or 5000) / 1000
        async for req in it:
            yield self.receive(req.snapshot, timeout_s)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench.handoff_sink", description=__doc__)
    p.add_argument("--listen", required=True)
    p.add_argument("--deployment", required=True)
    args = p.parse_args(argv)
    sink = HandoffSink(f"omni-{args.deployment}")

    def register(server: grpc.aio.Server) -> None:
        materializer_pb2_grpc.add_MaterializerServiceServicer_to_server(sink, server)

    run_server(ServerConfig(address=args.listen, service_name=SERVICE_NAME, max_message_bytes=MAX_MESSAGE_BYTES), register)


if __name__ == "__main__":
    main()
