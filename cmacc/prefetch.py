"""Batches ready before the step asks: a background thread runs the loader ahead of the trainer.

    batches = Prefetcher(loader, device, depth=2, channels_last=True)
    batches.set_epoch(e, start=b)          # passed to the loader, as every other attribute
    with contextlib.closing(iter(batches)) as it:
        for batch in it: ...               # the loader's batches, in its order, on ``device``

A thread iterates the wrapped loader (the in-memory clips, the PyAV reference loader, DALI) and
readies each batch while the trainer's step runs: the loader's own work (gather, decode), then

- to CUDA: a host tensor that is not pinned is copied into a small ring of reused pinned buffers
  (``depth + 1`` per field; a slot is written again only once its previous host-to-device copy
  has run: the thread waits for that copy's event, the trainer never does), then copied with
  ``non_blocking=True`` on a copy stream; a CUDA event marks the batch ready, and the trainer's
  stream waits for it on the device (``record_stream`` tells the allocator the batch is used
  there). Clips the loader made on the device (DALI, the in-memory clips kept on the GPU) are
  made on the copy stream too;
- to the CPU: the batch as the loader made it;
- the video to channels-last-3d when asked (the encoders' layout), off the trainer's stream.

At most ``depth`` batches wait ahead, so memory stays flat. The order, the shards and the epoch
positions are the loader's: the thread only runs it earlier. An error of the loader (a damaged
clip past the limit, a vanished file) is raised in the trainer at the batch where it happened;
closing the iterator (the end of the epoch, a stop, an error) stops the thread and drops what
it had readied. ``record_function`` ranges "gather", "pin" and "h2d" mark the thread's work in
a profiler trace.
"""

from __future__ import annotations

import queue
import threading

import torch
from torch.profiler import record_function


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch with its tensors on ``device``. To CUDA, a host tensor is pinned first (unless
    the loader pinned it) and copied with ``non_blocking=True``: the copy is queued on the current
    stream and the host goes on queueing the step instead of waiting for the previous step's
    update (the caching host allocator keeps the pinned buffer until the copy has run). Any other
    device: ``.to`` as it is."""
    cuda = torch.device(device).type == "cuda"
    out = {}
    for name, v in batch.items():
        if torch.is_tensor(v):
            if cuda and v.device.type == "cpu" and not v.is_pinned():
                v = v.pin_memory()
            v = v.to(device, non_blocking=cuda)
        out[name] = v
    return out


class PinnedRing:
    """``slots`` reused pinned host buffers per field: ``stage(name, x)`` copies x into the next
    slot of ``name`` and returns it. A slot is written again only after ``fence(name, event)``'s
    event of its last use has completed (the host-to-device copy out of it), waited for here, in
    the thread that stages. A field whose shape or dtype changes gets new buffers."""

    def __init__(self, slots: int, pin: bool = True):
        if slots < 1:
            raise ValueError(f"PinnedRing: slots must be >= 1, got {slots}")
        self.slots, self.pin = slots, pin
        self.bufs: dict[str, list] = {}  # name -> [buffer or None] * slots
        self.events: dict[str, list] = {}  # name -> [event of the slot's last use or None]
        self.next: dict[str, int] = {}
        self.allocated = 0  # buffers allocated so far (flat after the first ``slots`` batches)

    def stage(self, name: str, x: torch.Tensor) -> torch.Tensor:
        k = self.next.get(name, 0)
        bufs = self.bufs.setdefault(name, [None] * self.slots)
        events = self.events.setdefault(name, [None] * self.slots)
        if events[k] is not None:
            events[k].synchronize()  # the copy out of this slot has run: it may be written
            events[k] = None
        buf = bufs[k]
        if buf is None or buf.shape != x.shape or buf.dtype != x.dtype:
            buf = bufs[k] = torch.empty(x.shape, dtype=x.dtype, pin_memory=self.pin)
            self.allocated += 1
        buf.copy_(x)
        return buf

    def fence(self, name: str, event) -> None:
        """``event`` (None: nothing pending) marks the end of the last use of the slot just
        staged for ``name``; the next ``stage`` of ``name`` takes the following slot."""
        self.events[name][self.next.get(name, 0)] = event
        self.next[name] = (self.next.get(name, 0) + 1) % self.slots


_END = object()


class Prefetcher:
    """The loader, run ``depth`` batches ahead by a background thread (module docstring).
    Every attribute but iteration is the loader's (``set_epoch``, ``bad``, ``labels``, ...)."""

    def __init__(self, loader, device, *, depth: int = 2, channels_last: bool = False):
        if depth < 1:
            raise ValueError(f"Prefetcher: depth must be >= 1, got {depth}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # (the thread starts on device 0:
            device = torch.device("cuda", torch.cuda.current_device())  # resolve it here)
        self.loader, self.device, self.depth = loader, device, depth
        self.channels_last = channels_last
        self.cuda = self.device.type == "cuda"
        self.ring = PinnedRing(depth + 1, pin=self.cuda)
        self._stream = None  # the copy stream (CUDA; created on first use)

    def __getattr__(self, name):  # only called for what Prefetcher itself does not have
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        ready: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        thread = threading.Thread(target=self._produce, args=(ready, stop), daemon=True,
                                  name="cmacc-prefetch")
        thread.start()
        try:
            while True:
                item = ready.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                batch, event = item
                yield self._consume(batch, event)
        finally:
            stop.set()
            while thread.is_alive():  # unblock a thread waiting to put, until it sees stop
                try:
                    ready.get(timeout=0.05)
                except queue.Empty:
                    pass

    # -- the thread ------------------------------------------------------------------------
    def _produce(self, ready: queue.Queue, stop: threading.Event) -> None:
        def put(item) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    pass
            return False

        it = None
        try:
            with self._on_copy_stream():
                it = iter(self.loader)
                while not stop.is_set():
                    with record_function("gather"):
                        batch = next(it, _END)
                    if batch is _END:
                        put(_END)
                        return
                    if not put(self._ready(batch)):
                        return
        except BaseException as e:  # noqa: BLE001 - raised in the trainer, at this batch
            put(e)
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()  # the loader's generator ends here, in this thread

    def _on_copy_stream(self):
        if not self.cuda:
            import contextlib

            return contextlib.nullcontext()
        # a new thread starts on device 0: this one works on the trainer's device (the DataLoader's
        # pin thread and DALI's copies read the thread's current device)
        torch.cuda.set_device(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return torch.cuda.stream(self._stream)

    def _ready(self, batch: dict):
        """(batch on the device, the event that marks it ready or None)."""
        out, staged = {}, []
        for name, v in batch.items():
            if torch.is_tensor(v) and self.cuda and v.device.type == "cpu":
                if not v.is_pinned():
                    with record_function("pin"):
                        v = self.ring.stage(name, v)
                    staged.append(name)
                with record_function("h2d"):
                    v = v.to(self.device, non_blocking=True)
            if name == "video" and self.channels_last and torch.is_tensor(v) and v.dim() == 5:
                v = v.contiguous(memory_format=torch.channels_last_3d)
            out[name] = v
        if not self.cuda:
            return out, None
        event = torch.cuda.Event()
        event.record(self._stream)
        for name in staged:
            self.ring.fence(name, event)
        return out, event

    # -- the trainer's side ----------------------------------------------------------------
    def _consume(self, batch: dict, event) -> dict:
        if event is None:
            return batch
        main = torch.cuda.current_stream(self.device)
        main.wait_event(event)  # on the device: the host does not wait
        for v in batch.values():
            if torch.is_tensor(v) and v.is_cuda:
                v.record_stream(main)
        return batch
