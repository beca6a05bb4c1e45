"""Device-to-host staging for CUDA hosts: step tensors into the arena without
blocking the decode step.

On a CUDA host the step's output tensors live on the device, in buffers the
next forward pass (or a CUDA graph replay) will overwrite. Per step:

1. the tensors are cloned on the compute stream (the clone is ordered after
   the kernels that produced them and before any later overwrite);
2. a dedicated copy stream waits for the compute stream, then copies each
   clone into the arena slot with `non_blocking=True`; the arena mapping is
   registered as pinned (page-locked) host memory, so the copy is a real
   asynchronous DMA;
3. an event is recorded on the copy stream; a fence thread waits for it,
   marks the slot ready (the materializer waits on that mark) and drops the
   clones.

The decode step only enqueues work; it never waits for the copy.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from omni_common.shm_arena import ShmArena, SlotLease
from omni_serving.v1 import tensor_pb2

logger = logging.getLogger(__name__)


class _Event(Protocol):
    def synchronize(self) -> None: ...


class ReadinessFence:
    """Marks slots ready once their copy event completed, in submission order."""

    def __init__(self, name: str = "d2h-fence") -> None:
        self._queue: queue.SimpleQueue[tuple[_Event, Callable[[], None], Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.completed = 0

    def submit(self, event: _Event, on_ready: Callable[[], None], keepalive: Any = None) -> None:
        """After `event` completes, call `on_ready`; hold `keepalive` until then."""
        self._queue.put((event, on_ready, keepalive))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, on_ready, _keepalive = item
            event.synchronize()
            on_ready()
            self.completed += 1

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)


class CudaStaging:
    """Pinned arena + copy stream + events (see the module docstring)."""

    def __init__(self, arena: ShmArena, device: torch.device | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA staging needs a CUDA device")
        self.arena = arena
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        base = arena.data_view(0, 1).data_ptr()
        err = torch.cuda.cudart().cudaHostRegister(base, arena.size, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the arena failed with error {int(err)}")
        self._registered = base
        self.stream = torch.cuda.Stream(device=self.device)
        self.fence = ReadinessFence()

    def write(self, lease: SlotLease, tensors: dict[str, tuple[torch.Tensor, int]]) -> dict[str, tuple[tensor_pb2.TensorRef, int]]:
        """Enqueue the copies of one step; the slot becomes ready later."""
        compute = torch.cuda.current_stream(self.device)
        clones = {name: (t.detach().clone(), layout) for name, (t, layout) in tensors.items()}  # 1)
        self.stream.wait_stream(compute)
        handles = {}
        with torch.cuda.stream(self.stream):  # 2)
            for name, (t, layout) in clones.items():
                handles[name] = (lease.write(t, non_blocking=True), layout)
        event = torch.cuda.Event()
        event.record(self.stream)  # 3)
        self.fence.submit(event, lease.mark_ready, keepalive=clones)
        return handles

    def close(self) -> None:
        self.fence.close()
        torch.cuda.cudart().cudaHostUnregister(self._registered)
