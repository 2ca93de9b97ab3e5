"""``InProcessCommunicator``: collectives among the devices (stream threads) of one process.

Each collective is a rendezvous: every device puts its call in its slot and waits on a barrier; the
last one to arrive runs the combination for all (``threading.Barrier``'s action), writing every
device's ``out`` before anyone leaves, so the next collective cannot overwrite a slot still in use.
A peer that never arrives breaks the barrier after ``timeout``; ``abort()`` breaks it at once.

On GPUs the combination only *enqueues* work, each device's on its own caller's stream (the communicate
stream that issued the call, recorded in the slot): ``torch.cuda.nccl`` over the per-device tensors when
every tensor is a dense CUDA tensor and the layout is one NCCL takes (gathers and scatters along dim 0 in
equal pieces), else peer copies with every device's stream made current in the combining thread, so that
each cross-device copy is ordered by events against both devices' streams. On CPUs it runs at once.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from dtorch.core import env
from dtorch.core.errors import ArgumentError, CommunicationError, DeviceError, ShapeError
from dtorch.core.placement import Shard, piece_ranges
from dtorch.core.sync import Rendezvous
from dtorch.runtime.blob import local_piece
from dtorch.runtime.comm import Communicator

REDUCE_OPS = ("sum", "max")
_NCCL_OPS = {"sum": 0, "max": 2}  # ncclRedOp_t: ncclSum, ncclMax
# module attributes, so that tests can put a fake NCCL in their place
nccl = torch.cuda.nccl
NCCL_BUILT = hasattr(torch._C, "_nccl_all_reduce")


class _Call(NamedTuple):
    op: str
    x: torch.Tensor | None
    out: torch.Tensor
    args: tuple
    stream: Any  # the caller's current stream on out's device (None on CPU)


class InProcessCommunicator(Communicator):
    """Collectives over global device ids ``ids`` driven by threads of this process."""

    def __init__(self, ids: Sequence[int], timeout: float | None = None) -> None:
        self.ids = tuple(ids)
        self.n = len(self.ids)
        self.process = 0
        self.timeout = env.sync_timeout() if timeout is None else float(timeout)
        self._rank = {i: r for r, i in enumerate(self.ids)}
        self._slots: list[_Call | None] = [None] * self.n
        self._checked: set[tuple] = set()  # signatures of collectives whose calls fit together
        self._error: BaseException | None = None
        self._barrier = self._new_barrier()
        self._aborted = threading.Event()
        self._mail: dict[tuple[int, int], queue.SimpleQueue] = {}
        self._mail_lock = threading.Lock()
        self._reachable = frozenset(self.ids)  # the devices send/recv may name (a group's: its parent's)

    def group(self, ids: Sequence[int]) -> InProcessCommunicator:
        """Collectives among ``ids`` only (a pipeline stage's tp group); send/recv share this communicator's
        mailboxes, so a stage's send meets the next stage's recv."""
        ids = tuple(ids)
        if ids == self.ids:
            return self
        if not set(ids) <= self._reachable:
            raise DeviceError(f"InProcessCommunicator.group: {list(ids)} are not all among {sorted(self._reachable)}")
        sub = InProcessCommunicator(ids, self.timeout)
        sub._mail, sub._mail_lock, sub._reachable = self._mail, self._mail_lock, self._reachable
        return sub

    def apart(self) -> InProcessCommunicator:
        """The same devices with a barrier and mailboxes of their own."""
        return InProcessCommunicator(self.ids, self.timeout)

    def _new_barrier(self) -> Rendezvous:
        return Rendezvous(self.n, action=self._combine, timeout=self.timeout)

    # -- collectives ---------------------------------------------------------------------------

    def all_reduce(self, device_id: int, x: torch.Tensor, out: torch.Tensor, op: str = "sum") -> None:
        self._exchange(device_id, _Call("all_reduce", x, out, (_reduce_op(op),), _stream_of(out)))

    def all_gather(self, device_id: int, x: torch.Tensor, out: torch.Tensor, dim: int = 0) -> None:
        self._exchange(device_id, _Call("all_gather", x, out, (dim % max(out.dim(), 1),), _stream_of(out)))

    def reduce_scatter(self, device_id: int, x: torch.Tensor, out: torch.Tensor, dim: int = 0,
                       op: str = "sum") -> None:
        args = (dim % max(x.dim(), 1), _reduce_op(op))
        self._exchange(device_id, _Call("reduce_scatter", x, out, args, _stream_of(out)))

    def broadcast(self, device_id: int, x: torch.Tensor, out: torch.Tensor, src: int = 0) -> None:
        if src not in self._rank:
            raise DeviceError(f"broadcast: src {src} is not one of the devices {self.ids}")
        self._exchange(device_id, _Call("broadcast", x, out, (self._rank[src],), _stream_of(out)))

    def _exchange(self, device_id: int, call: _Call) -> None:
        rank = self._rank_of(device_id, call.op)
        self._slots[rank] = call
        barrier = self._barrier
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            error = self._error
            if error is not None:
                raise CommunicationError(f"{call.op} on device {device_id}: {error}") from error
            why = "aborted (a kernel of this run failed or the run timed out)" if self._aborted.is_set() else \
                f"a peer did not arrive within {self.timeout:g}s"
            raise CommunicationError(f"{call.op} on device {device_id}: {why}") from None
        except ShapeError as exc:  # raised by _combine in this (the last) thread: the same error as every peer's
            raise CommunicationError(f"{call.op} on device {device_id}: {exc}") from exc

    def _combine(self) -> None:
        """Runs once per collective, in the last thread to arrive, before any thread leaves."""
        calls = list(self._slots)
        try:
            first = calls[0]
            # what the devices issued, checked once per signature (a static plan's collectives repeat every step)
            signature = tuple((c.op, c.args, None if c.x is None else c.x.shape, c.out.shape) for c in calls)
            if signature not in self._checked:
                if any(c.op != first.op or c.args != first.args for c in calls):
                    seen = ", ".join(f"{i}: {c.op}{c.args}" for i, c in zip(self.ids, calls, strict=True))
                    raise CommunicationError(f"devices issued different collectives at the same point: {seen}")
                _check_shapes(self.ids, calls)
                if len(self._checked) < 4096:
                    self._checked.add(signature)
            if all(c.stream is None for c in calls):  # CPU tensors: combined here and now
                _COMBINE[first.op](calls, *first.args)
            elif _nccl_fits(calls):
                _NCCL[first.op](calls, *first.args)
            else:
                with _current_streams([c.stream for c in calls]):
                    _COMBINE[first.op](calls, *first.args)
        except BaseException as exc:
            self._error = exc
            raise

    # -- point to point ------------------------------------------------------------------------

    def _box(self, src: int, dst: int) -> queue.SimpleQueue:
        with self._mail_lock:
            return self._mail.setdefault((src, dst), queue.SimpleQueue())

    def send(self, device_id: int, x: torch.Tensor, dst: int) -> None:
        self._rank_of(device_id, "send")
        self._peer(dst, "send")
        self._box(device_id, dst).put((x.clone(), _stream_of(x)))  # the clone is ordered on the sender's stream

    def recv(self, device_id: int, out: torch.Tensor, src: int) -> None:
        self._rank_of(device_id, "recv")
        box = self._box(self._peer(src, "recv"), device_id)
        waited = 0.0
        while True:
            try:
                got = box.get(timeout=0.05)
                break
            except queue.Empty:
                waited += 0.05
                if self._aborted.is_set():
                    raise CommunicationError(f"recv on device {device_id} from {src}: aborted") from None
                if waited >= self.timeout:
                    raise CommunicationError(f"recv on device {device_id}: nothing from device {src} "
                                             f"within {self.timeout:g}s") from None
        got, sender_stream = got
        if got.shape != out.shape:
            raise CommunicationError(f"recv on device {device_id}: device {src} sent shape {list(got.shape)}, "
                                     f"expected {list(out.shape)}")
        # on GPUs the copy runs on the sender's stream (after its clone), ordered against ours by events
        with _current_streams([sender_stream, _stream_of(out)]):
            out.copy_(got)

    # -- faults --------------------------------------------------------------------------------

    def abort(self) -> None:
        self._aborted.set()
        self._barrier.abort()

    def set_timeout(self, seconds: float) -> None:
        self.timeout = self._barrier.timeout = seconds

    def reset(self) -> None:
        self._aborted.clear()
        self._error = None
        self._slots = [None] * self.n
        self._barrier = self._new_barrier()
        if self._reachable == frozenset(self.ids):  # a stage's group leaves the mailboxes to drop_messages
            self.drop_messages()

    def drop_messages(self) -> None:
        with self._mail_lock:
            self._mail.clear()

    def _peer(self, device_id: int, op: str) -> int:
        if device_id not in self._reachable:
            raise DeviceError(f"{op}: device {device_id} is not one of the communicator's devices "
                              f"{sorted(self._reachable)}")
        return device_id

    def _rank_of(self, device_id: int, op: str) -> int:
        r = self._rank.get(device_id)
        if r is None:
            raise DeviceError(f"{op}: device {device_id} is not one of the communicator's devices {self.ids}")
        return r

    def __repr__(self) -> str:
        return f"InProcessCommunicator({list(self.ids)})"


def _expected_out(calls: list[_Call], rank: int) -> tuple[int, ...] | None:
    """The shape device ``rank``'s out must have, or None when the inputs themselves disagree."""
    first = calls[0]
    xs = [tuple(c.x.shape) for c in calls]
    if first.op == "all_gather":
        dim = first.args[0]
        if any(len(s) != len(xs[0]) or s[:dim] + s[dim + 1:] != xs[0][:dim] + xs[0][dim + 1:] for s in xs):
            return None
        return xs[0][:dim] + (sum(s[dim] for s in xs),) + xs[0][dim + 1:]
    if first.op == "broadcast":
        return xs[first.args[0]]
    if any(s != xs[0] for s in xs):
        return None
    if first.op == "reduce_scatter":
        dim, full = first.args[0], xs[0]
        length = sum(n for _, n in piece_ranges(Shard(dim), full[dim], rank, len(calls)))
        return full[:dim] + (length,) + full[dim + 1:]
    return xs[0]


def _check_shapes(ids: Sequence[int], calls: list[_Call]) -> None:
    """Every device's x and out fit the collective; else a ``ShapeError`` naming the shapes on every device."""
    if calls[0].op == "broadcast":  # only the source's x is read
        calls = [c._replace(x=calls[calls[0].args[0]].x) if c.x is None else c for c in calls]
    if all(c.x is not None and tuple(c.out.shape) == _expected_out(calls, r) for r, c in enumerate(calls)):
        return
    seen = "; ".join(f"device {i}: x {list(c.x.shape) if c.x is not None else None}, out {list(c.out.shape)}"
                     for i, c in zip(ids, calls, strict=True))
    raise ShapeError(f"{calls[0].op}{calls[0].args}: the devices' shapes do not fit together: {seen}")


def _reduce_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise ArgumentError(f"collective reduction must be one of {REDUCE_OPS}, got {op!r}")
    return op


def _stream_of(t: torch.Tensor) -> Any:
    """The calling thread's current stream on ``t``'s device (a stream thread's is its own), None on CPU."""
    return torch.cuda.current_stream(t.device) if t.is_cuda else None


@contextlib.contextmanager
def _current_streams(streams: Sequence[Any]) -> Iterator[None]:
    """Make each CUDA stream current on its device in this thread: a cross-device ``copy_`` then runs on the
    source device's stream and waits, by events both ways, for the destination's (torch's peer-copy rule)."""
    with contextlib.ExitStack() as stack:
        for s in streams:
            if isinstance(s, torch.cuda.Stream):
                stack.enter_context(torch.cuda.stream(s))
        yield


def _nccl_fits(calls: list[_Call]) -> bool:
    """Whether NCCL can run these calls: every tensor dense and CUDA, one per device, and gathers and
    scatters along dim 0 in equal pieces (NCCL concatenates and splits the flat buffers)."""
    first = calls[0]
    if first.stream is None or not NCCL_BUILT:
        return False
    xs, outs = [c.x for c in calls], [c.out for c in calls]
    if not (nccl.is_available(xs) and nccl.is_available(outs)):
        return False
    if first.op == "all_gather":
        return first.args[0] == 0 and all(x.shape == xs[0].shape for x in xs)
    if first.op == "reduce_scatter":
        return first.args[0] == 0 and xs[0].shape[0] % len(calls) == 0
    return True


def _nccl_all_reduce(calls: list[_Call], op: str) -> None:
    nccl.all_reduce([c.x for c in calls], [c.out for c in calls], op=_NCCL_OPS[op], streams=[c.stream for c in calls])


def _nccl_all_gather(calls: list[_Call], dim: int) -> None:
    nccl.all_gather([c.x for c in calls], [c.out for c in calls], streams=[c.stream for c in calls])


def _nccl_reduce_scatter(calls: list[_Call], dim: int, op: str) -> None:
    nccl.reduce_scatter([c.x for c in calls], [c.out for c in calls], op=_NCCL_OPS[op],
                        streams=[c.stream for c in calls])


def _nccl_broadcast(calls: list[_Call], src_rank: int) -> None:
    root = calls[src_rank]
    with _current_streams([root.stream]):
        root.out.copy_(root.x)
    nccl.broadcast([c.out for c in calls], root=src_rank, streams=[c.stream for c in calls])


_NCCL: dict[str, Any] = {"all_reduce": _nccl_all_reduce, "all_gather": _nccl_all_gather,
                         "reduce_scatter": _nccl_reduce_scatter, "broadcast": _nccl_broadcast}


def _reduce(xs: list[torch.Tensor], op: str, out: torch.Tensor) -> torch.Tensor:
    """reduce(op) of ``xs`` into ``out``; a piece on another device is first copied to out's (no-op on CPU)."""
    xs = [x if x.device == out.device else x.to(out.device) for x in xs]
    if len(xs) == 1:
        out.copy_(xs[0])
        return out
    fn = torch.add if op == "sum" else torch.maximum
    fn(xs[0], xs[1], out=out)
    for x in xs[2:]:
        fn(out, x, out=out)
    return out


def _all_reduce(calls: list[_Call], op: str) -> None:
    red = _reduce([c.x for c in calls], op, calls[0].out)
    for c in calls[1:]:
        c.out.copy_(red)


def _all_gather(calls: list[_Call], dim: int) -> None:
    xs = [c.x for c in calls]
    for c in calls:
        torch.cat([x.to(c.out.device) for x in xs], dim=dim, out=c.out)


def _reduce_scatter(calls: list[_Call], dim: int, op: str) -> None:
    red = _reduce([c.x for c in calls], op, torch.empty_like(calls[0].x))
    for r, c in enumerate(calls):
        c.out.copy_(local_piece(red, Shard(dim), r, len(calls)))


def _broadcast(calls: list[_Call], src_rank: int) -> None:
    x = calls[src_rank].x
    for c in calls:
        c.out.copy_(x)


_COMBINE: dict[str, Any] = {"all_reduce": _all_reduce, "all_gather": _all_gather,
                            "reduce_scatter": _reduce_scatter, "broadcast": _broadcast}
