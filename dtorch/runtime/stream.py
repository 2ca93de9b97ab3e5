"""``KernelStream``: kernels of one (device, stream type), run in order on a dedicated thread.

A CPU stream is a queue served by one daemon thread; a CUDA stream is the same thread issuing onto a
``torch.cuda.Stream``. ``push`` returns at once; ``record()`` / ``wait(event)`` keep order across streams
without blocking the host; ``synchronize(timeout)`` waits for everything pushed so far, on the device
too: a CUDA kernel has only been *enqueued* when its host item ends, so the wait also polls a CUDA event
recorded at the sync point, within the same timeout. ``after_caller()`` makes the streams wait for the
work the calling thread queued on its own current CUDA streams (feeds and params copied there).
``StreamManager`` makes one stream per (device, stream type) on first use and joins them all in
``shutdown()`` (also at interpreter exit).

Threads: each CPU compute stream sets its own intra-op thread count (``torch.set_num_threads`` in the
stream thread sets that thread's OpenMP team size) to a fair share of the creating thread's
``torch.get_num_threads()`` over the process's devices; communicate streams use one thread.
"""

from __future__ import annotations

import atexit
import enum
import queue
import threading
import time
import weakref
from collections import deque
from typing import Any

import torch

from dtorch.core import env, hostsync
from dtorch.core.device import Device
from dtorch.core.errors import ArgumentError, DtorchError, SyncTimeout
from dtorch.core.sync import Flag, leave_signals_to_main


class StreamType(enum.Enum):
    COMPUTE = "compute"
    COMMUNICATE = "communicate"


class Event:
    """A point in a stream: ``flag`` is set when the stream's thread reaches it; ``device_event`` (CUDA: a
    ``torch.cuda.Event``, else None) completes when the device has run the work enqueued before it."""

    __slots__ = ("flag", "device_event")

    def __init__(self) -> None:
        self.flag = Flag()
        self.device_event: Any = None

    def wait(self, deadline: float) -> bool:
        """Block until the point is reached on the host and on the device, or ``deadline`` (``time.monotonic``)
        passes; True when reached. The device event is polled (``query``) with a pause growing to 0.25 ms
        (a decode step is a few ms: a longer pause would show), because ``Event.synchronize`` has no timeout."""
        if not self.flag.wait(max(0.0, deadline - time.monotonic())):
            return False
        ev = self.device_event
        if ev is None:
            return True
        pause = 2e-5
        while not ev.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 2.5e-4)
        return True


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
        if self.closing:
            raise DtorchError(f"stream {self.name} is shut down and runs nothing more; build a new Runner "
                              f"(or StreamManager) for more work")
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
        """Wait for everything pushed so far, on the device too; False if ``timeout`` seconds passed first."""
        deadline = time.monotonic() + (env.sync_timeout() if timeout is None else timeout)
        return self.record().wait(deadline)

    def caller_event(self) -> Event | None:
        """An event (already set on the host) at the current end of the calling thread's work on this
        stream's device, or None when that work is already done (CPU: the caller ran it synchronously)."""
        return None

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
        """Hook for device streams: set ``event.device_event`` at this point of the device's queue."""

    def _wait_device(self, event: Event) -> None:
        """Hook for device streams: the device runs later work of this stream after ``event.device_event``."""

    def _loop(self) -> None:
        leave_signals_to_main()
        self._setup_thread()
        get, done = self._queue.get, self.in_flight.popleft
        while True:
            item, state = get()
            if item is None:
                break
            self.execute(item, state)
            done()
            item = state = None  # release the kernel's references right after it ran

    def execute(self, item: Any, state: Any) -> None:
        """Run ``item`` as this stream does (traced when a tracer is set); the stream's thread calls this, and so
        does a Runner that executes a one-device plan inline on the caller's thread."""
        if hostsync.ON:  # DTORCH_FORBID_SYNC, or a forbid_host_sync() region open in any thread: cover this one
            with hostsync.forbid_host_sync():
                return self._execute(item, state)
        self._execute(item, state)

    def _execute(self, item: Any, state: Any) -> None:
        tracer = self.tracer
        if tracer is None or not getattr(item, "traced", True):
            item.execute(self, state)
            return
        t0 = time.perf_counter_ns()
        item.execute(self, state)
        tracer.add(self, item.label, t0, time.perf_counter_ns())

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
    """A dedicated thread issuing kernels onto its own ``torch.cuda.Stream``.

    Checked on a GPU by ``bench/device_check.py`` only; the CPU tests drive the same hooks through a fake.
    """

    def __init__(self, device: Device, stream_type: StreamType, threads: int = 1, tracer_ref: Any = None) -> None:
        self.cuda_stream = torch.cuda.Stream(device=device.torch)
        super().__init__(device, stream_type, threads, tracer_ref)

    def _setup_thread(self) -> None:
        torch.cuda.set_device(self.device.torch)
        torch.cuda.set_stream(self.cuda_stream)

    def _record_device(self, event: Event) -> None:
        event.device_event = self.cuda_stream.record_event()

    def _wait_device(self, event: Event) -> None:
        if event.device_event is not None:
            self.cuda_stream.wait_event(event.device_event)

    def caller_event(self) -> Event | None:
        ev = Event()
        ev.device_event = torch.cuda.current_stream(self.device.torch).record_event()
        ev.flag.set()
        return ev


# The stream class of each device type (a table, so that tests can put a fake device stream in it).
STREAM_CLASSES: dict[str, type[KernelStream]] = {"cpu": KernelStream, "cuda": CudaKernelStream}


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
        """Intra-op threads of each CPU compute stream: a fair share of the threads the creating thread has
        (``torch.set_num_threads``; ``LLM(threads=)``, the CLI's ``--threads``) among this process's devices."""
        return max(1, torch.get_num_threads() // self.devices_per_process)

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
                cls = STREAM_CLASSES[device.type]
                threads = self.compute_threads() if stream_type is StreamType.COMPUTE else 1
                s = self._streams[key] = cls(device, stream_type, threads, self.tracer)
        return s

    @property
    def streams(self) -> list[KernelStream]:
        return list(self._streams.values())

    def __repr__(self) -> str:
        return f"StreamManager({', '.join(s.name for s in self.streams) or 'no streams yet'})"

    def set_tracer(self, tracer: Any) -> None:
        self.tracer = tracer
        for s in self.streams:
            s.tracer = tracer

    def idle(self) -> bool:
        """Whether a ``synchronize`` now would find everything done without waiting: every stream is a CPU stream
        (whose work ends with its host item) with no item queued or running. A caller that ran its work on its
        own thread skips the round trip to each stream's thread then."""
        return all(s.device.type == "cpu" and not s.in_flight for s in self.streams)

    def after_caller(self, state: Any = None) -> None:
        """Later items of every stream run on the device after the work the calling thread has queued so far
        on its current streams (a feed or param copied to a GPU there); the host does not block. No-op on CPU."""
        for s in self.streams:
            ev = s.caller_event()
            if ev is not None:
                s.wait(ev, state)

    def synchronize(self, timeout: float | None = None, devices: frozenset[Device] | None = None) -> None:
        """Wait for every stream (``devices``: those of these devices only: a pipeline stage's, while the other
        stages run on), host and device; raises ``SyncTimeout`` listing what is still in flight.

        Afterwards every result is complete in memory, so the caller may read it on any stream."""
        limit = env.sync_timeout() if timeout is None else timeout
        events = [(s, s.record()) for s in self.streams if devices is None or s.device in devices]
        deadline = time.monotonic() + limit
        late = [(s, ev) for s, ev in events if not ev.wait(deadline)]
        if late:
            host = self.describe_pending([s for s, ev in late if not ev.flag.is_set()], quiet=True)
            device = [s.name for s, ev in late if ev.flag.is_set()]
            gpu = f"device still running enqueued kernels on {', '.join(device)}" if device else ""
            raise SyncTimeout(f"synchronize: waited {limit:g}s; still in flight: "
                              + ("; ".join(p for p in (host, gpu) if p) or self.describe_pending()))

    def describe_pending(self, streams: list[KernelStream] | None = None, quiet: bool = False) -> str:
        """What each stream still has queued or running ("" with ``quiet`` when nothing is)."""
        parts = []
        for s in streams if streams is not None else self.streams:
            labels = [x for x in s.pending() if x != "record event"]
            if labels:
                shown = ", ".join(labels[:4]) + (f", ... ({len(labels) - 4} more)" if len(labels) > 4 else "")
                parts.append(f"{s.name}: [{shown}]")
        return "; ".join(parts) or ("" if quiet else "nothing (the streams finished just now)")

    def shutdown(self, timeout: float = 5.0) -> list[str]:
        """Stop and join every stream thread, all within ``timeout`` seconds; returns "thread name (running
        kernel)" of each thread still running then (a stuck kernel), left behind as a daemon thread."""
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            s.closing = True
        deadline = time.monotonic() + timeout
        abandoned = []
        for s in streams:
            if not s.close(max(0.0, deadline - time.monotonic())):
                running = next(iter(s.pending()), "?")
                abandoned.append(f"{s._thread.name} (running {running})")
        return abandoned


@atexit.register
def _shutdown_all() -> None:
    for m in list(_MANAGERS):
        m.shutdown(timeout=1.0)
