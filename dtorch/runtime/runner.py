"""``Runner``: runs a ``LogicalGraph`` many times, its kernels built once (``dtorch.runtime.program``).

Run: feeds are placed, the program is pushed (pushing never blocks), all streams are synchronized once,
and the first failure is raised naming its op, device and stream. With ``static=True`` every tensor is
bound to a buffer planned at build (``dtorch.runtime.plan``): a run allocates nothing, views cost
nothing, and fed inputs are copied into their buffers on each device's compute stream. With ``capture=True`` as
well, only capture-safe kernels are bound, and from the second run on the whole run is one recorded replay (a CUDA
graph on a GPU; ``dtorch.runtime.capture``, which holds the capture state); ``capture_off`` says why a Runner
cannot capture. A static plan of one CPU compute stream runs on the caller's thread, and, untraced and with host
reads allowed, calls its kernels straight from one loop (``Program.calls``): ``Runner.run`` -> the kernel, no stream,
segment or kernel object between them.
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from dtorch.core import env, hostsync
from dtorch.core.dtypes import dtype_name
from dtorch.core.errors import (
    ArgumentError,
    DeviceError,
    DtorchError,
    DTypeError,
    LayoutError,
    ShapeError,
    SyncTimeout,
)
from dtorch.core.placement import Replicate
from dtorch.dispatch import dispatcher as _global_dispatcher
from dtorch.dispatch.registry import Dispatcher
from dtorch.graph.logical import LogicalGraph
from dtorch.graph.operand import Operand
from dtorch.runtime.blob import Blob, DistTensor, device_piece, local_piece, record_use
from dtorch.runtime.capture import NOT_ASKED, Capture, Recorder
from dtorch.runtime.comm import Communicator, default_communicator
from dtorch.runtime.kernel import RunState
from dtorch.runtime.plan import SharedBuffers
from dtorch.runtime.program import Program
from dtorch.runtime.stream import StreamManager, StreamType
from dtorch.runtime.tracing import Tracer

KEPT_COPIES = 2  # copies of an output kept for reuse (``Runner._copy_out``)


def _seconds(where: str, value: object) -> float:
    """A timeout in seconds: a finite number > 0 (not a string, a bool, inf or NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ArgumentError(f"{where}: 'timeout' must be a finite number of seconds > 0, got {value!r}")
    return float(value)


class _Feed:
    """Copies one fed input's piece into its static buffer, first thing on the device's compute stream."""

    __slots__ = ("pairs", "label")
    traced = False

    def __init__(self, label: str) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.label = label

    def execute(self, stream: Any, state: RunState | None) -> None:
        try:
            for dst, src in self.pairs:
                dst.copy_(src, non_blocking=True)
                record_use(src)  # src was made on the caller's stream and is read on this one
        except BaseException as exc:  # noqa: BLE001 - reported at the next synchronization
            if state is None or stream is None:
                raise
            state.abort()
            state.error = state.error or DtorchError(f"copying the feeds on {stream.name} failed: {exc}")
        finally:
            self.pairs = []


class Runner:
    """Runs ``graph`` on its mesh: ``Runner(g).run({"x": x_full}) -> {"y": full tensor}``.

    ``communicator``: default the in-process one for this process's devices; ``release=False`` keeps
    every Blob (for comparison); ``trace=True`` (or DTORCH_TRACE) records each kernel's start and end;
    ``timeout`` bounds each synchronization (default DTORCH_SYNC_TIMEOUT); ``streams``: a ``StreamManager``
    shared with other Runners (its threads outlive this Runner); ``static``: plan every buffer at build;
    ``capture`` (with ``static``): bind capture-safe kernels only, run the first run as usual and replay a recording
    of it afterwards (``recorder``: default a CUDA graph recorder on a GPU; where nothing can record, or a kernel is
    not capture-safe, the Runner runs uncaptured and ``capture_off`` holds the reason); a ``Capture`` instead of True
    is shared with other Runners (one recorder: one memory pool for their recordings). ``buffers`` (with ``static``):
    global device id -> ``SharedBuffers`` shared with other static Runners that never run at the same time as this
    one; its buffers are carved from them instead of allocated.
    """

    def __init__(self, graph: LogicalGraph, communicator: Communicator | None = None, *, release: bool = True,
                 trace: bool | None = None, timeout: float | None = None,
                 dispatcher: Dispatcher | None = None, streams: StreamManager | None = None,
                 static: bool = False, capture: bool | Capture = False, recorder: Recorder | None = None,
                 buffers: Mapping[int, SharedBuffers] | None = None) -> None:
        if not isinstance(graph, LogicalGraph):
            raise ArgumentError(f"Runner: expected a LogicalGraph, got {type(graph).__name__}")
        if not graph.outputs and not any(node.op == "send" for node in graph.operators):  # a stage sends its result
            raise ArgumentError("Runner: the graph has no outputs (mark results with graph.output(name, x))")
        self.graph = graph
        self.mesh = graph.mesh
        self.static = static
        if buffers is not None and not static:
            raise ArgumentError("Runner: 'buffers' are shared static buffers; pass static=True with them")
        self.timeout = env.sync_timeout() if timeout is None else _seconds("Runner", timeout)
        self.comm = communicator if communicator is not None else default_communicator(self.mesh.ids, self.timeout)
        self.local_ids = self.mesh.local_ids(self.comm.process)
        # the streams a run waits for: its own devices' (another Runner on the shared streams may be running a
        # pipeline's other stage meanwhile)
        self._devices = frozenset(self.mesh.device(i) for i in self.local_ids)
        # one CPU holds the whole graph: a run copies its feeds straight into their buffers (_place_feeds)
        self._one_cpu = (self.mesh.size == 1 and len(self.local_ids) == 1
                         and self.mesh.device(self.local_ids[0]).type == "cpu")
        self._feed_buffers: dict[str, tuple[torch.Tensor, Any]] | None = None  # feed_buffers(), made once
        if isinstance(capture, bool):
            capture = Capture(self.mesh.device(self.local_ids[0]), recorder) if capture else Capture(off=NOT_ASKED)
        elif not isinstance(capture, Capture):
            raise ArgumentError(f"Runner: 'capture' must be a bool or a Capture, got {capture!r}")
        self._owns_streams = streams is None
        self._closed = False
        if streams is None:
            self.manager = StreamManager(len(self.local_ids))
            self._finalizer = weakref.finalize(self, self.manager.shutdown)  # a dropped Runner leaves no threads
            self.tracer = Tracer() if (env.trace() if trace is None else trace) else None
            self.manager.set_tracer(self.tracer)
        else:
            self.manager = streams
            self._finalizer = weakref.finalize(self, lambda: None)
            self.tracer = streams.tracer
        self._lock = threading.Lock()
        self._dirty = False
        # the copies of outputs handed out (_copy_out), shared by the Runners of the same buffers (one runs at a time)
        self._outs = buffers[self.local_ids[0]].outputs if buffers else {}
        self.program = Program(graph, self.comm, self.local_ids, self.manager, dispatcher or _global_dispatcher,
                               release=release, static=static, capture=capture.off is None, shared=buffers)
        self.manager.after_caller()  # the streams start after the params' copies to their devices
        self.blobs = self.program.blobs  # (operand index, global id) -> Blob
        self.kernels = self.program.kernels
        self.buffer_bytes = self.program.buffer_bytes  # bytes of the static plan's buffers, all local devices
        self.capture = capture.runner(self.program.capture_blocker)

    @property
    def capture_off(self) -> str | None:
        """Why this Runner's runs are not recorded; None when they are."""
        return self.capture.off

    @property
    def captured(self) -> bool:
        """True once the runs are replays of a recording."""
        return self.capture.captured

    # -- run -----------------------------------------------------------------------------------

    def run(self, feeds: Mapping[str, torch.Tensor] | None = None, return_dist: bool = False,
            timeout: float | None = None, borrow: bool = False) -> dict[str, Any]:
        """Run once; returns {output name: full tensor} (or ``DistTensor`` with ``return_dist=True``; with a
        static plan its pieces are the plan's buffers, valid until the next run).

        ``timeout`` (seconds, default the Runner's) bounds the run's synchronization and every collective of
        it. A run after a failed or timed-out one first waits (within ``timeout``) for the kernels the earlier
        run left running, so that none of them touches this run's tensors; a ``SyncTimeout`` says so if they
        are still stuck (then ``shutdown()`` and build a new Runner). ``borrow``: a static plan on one CPU hands
        out its output buffers themselves, not copies (``_copy_out``), for a caller done with them before the next
        run of a Runner on these buffers (the engine samples a step's logits before it starts the next step)."""
        limit = self.timeout if timeout is None else _seconds("Runner.run", timeout)
        if self._closed:
            raise DtorchError("Runner.run: this Runner was shut down and its streams are gone; build a new "
                              "Runner(graph) to run the graph again")
        feeds = dict(feeds or {})
        self._check_feeds(feeds)
        with self._lock:
            if self._dirty:
                self._drain(limit)
                self.comm.reset()
                self._dirty = False
            self.comm.set_timeout(limit)
            if self.capture.replays:
                return self._run_recorded(feeds, return_dist, borrow)
            state = RunState(self.comm)
            self._place_feeds(feeds, state)
            inline = self.program.inline
            here = inline is not None and not inline.in_flight
            if here and inline.tracer is None and not hostsync.ON:
                self._call_kernels(inline, state)
            elif here:  # traced, or host reads forbidden: each kernel as its stream runs it
                self._run_inline(inline, state)
            else:
                self.manager.after_caller(state)  # after the feeds' copies and the caller's reads of the last results
                self._push(state)
            if here and self.manager.idle():  # nothing is left on any stream: no round trip to a stream thread
                return self._finish(state, return_dist, borrow)
            try:
                self.manager.synchronize(limit, self._devices)
            except SyncTimeout:
                state.abort()
                self._dirty = True
                raise
            return self._finish(state, return_dist, borrow)

    def _finish(self, state: RunState, return_dist: bool, borrow: bool = False) -> dict[str, Any]:
        """The end of a run whose kernels are all done: its first failure raised, else its results."""
        if state.error is not None:
            self._dirty = True
            raise state.error
        self.capture.warm = True
        return self._results(return_dist, borrow)

    def _run_recorded(self, feeds: dict[str, torch.Tensor], return_dist: bool = False,
                      borrow: bool = False) -> dict[str, Any]:
        """Copy the feeds into their buffers and replay the recording (made now on the first call) on the caller's
        stream, which the next uncaptured run of any Runner on these streams waits for (``after_caller``)."""
        i = self.local_ids[0]
        for name, x in self.graph.inputs.items():  # one device: each feed is whole; copied as it is, no host wait
            self.blobs[(x.index, i)].tensor.copy_(feeds[name], non_blocking=True)
        self.capture.replay(self._issue)
        return self._results(return_dist, borrow)

    def _issue(self) -> None:
        """Every kernel of the program, in order, on the calling thread's current stream (what a recording holds)."""
        for _, _, segment in self.program.items:
            for k in segment.kernels:
                k.run()

    def _drain(self, limit: float) -> None:
        """Wait for what an earlier failed or timed-out run left on the streams (its kernels are skipped, but one
        still running would free or overwrite this run's blobs when it ends)."""
        try:
            self.manager.synchronize(limit, self._devices)
        except SyncTimeout as exc:
            raise SyncTimeout(f"Runner.run: a kernel of an earlier run that timed out is still running after "
                              f"{limit:g}s more ({self.manager.describe_pending()}); this run did not start. Run "
                              f"again once it ends, or shutdown() this Runner and build a new one") from exc

    def _call_kernels(self, stream: Any, state: RunState) -> None:
        """Call the program's kernels here, in order, each straight from this loop (``Program.calls``: one CPU
        stream, static buffers, nothing to trace or check); the first failure lands in ``state`` as it would on
        ``stream``, and the kernels after it do not run."""
        program, k, under = self.program, None, self.program.generations()
        try:
            if program.bound is not None and program.bound_under == under:
                for k, fn in program.bound:  # noqa: B007 - k names a failure. Each call bound once: no lookup in Python
                    fn()
                return
            for k, prepared, ctx, ins, outs in program.calls:
                if prepared is None:
                    k.run()
                else:
                    prepared.fn(ctx, ins, outs)
        except BaseException as exc:  # noqa: BLE001 - raised by run() after the synchronization, as on a stream
            state.fail(k, stream, exc)
            return
        if program.generations() == under:  # a whole run, no re-bind during it: every kernel past its first call
            program.bind_calls(under)

    def _run_inline(self, stream: Any, state: RunState) -> None:
        """Execute the program's items here, in order, as ``stream``'s thread would (failures land in ``state``)."""
        for _, _, item in self.program.items:
            stream.execute(item, state)

    def _place_feeds(self, feeds: dict[str, torch.Tensor], state: RunState) -> None:
        n = self.mesh.size
        if not self.static:
            for b in self.blobs.values():
                b.reset()
            for name, x in self.graph.inputs.items():
                for i in self.local_ids:
                    self.blobs[(x.index, i)].tensor = device_piece(feeds[name], x.placement, self.mesh.rank(i), n,
                                                                   self.mesh.device(i))
            return
        if self._one_cpu:  # each feed whole, copied here (one given as its own buffer: written there already)
            i = self.local_ids[0]
            for name, x in self.graph.inputs.items():
                buffer, feed = self.blobs[(x.index, i)].tensor, feeds[name]
                if feed is not buffer:
                    buffer.copy_(feed)
            return
        for i in self.local_ids:
            device = self.mesh.device(i)
            feed = _Feed(f"feeds on {device}")
            for name, x in self.graph.inputs.items():
                # the piece as the caller gave it (on the host, usually): copied into the buffer on the stream, with
                # no host wait (a .to(device) here would block the caller on a GPU until the copy is done)
                feed.pairs.append((self.blobs[(x.index, i)].tensor,
                                   local_piece(feeds[name], x.placement, self.mesh.rank(i), n)))
            if not feed.pairs:
                continue
            if device.type == "cpu":  # every stream is idle between runs: copy here, no hand-off
                feed.execute(None, state)
                continue
            # on a GPU the copies are ordered on the compute stream; the communicate stream waits for them
            compute = self.manager.stream(device, StreamType.COMPUTE)
            ready = compute.caller_event()  # the pieces above were made on the caller's stream
            if ready is not None:
                compute.wait(ready, state)
            compute.push(feed, state)
            if any(s.device == device and s.type is StreamType.COMMUNICATE for s in self.manager.streams):
                self.manager.stream(device, StreamType.COMMUNICATE).wait(compute.record(state), state)

    def _push(self, state: RunState) -> None:
        events: list[Any] = [None] * self.program.slots
        for what, stream, item in self.program.items:
            if what == "push":
                stream.push(item, state)
            elif what == "record":
                events[item] = stream.record(state)
            else:
                stream.wait(events[item], state)

    def _results(self, return_dist: bool, borrow: bool = False) -> dict[str, Any]:
        return {name: self._result(name, x, return_dist, borrow) for name, x in self.graph.outputs.items()}

    def _result(self, name: str, x: Operand, return_dist: bool, borrow: bool = False) -> Any:
        if not return_dist and len(self.local_ids) == 1 and isinstance(x.placement, Replicate):
            # one device's whole tensor (a step's logits): no DistTensor to build around it
            t = self.blobs[(x.index, self.local_ids[0])].tensor
            if t is not None:
                record_use(t)
                return self._copy_out(name, t) if self.static and not (borrow and self._one_cpu) else t
        blobs = {i: Blob(self.mesh.device(i), tensor=record_use(self.blobs[(x.index, i)].tensor))
                 for i in self.local_ids}
        dt = DistTensor(self.mesh, x.placement, x.shape, x.dtype, blobs)
        if return_dist:
            return dt
        full = dt.full()
        return self._copy_out(name, full) if self.static and any(full is b.tensor for b in blobs.values()) else full

    def _copy_out(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """A copy of output ``name`` (the next run writes over the static buffer ``full``): into a copy kept from an
        earlier run that nothing holds (or a view of) any more, else a new tensor, kept too. A new tensor is fresh
        pages, which cost ~1-10 us each to touch on a VM: up to ~10 ms a step for 16 sequences' logits over a
        vocabulary of 152k (~1 ms for 8 of 49k). Two copies of the latest shape are kept: a pipeline's caller still
        holds one micro-batch's logits while its last stage copies out the next one's. The caller gets an alias of
        the kept copy, so the storage's use count says whether any caller still holds it (no Python reference
        counting involved)."""
        kept = self._outs.setdefault(name, [])
        for keep in kept:
            if (keep.shape == full.shape and keep.dtype == full.dtype and keep.device == full.device
                    and _storage_users(keep) == 1):
                keep.copy_(full)
                return keep.detach()
        keep = full.clone()
        # the new copy and the latest one of its shape (another shape's copies go: a big prompt's logits not kept)
        kept[:] = [keep] + [k for k in kept if k.shape == keep.shape and k.dtype == keep.dtype][:KEPT_COPIES - 1]
        return keep.detach()

    def feed_buffers(self) -> dict[str, tuple[torch.Tensor, Any]] | None:
        """{input name: (its buffer, a numpy view of it)} where a run would copy each feed into a buffer on the host (a
        static plan on one CPU), else None. A caller may write a feed's values into its buffer and pass the buffer
        itself as that feed: the run then copies nothing for it (a decode step's few feeds, written with numpy, skip a
        dozen torch calls that each cost ~10-100 us right after a step has streamed the weights through the caches).
        The buffers stay where they are for the Runner's life. None too while host reads are forbidden (numpy views
        count as reads there: such a run takes the checked path, feeds included)."""
        if not (self.static and self._one_cpu) or hostsync.ON or hostsync.forbidding():
            return None
        if self._feed_buffers is None:
            i = self.local_ids[0]
            tensors = {name: self.blobs[(x.index, i)].tensor for name, x in self.graph.inputs.items()}
            self._feed_buffers = {name: (t, t.numpy()) for name, t in tensors.items()}
        return self._feed_buffers

    def _check_feeds(self, feeds: dict[str, torch.Tensor]) -> None:
        want = self.graph.inputs
        missing, extra = sorted(set(want) - set(feeds)), sorted(set(feeds) - set(want))
        if missing or extra:
            raise ArgumentError(f"Runner.run: feeds must be exactly {sorted(want)}; missing {missing}, unknown {extra}")
        for name, t in feeds.items():
            x = want[name]
            if not isinstance(t, torch.Tensor):
                raise DTypeError(f"Runner.run: feed {name!r} must be a torch.Tensor, got {type(t).__name__}")
            if t.layout is not torch.strided:
                raise LayoutError(f"Runner.run: feed {name!r} is a {t.layout} tensor; the graph's kernels take dense "
                                  "(strided) tensors (pass t.to_dense())")
            if t.is_meta:
                raise DeviceError(f"Runner.run: feed {name!r} is a meta tensor (a shape without data); feed a tensor "
                                  "that holds values")
            if tuple(t.shape) != x.shape:
                raise ShapeError(f"Runner.run: feed {name!r} must have shape {list(x.shape)}, got {list(t.shape)}")
            if t.dtype != x.dtype:
                raise DTypeError(f"Runner.run: feed {name!r} must have dtype {dtype_name(x.dtype)}, "
                                 f"got {dtype_name(t.dtype)}")

    # -- lifetime ------------------------------------------------------------------------------

    def synchronize(self, timeout: float | None = None) -> None:
        self.manager.synchronize(self.timeout if timeout is None else timeout, self._devices)

    def shutdown(self, timeout: float = 5.0) -> list[str]:
        """Join every stream thread this Runner owns, within ``timeout`` seconds in all; the Runner cannot run
        afterwards. Returns the threads still running a stuck kernel then (also warned about): they are
        abandoned as daemon threads and end when their kernel returns."""
        self._closed = True
        if self._finalizer.detach() is None or not self._owns_streams:
            return []
        abandoned = self.manager.shutdown(_seconds("Runner.shutdown", timeout))
        if abandoned:
            warnings.warn(f"Runner.shutdown: abandoned stream thread(s) still running after {timeout:g}s: "
                          f"{'; '.join(abandoned)}", RuntimeWarning, stacklevel=2)
        return abandoned

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Runner({len(self.kernels)} kernels on {len(self.manager.streams)} streams, {self.mesh})"


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (``t``, its aliases and views; a numpy array holds its tensor): torch's
    count less this call's own reference; a large number where this torch lacks the count, so that nothing is
    reused."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count(t.untyped_storage()._cdata) - 1 if count is not None else 1 << 30
