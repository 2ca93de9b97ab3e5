"""``KernelStream``: kernels of one (device, stream type), run in order on a dedicated thread.

A CPU stream is a queue served by one daemon thread; a CUDA stream is the same thread issuing onto a
``torch.cuda.Stream`` (written for completeness, untested here: this machine has no GPU). ``push``
returns at once; ``record()`` / ``wait(event)`` keep order across streams without blocking the host;
``synchronize(timeout)`` waits for everything pushed so far. ``StreamManager`` makes one stream per
(device, stream type) on first use and joins them all in ``shutdown()`` (also at interpreter exit).

Threads: each CPU compute stream sets its own intra-op thread count (``torch.set_num_threads`` in the
stream thread sets that thread's OpenMP team size) to a fair share of the cores, cores // devices, or
``DTORCH_THREADS``; communicate streams use one thread.
"""

from __future__ import annotations

import atexit
import enum
import os
import queue
import threading
import time
import weakref
from collections import deque
from typing import Any

import torch

from dtorch.core import env
from dtorch.core.device import Device
from dtorch.core.errors import ArgumentError, SyncTimeout


class StreamType(enum.Enum):
    COMPUTE = "compute"
    COMMUNICATE = "communicate"


class Event:
    """Set when its stream reaches the point where it was recorded."""

    __slots__ = ("flag", "cuda_event")

    def __init__(self) -> None:
        self.flag = threading.Event()
        self.cuda_event: Any = None


class _Record:
    __slots__ = ("event", "label")
    traced = False  # markers are not drawn in traces

    def __init__(self, event: Event) -> None:
        self.event = event
        self.label = "record event"

    def execute(self, stream: KernelStream, state: Any) -> None:
        stream._record_device(self.event)
        self.event.flag.set()


class _Wait:
    __slots__ = ("event", "label")
    traced = False

    def __init__(self, event: Event) -> None:
        self.event = event
        self.label = "wait event"

    def execute(self, stream: KernelStream, state: Any) -> None:
        flag = self.event.flag
        while not flag.wait(0.05):
            if stream.closing or (state is not None and state.aborted):
                return
        stream._wait_device(self.event)


class KernelStream:
    """One stream: ``push(kernel, state)`` queues ``kernel.execute(stream, state)`` on this stream's thread."""

    def __init__(self, device: Device, stream_type: StreamType, threads: int = 1, tracer_ref: Any = None) -> None:
        self.device = device
        self.type = stream_type
        self.name = f"{device}/{stream_type.value}"
        self.threads = threads
        self.closing = False
        self.tracer: Any = tracer_ref  # a Tracer or None; read per kernel
        self.in_flight: deque = deque()  # labels of items pushed and not yet finished, oldest first
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"dtorch-{self.name}", daemon=True)
        self._thread.start()

    def push(self, item: Any, state: Any = None) -> None:
        """Queue ``item`` (anything with ``execute(stream, state)`` and ``label``); returns at once."""
        self.in_flight.append(item.label)
        self._queue.put((item, state))

    def record(self, state: Any = None) -> Event:
        """An event set when this stream reaches this point."""
        ev = Event()
        self.push(_Record(ev), state)
        return ev

    def wait(self, event: Event, state: Any = None) -> None:
        """Later items of this stream start only after ``event`` is set (the host does not block)."""
        self.push(_Wait(event), state)

    def synchronize(self, timeout: float | None = None) -> bool:
        """Wait for everything pushed so far; False if ``timeout`` seconds passed first."""
        ev = self.record()
        return ev.flag.wait(env.sync_timeout() if timeout is None else timeout)

    def pending(self) -> list[str]:
        """Labels of the items still queued or running, the running one first."""
        for _ in range(3):
            try:
                return list(self.in_flight)
            except RuntimeError:  # mutated while copying
                continue
        return ["?"]

    def _setup_thread(self) -> None:
        if self.device.type == "cpu" and self.threads > 0:
            torch.set_num_threads(self.threads)

    def _record_device(self, event: Event) -> None:
        """Hook for device streams (CUDA records a device event)."""

    def _wait_device(self, event: Event) -> None:
        """Hook for device streams (CUDA makes its stream wait on the device event)."""

    def _loop(self) -> None:
        self._setup_thread()
        get, done, clock = self._queue.get, self.in_flight.popleft, time.perf_counter_ns
        while True:
            item, state = get()
            if item is None:
                break
            tracer = self.tracer
            if tracer is None or not getattr(item, "traced", True):
                item.execute(self, state)
            else:
                t0 = clock()
                item.execute(self, state)
                tracer.add(self, item.label, t0, clock())
            done()
            item = state = None  # release the kernel's references right after it ran

    def close(self, timeout: float = 5.0) -> bool:
        """Stop after the queued items; True if the thread has ended within ``timeout``."""
        if self._thread.is_alive():
            self.closing = True
            self._queue.put((None, None))
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout)
        return not self._thread.is_alive()

    def __repr__(self) -> str:
        return f"KernelStream({self.name}, pending={len(self.in_flight)})"


class CudaKernelStream(KernelStream):
    """A dedicated thread issuing kernels onto its own ``torch.cuda.Stream`` (untested: no GPU here)."""

    def __init__(self, device: Device, stream_type: StreamType, threads: int = 1, tracer_ref: Any = None) -> None:
        self.cuda_stream = torch.cuda.Stream(device=device.torch)
        super().__init__(device, stream_type, threads, tracer_ref)

    def _setup_thread(self) -> None:
        torch.cuda.set_device(self.device.torch)
        torch.cuda.set_stream(self.cuda_stream)

    def _record_device(self, event: Event) -> None:
        event.cuda_event = torch.cuda.Event()
        event.cuda_event.record(self.cuda_stream)

    def _wait_device(self, event: Event) -> None:
        if event.cuda_event is not None:
            self.cuda_stream.wait_event(event.cuda_event)

    def synchronize(self, timeout: float | None = None) -> bool:
        ok = super().synchronize(timeout)
        if ok:
            self.cuda_stream.synchronize()
        return ok


_MANAGERS: weakref.WeakSet = weakref.WeakSet()


class StreamManager:
    """One ``KernelStream`` per (device, stream type), made on first use; ``shutdown()`` joins them all."""

    def __init__(self, devices_per_process: int = 1) -> None:
        self.devices_per_process = max(1, devices_per_process)
        self.tracer: Any = None
        self._streams: dict[tuple[Device, StreamType], KernelStream] = {}
        self._lock = threading.Lock()
        _MANAGERS.add(self)

    def compute_threads(self) -> int:
        """Intra-op threads of each CPU compute stream: ``DTORCH_THREADS`` or a fair share of the cores."""
        fixed = env.threads_per_device()
        if fixed > 0:
            return fixed
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores // self.devices_per_process)

    def stream(self, device: Device, stream_type: StreamType) -> KernelStream:
        """The stream of (device, type), created on first use."""
        key = (device, stream_type)
        s = self._streams.get(key)
        if s is not None:
            return s
        if not isinstance(stream_type, StreamType):
            raise ArgumentError(f"StreamManager.stream: expected a StreamType, got {stream_type!r}")
        with self._lock:
            s = self._streams.get(key)
            if s is None:
                cls = CudaKernelStream if device.type == "cuda" else KernelStream
                threads = self.compute_threads() if stream_type is StreamType.COMPUTE else 1
                s = self._streams[key] = cls(device, stream_type, threads, self.tracer)
        return s

    @property
    def streams(self) -> list[KernelStream]:
        return list(self._streams.values())

    def set_tracer(self, tracer: Any) -> None:
        self.tracer = tracer
        for s in self.streams:
            s.tracer = tracer

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait for every stream; raises ``SyncTimeout`` listing what is still in flight on each."""
        limit = env.sync_timeout() if timeout is None else timeout
        events = [(s, s.record()) for s in self.streams]
        deadline = time.monotonic() + limit
        late = [s for s, ev in events if not ev.flag.wait(max(0.0, deadline - time.monotonic()))]
        if late:
            raise SyncTimeout(f"synchronize: waited {limit:g}s; still in flight: " + self.describe_pending(late))

    def describe_pending(self, streams: list[KernelStream] | None = None) -> str:
        parts = []
        for s in streams if streams is not None else self.streams:
            labels = [x for x in s.pending() if x != "record event"]
            if labels:
                shown = ", ".join(labels[:4]) + (f", ... ({len(labels) - 4} more)" if len(labels) > 4 else "")
                parts.append(f"{s.name}: [{shown}]")
        return "; ".join(parts) or "nothing (the streams finished just now)"

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop and join every stream thread."""
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            s.closing = True
        for s in streams:
            s.close(timeout)


@atexit.register
def _shutdown_all() -> None:
    for m in list(_MANAGERS):
        m.shutdown(timeout=1.0)
