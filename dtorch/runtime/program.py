"""``Program``: a ``LogicalGraph`` built once for the local devices of its mesh, ready for a ``Runner`` to push.

Build: one Blob per (operand, local device); params and states placed once (a placed ``DistTensor`` is used as it
is, so several graphs share one copy of the weights and of the KV cache); one Kernel per (operator, local device)
with its kernel bound through the Dispatcher and its stream chosen. With ``static=True`` every tensor is bound to a
buffer planned here (``dtorch.runtime.plan``), so a run allocates nothing. Schedule: runs of kernels of one stream
with no waits between them become one ``Segment`` (one queue hand-off), with an event recorded after each kernel
that another stream waits for. Nothing here runs a kernel; ``dtorch.runtime.runner`` does.

Streams of collectives: on a CPU a stream is a thread, so a collective on the communicate stream costs two thread
hand-offs (compute -> communicate -> compute), each a wake-up of a sleeping thread (~20-100 us on a VM). When no
collective of the graph has a compute kernel that could run while it runs (``nothing_to_overlap``: a tensor-parallel
step, where each all-reduce's result is the next kernel's input), every collective of a CPU device runs on its compute
stream instead: no hand-off, and a one-device-per-process plan (a rank under torchrun) then runs whole on the caller's
thread. All or none: collectives of one device must reach the communicator in graph order.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dtorch.core.errors import DtorchError, KernelNotFound
from dtorch.core.memory import MemoryKind
from dtorch.dispatch.key import KernelKey
from dtorch.dispatch.meta import Call
from dtorch.dispatch.prepared import PreparedKernel
from dtorch.dispatch.registry import Dispatcher
from dtorch.graph.logical import COLLECTIVES, LogicalGraph
from dtorch.graph.operand import COMMUNICATE, Operator
from dtorch.runtime.blob import Blob, DistTensor, device_piece, mark_cross_stream_reads
from dtorch.runtime.comm import Communicator
from dtorch.runtime.kernel import (
    CollectiveKernel,
    DispatchKernel,
    Kernel,
    LocalKernel,
    PythonKernel,
    Segment,
    ViewKernel,
    check_dense,
)
from dtorch.runtime.plan import BufferPlan, Pool, SharedBuffers
from dtorch.runtime.stream import KernelStream, StreamManager, StreamType

# one item of the push program: ("push", stream, Segment), ("record", stream, event slot) or ("wait", stream, slot)
Item = tuple[str, KernelStream, Any]
# one kernel of an inline program as a bare call: (kernel, its PreparedKernel, ctx, inputs, outputs), run as
# ``prepared.fn(ctx, inputs, outputs)``; (kernel, None, None, None, None) for a kernel that is not a bound
# DispatchKernel (a user's Python function, a slice), run as ``kernel.run()``
BareCall = tuple[Kernel, PreparedKernel | None, Any, Any, Any]


class Program:
    """The kernels of ``graph`` on the devices ``local_ids`` of its mesh, and the order to push them in.

    ``blobs``: (operand index, global device id) -> Blob; ``kernels``: in graph order; ``items``: the push program
    (``Item``) with ``slots`` event slots; ``inline``: the stream a run may execute on the caller's thread, or None;
    ``calls``: with ``inline``, its kernels as bare calls (``BareCall``), else None;
    ``buffer_bytes``: bytes of the static plan's buffers, all local devices; ``blockers``: kernel key -> operators
    with no capture-safe kernel for it (``capture=True`` binds capture-safe kernels where there are some).
    ``shared`` (with ``static``): global device id -> ``SharedBuffers`` the buffers are carved from.
    """

    def __init__(self, graph: LogicalGraph, comm: Communicator, local_ids: tuple[int, ...] | list[int],
                 streams: StreamManager, dispatcher: Dispatcher, *, release: bool, static: bool, capture: bool,
                 shared: Mapping[int, SharedBuffers] | None) -> None:
        self.graph = graph
        self.mesh = graph.mesh
        self.comm = comm
        self.local_ids = local_ids
        self.manager = streams
        self.static = static
        self.capture = capture
        self._dispatcher = dispatcher
        self._shared = shared
        self.blockers: dict[KernelKey, list[str]] = {}
        self.blobs: dict[tuple[int, int], Blob] = {}
        self.kernels: list[Kernel] = []
        self.buffer_bytes = 0
        self._collectives_on_compute = nothing_to_overlap(graph)  # on CPU devices (see the module's docstring)
        self._build(release)
        self.items, self.slots = schedule(self.kernels)
        self.inline = self._inline_stream()
        self.calls = bare_calls(self.kernels) if self.inline is not None else None
        # ``calls`` bound once (``bind_calls``): (kernel, callable of no arguments), with the dispatchers' generations
        # they were bound under
        self.bound: tuple[tuple[Kernel, Callable[[], object]], ...] | None = None
        self.bound_under: tuple[int, ...] = ()
        self._binders = tuple({id(c[1].dispatcher): c[1].dispatcher for c in self.calls or () if c[1]}.values())

    def generations(self) -> tuple[int, ...]:
        """The generations of the dispatchers ``calls`` were prepared by: any change re-binds their kernels."""
        return tuple(d.generation for d in self._binders)

    def bind_calls(self, under: tuple[int, ...]) -> None:
        """Bind ``calls`` (after a whole run of them, so every prepared kernel is past its first call's ABI check):
        each kernel's call on its fixed buffers as a callable of no arguments (``PreparedKernel.bound``), which a run
        uses while ``generations()`` is ``under``, theirs when that run began."""
        self.bound_under = under
        self.bound = tuple((k, k.run if prepared is None else prepared.bound(ctx, ins, outs))
                           for k, prepared, ctx, ins, outs in self.calls or ())

    # -- build ---------------------------------------------------------------------------------

    def _build(self, release: bool) -> None:
        g, n = self.graph, self.mesh.size
        pinned = {x.index for x in g.outputs.values()} | {x.index for x, _ in g.params.values()}
        pinned |= {x.index for x, _ in g.states.values()}
        if self.static:
            pinned |= {x.index for x in g.operands}
        for x in g.operands:
            for i in self.local_ids:
                kind = MemoryKind.PERSISTENT if x.index in pinned and x.producer is None else MemoryKind.ACTIVATION
                self.blobs[(x.index, i)] = Blob(self.mesh.device(i), kind, pinned=x.index in pinned or not release)
        states = {x.index for x, _ in g.states.values()}
        for x, value in list(g.params.values()) + list(g.states.values()):
            seen: set[int] = set()
            for i in self.local_ids:
                piece = value.local(i) if isinstance(value, DistTensor) else \
                    device_piece(value, x.placement, self.mesh.rank(i), n, self.mesh.device(i))
                if x.index in states and id(piece) in seen:  # a replicated state: each device updates its own copy
                    piece = piece.clone()
                seen.add(id(piece))
                self.blobs[(x.index, i)].tensor = piece
        plan = BufferPlan(g) if self.static else None
        carvers = {i: self._shared[i].carver() if self._shared is not None else None for i in self.local_ids}
        pools = {i: Pool(self.mesh.device(i), carvers[i]) for i in self.local_ids}
        # buffers communicate streams write (carved by the same cursor: never the bytes of another buffer of the run)
        comm_pools = {i: Pool(self.mesh.device(i), carvers[i]) for i in self.local_ids}
        if plan is not None:
            for x in g.inputs.values():
                for i in self.local_ids:
                    self.blobs[(x.index, i)].tensor = pools[i].take(x.local_shapes[i], x.dtype, f"input {x.name!r}")
        by_output: dict[tuple[int, int], Kernel] = {}
        for k, node in enumerate(g.operators):
            for i in self.local_ids:
                kern = self._kernel(node, i)
                if plan is not None:
                    self._place(node, i, kern, pools[i], comm_pools[i], plan, k)
                    for r in plan.frees.get(k, ()):
                        (comm_pools if r in plan.comm else pools)[i].give(self.blobs[(r, i)].tensor, k)
                    if node.kind == "view":
                        continue  # taken once at build: nothing to run
                kern.release = release and not self.static
                kern.seq = len(self.kernels)
                deps = []
                for x in node.inputs:
                    if x is None:
                        continue
                    self.blobs[(x.index, i)].readers += 1
                    producer = by_output.get((x.index, i))
                    if producer is not None and producer.stream is not kern.stream and producer not in deps:
                        producer.record = True
                        deps.append(producer)
                kern.deps = tuple(deps)
                for y in node.outputs:
                    by_output[(y.index, i)] = kern
                self.kernels.append(kern)
            if node.kind == "view" and plan is not None:  # a view's readers wait for the producer of its base
                for i in self.local_ids:
                    base = by_output.get((node.inputs[0].index, i))
                    if base is not None:
                        for y in node.outputs:
                            by_output[(y.index, i)] = base
        self.buffer_bytes = sum(p.nbytes for p in list(pools.values()) + list(comm_pools.values()))
        mark_cross_stream_reads(self.kernels)

    def _place(self, node: Operator, i: int, kern: Kernel, pool: Pool, comm_pool: Pool, plan: BufferPlan,
               k: int) -> None:
        """Bind the static buffers of ``node`` on device ``i`` (its inputs are already bound)."""
        ins = tuple(self.blobs[(x.index, i)].tensor if x is not None else None for x in node.inputs)
        if isinstance(kern, ViewKernel):
            outs = kern.views(ins[0])
        else:
            outs = []
            for j, y in enumerate(node.outputs):
                a = node.aliases[j] if node.aliases else None
                if a is not None:
                    outs.append(ins[a])
                elif y.index in plan.dedicated:
                    outs.append(pool.new(y.local_shapes[i], y.dtype, f"{node.name}'s output"))
                elif y.index in plan.comm:  # written on a communicate stream once it waited for compute op ready[k]
                    outs.append(comm_pool.take(y.local_shapes[i], y.dtype, f"{node.name}'s output",
                                                before=plan.ready.get(k, -1)))
                else:
                    outs.append(pool.take(y.local_shapes[i], y.dtype, f"{node.name}'s output"))
            outs = tuple(outs)
        for y, t in zip(node.outputs, outs, strict=True):
            self.blobs[(y.index, i)].tensor = t
        if isinstance(kern, DispatchKernel):
            if kern.dense:
                check_dense(node, ins, outs)
            kern.fixed = (ins, outs)
        elif not isinstance(kern, ViewKernel):
            kern.fixed_out = outs[0]

    def _kernel(self, node: Operator, i: int) -> Kernel:
        device = self.mesh.device(i)
        stype = StreamType.COMMUNICATE if node.stream == COMMUNICATE else StreamType.COMPUTE
        if node.op in COLLECTIVES and device.type == "cpu" and self._collectives_on_compute:
            stype = StreamType.COMPUTE
        stream = self.manager.stream(device, stype)
        ins = [self.blobs[(x.index, i)] if x is not None else None for x in node.inputs]
        outs = [self.blobs[(y.index, i)] for y in node.outputs]
        out_x = node.outputs[0]
        shape = out_x.local_shapes[i]
        if node.kind == "kernel":
            params = node.local_params[i] if node.local_params else node.params
            return DispatchKernel(node, i, device, ins, outs, stream, self._bind(node, i, params),
                                  [y.local_shapes[i] for y in node.outputs], [y.dtype for y in node.outputs], params)
        if node.kind == "view":
            return ViewKernel(node, i, device, ins, outs, stream, [y.local_shapes[i] for y in node.outputs])
        if node.kind == "python":
            return PythonKernel(node, i, device, ins, outs, stream, node.fn, shape, out_x.dtype)
        if node.kind == "collective":
            return CollectiveKernel(node, i, device, ins, outs, stream, self.comm, shape, out_x.dtype)
        return LocalKernel(node, i, device, ins, outs, stream, self.mesh.rank(i), self.mesh.size)

    def _bind(self, node: Operator, i: int, params: Any) -> PreparedKernel:
        """The kernel for (op, device type, dtype of the first input), chosen once with the call's static facts."""
        device = self.mesh.device(i)
        first = next((x for x in node.inputs if x is not None), node.outputs[0])  # creation ops: the output
        metas = [torch.empty(x.local_shapes[i], dtype=x.dtype, device="meta") if x is not None else None
                 for x in node.inputs]
        key = KernelKey(node.op, device.type, first.dtype, node.layout)
        call = Call(device, first.dtype, params, metas)
        try:
            if self.capture:
                try:
                    return PreparedKernel(self._dispatcher, key, call._replace(capture=True))
                except KernelNotFound:  # bound as usual below; the Runner will not capture
                    self.blockers.setdefault(key, []).append(node.name)
            return PreparedKernel(self._dispatcher, key, call)
        except DtorchError as exc:
            raise type(exc)(f"graph operator {node.name}: {exc}") from exc

    # -- what a run may do ---------------------------------------------------------------------

    def _inline_stream(self) -> KernelStream | None:
        """The one CPU compute stream of a static plan whose program is only pushes to it (one device, nothing to
        overlap), else None. Such a run executes on the caller's thread: no hand-off, and the caller's intra-op
        threads (``torch.set_num_threads``) are the only OpenMP team, so its workers keep spinning between
        kernels instead of sleeping (libgomp throttles spinning once two teams hold more threads than cores:
        decode of the default model at two threads ran at 60 tok/s through a stream thread, 150 inline)."""
        streams = {id(s): s for what, s, _ in self.items}
        if not self.static or len(streams) != 1 or any(what != "push" for what, _, _ in self.items):
            return None
        stream = next(iter(streams.values()))
        if stream.device.type != "cpu" or stream.type is not StreamType.COMPUTE:
            return None
        return stream

    def capture_blocker(self) -> str | None:
        """Why this program's runs cannot be recorded, whatever the recorder; None when nothing here prevents it."""
        if not self.static:
            return "capture needs a static plan (Runner(static=True)): the buffers must be the same every run"
        if self.blockers:
            return "no capture-safe kernel for " + ", ".join(
                f"{key} ({len(names)} operator{'s' if len(names) > 1 else ''}: {names[0]}{', ...' * (len(names) > 1)})"
                for key, names in self.blockers.items())
        streams = {id(s) for _, s, _ in self.items}
        if len(self.local_ids) != 1 or len(streams) != 1 or any(what != "push" for what, _, _ in self.items):
            return (f"capture records one device's compute stream; this plan runs on {len(streams)} streams of "
                    f"{len(self.local_ids)} device(s)")
        other = next((k for k in self.kernels if not isinstance(k, DispatchKernel)), None)
        if other is not None:  # a user's Python function or a collective may read values on the host
            return f"operator {other.operator.name} runs as a {type(other).__name__}, which capture cannot record"
        return None


def nothing_to_overlap(graph: LogicalGraph) -> bool:
    """Whether the graph has collectives (not send/recv) and none of them could overlap a compute kernel: between the
    kernel that makes a collective's input and the first kernel that reads its result (views see through to their
    base) there is no other compute kernel, in graph order (the order a compute stream runs them in)."""
    ops = graph.operators
    root: dict[int, int] = {}  # operand index -> position of the operator whose storage it is (views see through)
    first_read: dict[int, int] = {}  # operand index of a storage root -> first non-view operator reading it
    owner: dict[int, int] = {}  # operand index -> the operand index of its storage root
    for k, node in enumerate(ops):
        for x in node.inputs:
            if x is not None and node.kind != "view":
                first_read.setdefault(owner.get(x.index, x.index), k)
        for y in node.outputs:
            base = node.inputs[0] if node.kind == "view" else None
            owner[y.index] = owner.get(base.index, base.index) if base is not None else y.index
            root[y.index] = root.get(base.index, -1) if base is not None else k
    compute = [k for k, node in enumerate(ops) if node.kind != "view" and node.stream != COMMUNICATE
               and node.op not in COLLECTIVES]
    found = False
    for node in ops:
        if node.kind != "collective" or node.op not in COLLECTIVES:
            continue
        found = True
        start = max((root.get(x.index, -1) for x in node.inputs if x is not None), default=-1)
        end = min((first_read.get(y.index, len(ops)) for y in node.outputs), default=len(ops))
        if bisect.bisect_right(compute, start) < bisect.bisect_left(compute, end):  # a compute kernel in between
            return False
    return found


def bare_calls(kernels: list[Kernel]) -> tuple[BareCall, ...]:
    """``kernels`` (of a static plan, in push order) as bare calls: a bound DispatchKernel's prepared kernel with
    the context and the buffers fixed at build. The caller reads ``prepared.fn`` at each call, so a re-bind (a
    registration, ``disabled``, verify mode, the first call's ABI check) takes effect as in ``DispatchKernel.run``;
    a static plan releases nothing after a kernel (``Kernel.execute``'s other job)."""
    calls: list[BareCall] = []
    for k in kernels:
        assert not k.release, "bare calls are for static plans, which release nothing"
        if isinstance(k, DispatchKernel) and k.fixed is not None:
            calls.append((k, k.prepared, k.ctx, k.fixed[0], k.fixed[1]))
        else:
            calls.append((k, None, None, None, None))
    return tuple(calls)


def schedule(kernels: list[Kernel]) -> tuple[list[Item], int]:
    """The push program of ``kernels`` (in graph order, with their ``deps`` and ``record`` set) and its number of
    event slots: consecutive kernels of one stream with no wait between them are pushed as one ``Segment``."""
    prog: list[Item] = []
    open_runs: dict[Any, list[Kernel]] = {}
    slots: dict[int, int] = {}  # kernel seq -> event slot
    waited: dict[tuple[Any, Any], int] = {}  # (consumer stream, producer stream) -> last seq waited for

    def flush(stream: Any) -> None:
        run = open_runs.pop(stream, None)
        if run:
            prog.append(("push", stream, Segment(run)))

    for k in kernels:
        s = k.stream
        for p in k.deps:
            key = (s, p.stream)
            if waited.get(key, -1) < p.seq:
                flush(s)
                prog.append(("wait", s, slots[p.seq]))
                waited[key] = p.seq
        open_runs.setdefault(s, []).append(k)
        if k.record:
            flush(s)
            slots[k.seq] = len(slots)
            prog.append(("record", s, slots[k.seq]))
    for s in list(open_runs):
        flush(s)
    return prog, len(slots)
