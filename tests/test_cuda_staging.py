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
    """Pinned arena, copy stream, and readiness only after the copy: the
    compute stream is held busy before the step's tensors are handed over,
    so the copy (ordered after it) cannot have run when write() returns."""
    with ShmArena("omni-cuda", 4, 1 << 20) as arena:
        staging = CudaStaging(arena)
        src = torch.randn(64, 2048, device="cuda")
        want = src.cpu()
        ids = torch.arange(64).reshape(64, 1)  # host metadata beside it
        torch.cuda._sleep(200_000_000)  # keeps the compute stream busy (~0.1 s)
        lease = arena.acquire()
        handles = staging.write(
            lease, {"hidden_states": (src, PER_REQUEST), "sampled_token_ids": (ids, PER_REQUEST)}
        )
        assert not arena.is_ready(lease.slot, lease.generation), "slot ready before its copy ran"
        ref = handles["hidden_states"][0]
        reader = ArenaReader("omni-cuda")
        reader.wait_ready(ref.shm, time.monotonic() + 10)
        info, shape, _ = validate_ref(ref)
        got = tensor_from_buffer(reader.view(ref.shm), info, shape)
        assert torch.equal(got, want), "arena bytes differ from the device tensor"
        ref_ids = handles["sampled_token_ids"][0]
        info, shape, _ = validate_ref(ref_ids)
        assert torch.equal(tensor_from_buffer(reader.view(ref_ids.shm), info, shape), ids)
        staging.close()
        reader.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_step_rows_on_device_snapshot_without_a_copy_on_the_step():
    """A decode step's rows stay on the device through row selection and
    reach the slot through the staging copy, equal to the host run."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import test_step_devices as t

    torch.manual_seed(3)
    hidden = torch.randn(t.T, t.H)
    sampled = torch.tensor([[5], [2], [7], [-1]], dtype=torch.int32)
    w = torch.randn((t.K - 1) * t.V, t.H)
    live = [True, True, False, True]
    discard = [False, False, False, True]
    host = t._run_step(t._backend(talker=True, cp_weight=w.clone()),
                       t._capture(hidden, sampled, discard, "k"), live, {}, {})
    dev = t._run_step(t._backend(talker=True, cp_weight=w.clone()),
                      t._capture(hidden.cuda(), sampled.cuda(), discard, "k"), live, {}, {})
    assert dev.hidden_states.is_cuda and dev.mm_outputs["codec_codes"][0].is_cuda
    assert not dev.sampled_token_ids.is_cuda and not dev.query_start_loc.is_cuda
    with ShmArena("omni-cuda-step", 2, 1 << 20) as arena:
        staging = CudaStaging(arena)
        lease = arena.acquire()
        handles = staging.write(lease, {"hidden_states": (dev.hidden_states, PER_REQUEST),
                                        "codec_codes": (dev.mm_outputs["codec_codes"][0], PER_REQUEST)})
        reader = ArenaReader("omni-cuda-step")
        for name, want in (("hidden_states", host.hidden_states), ("codec_codes", host.mm_outputs["codec_codes"][0])):
            ref = handles[name][0]
            reader.wait_ready(ref.shm, time.monotonic() + 10)
            info, shape, _ = validate_ref(ref)
            got = tensor_from_buffer(reader.view(ref.shm), info, shape)
            assert torch.allclose(got.float(), want.float(), atol=1e-5), name
        staging.close()
        reader.close()
