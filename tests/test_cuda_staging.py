"""The CUDA staging path: the fence logic on CPU (with a fake event), the
real path only where a CUDA device exists."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from decoder_svc.cuda_staging import CudaStaging, ReadinessFence
from omni_common.materialize import PER_REQUEST
from omni_common.shm_arena import ArenaReader, ShmArena
from omni_common.tensor_wire import tensor_from_buffer, validate_ref


class FakeEvent:
    """Test double for torch.cuda.Event: completes when the test says so."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def synchronize(self) -> None:
        assert self.done.wait(10), "fake copy never completed"


def test_fence_marks_ready_only_after_the_event_in_order():
    with ShmArena("omni-fence", 2, 4096) as arena:
        fence = ReadinessFence()
        leases = [arena.acquire(), arena.acquire()]
        for lease in leases:
            lease.write(torch.arange(4))
        events = [FakeEvent(), FakeEvent()]
        for lease, ev in zip(leases, events, strict=True):
            fence.submit(ev, lease.mark_ready, keepalive=object())
        time.sleep(0.05)
        assert not any(arena.is_ready(le.slot, le.generation) for le in leases), "ready before the copy finished"
        events[0].done.set()
        arena.wait_ready(leases[0].slot, leases[0].generation, 5)
        assert not arena.is_ready(leases[1].slot, leases[1].generation)
        events[1].done.set()
        arena.wait_ready(leases[1].slot, leases[1].generation, 5)
        fence.close()
        assert fence.completed == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_copies_device_tensors_into_the_arena():
    with ShmArena("omni-cuda", 4, 1 << 20) as arena:
        staging = CudaStaging(arena)
        src = torch.randn(64, 2048, device="cuda")
        want = src.cpu()
        lease = arena.acquire()
        handles = staging.write(lease, {"hidden_states": (src, PER_REQUEST)})
        src.zero_()  # the next forward overwrites the buffer: the clone protects the copy
        ref = handles["hidden_states"][0]
        reader = ArenaReader("omni-cuda")
        reader.wait_ready(ref.shm, time.monotonic() + 10)
        info, shape, _ = validate_ref(ref)
        got = tensor_from_buffer(reader.view(ref.shm), info, shape)
        assert torch.equal(got, want), "arena bytes differ from the device tensor at snapshot time"
        staging.close()
        reader.close()
