"""Device-to-host staging for CUDA hosts: step tensors into the arena without
blocking the decode step.

On a CUDA host the step's large output tensors (hidden rows, codec codes)
live on the device; small metadata (sampled ids, row layout) is on the host
already. The tensors handed in are the step's own: the backend gives each
step tensors no later step rewrites (fresh model outputs, or its one copy of
a buffer a CUDA graph replay reuses; `decoder_svc.vllm_engine.backend`), so
nothing is cloned here and the slot copy is the step's only copy. Per step:

1. a dedicated copy stream waits for the compute stream (the copies are
   ordered after the kernels that produced the tensors);
2. each device tensor is copied into the arena slot on the copy stream with
   `non_blocking=True`; the arena mapping is registered as pinned
   (page-locked) host memory, so the copy is a real asynchronous DMA. Host
   tensors are written at once (a memcpy);
3. an event is recorded on the copy stream; a fence thread waits for it,
   marks the slot ready (the materializer waits on that mark) and only then
   drops its references to the device tensors (until then the caching
   allocator cannot hand their memory to a later step).

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
        """Enqueue the copies of one step; the slot becomes ready later.

        The tensors must not be written after this call (module docstring).
        """
        on_device = [t for t, _ in tensors.values() if t.device.type == "cuda"]
        wrong = {str(t.device) for t in on_device if t.device != self.device}
        if wrong:  # a stage's tensors live on one device: its stream orders the copies
            raise ValueError(f"CUDA staging for {self.device} was given tensors on {sorted(wrong)}")
        if on_device:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # 1)
        handles = {}
        with torch.cuda.stream(self.stream):  # 2)
            for name, (t, layout) in tensors.items():
                handles[name] = (lease.write(t, non_blocking=t.device.type == "cuda"), layout)
        if not on_device:  # host tensors only: written already
            lease.mark_ready()
            return handles
        event = torch.cuda.Event()
        event.record(self.stream)  # 3)
        self.fence.submit(event, lease.mark_ready, keepalive=on_device)
        return handles

    def close(self) -> None:
        self.fence.close()
        torch.cuda.cudart().cudaHostUnregister(self._registered)
