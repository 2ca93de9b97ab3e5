"""``InProcessCommunicator``: collectives among the devices (stream threads) of one process.

Each collective is a rendezvous: every device puts its call in its slot and waits on a barrier; the
last one to arrive runs the combination for all (``threading.Barrier``'s action), writing every
device's ``out`` before anyone leaves, so the next collective cannot overwrite a slot still in use.
A peer that never arrives breaks the barrier after ``timeout``; ``abort()`` breaks it at once.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from dtorch.core import env
from dtorch.core.errors import ArgumentError, CommunicationError, DeviceError
from dtorch.graph.placement import Shard
from dtorch.runtime.blob import local_piece
from dtorch.runtime.comm import Communicator

REDUCE_OPS = ("sum", "max")


class _Call(NamedTuple):
    op: str
    x: torch.Tensor | None
    out: torch.Tensor
    args: tuple


class InProcessCommunicator(Communicator):
    """Collectives over global device ids ``ids`` driven by threads of this process."""

    def __init__(self, ids: Sequence[int], timeout: float | None = None) -> None:
        self.ids = tuple(ids)
        self.n = len(self.ids)
        self.process = 0
        self.timeout = env.sync_timeout() if timeout is None else float(timeout)
        self._rank = {i: r for r, i in enumerate(self.ids)}
        self._slots: list[_Call | None] = [None] * self.n
        self._error: BaseException | None = None
        self._barrier = self._new_barrier()
        self._aborted = threading.Event()
        self._mail: dict[tuple[int, int], queue.SimpleQueue] = {}
        self._mail_lock = threading.Lock()

    def _new_barrier(self) -> threading.Barrier:
        return threading.Barrier(self.n, action=self._combine, timeout=self.timeout)

    # -- collectives ---------------------------------------------------------------------------

    def all_reduce(self, device_id: int, x: torch.Tensor, out: torch.Tensor, op: str = "sum") -> None:
        self._exchange(device_id, _Call("all_reduce", x, out, (_reduce_op(op),)))

    def all_gather(self, device_id: int, x: torch.Tensor, out: torch.Tensor, dim: int = 0) -> None:
        self._exchange(device_id, _Call("all_gather", x, out, (dim,)))

    def reduce_scatter(self, device_id: int, x: torch.Tensor, out: torch.Tensor, dim: int = 0,
                       op: str = "sum") -> None:
        self._exchange(device_id, _Call("reduce_scatter", x, out, (dim, _reduce_op(op))))

    def broadcast(self, device_id: int, x: torch.Tensor, out: torch.Tensor, src: int = 0) -> None:
        if src not in self._rank:
            raise DeviceError(f"broadcast: src {src} is not one of the devices {self.ids}")
        self._exchange(device_id, _Call("broadcast", x, out, (self._rank[src],)))

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

    def _combine(self) -> None:
        """Runs once per collective, in the last thread to arrive, before any thread leaves."""
        calls = list(self._slots)
        try:
            first = calls[0]
            if any(c.op != first.op or c.args != first.args for c in calls):
                seen = ", ".join(f"{i}: {c.op}{c.args}" for i, c in zip(self.ids, calls, strict=True))
                raise CommunicationError(f"devices issued different collectives at the same point: {seen}")
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
        self._rank_of(dst, "send")
        self._box(device_id, dst).put(x.clone())

    def recv(self, device_id: int, out: torch.Tensor, src: int) -> None:
        self._rank_of(device_id, "recv")
        box = self._box(self.ids[self._rank_of(src, "recv")], device_id)
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
        if got.shape != out.shape:
            raise CommunicationError(f"recv on device {device_id}: device {src} sent shape {list(got.shape)}, "
                                     f"expected {list(out.shape)}")
        out.copy_(got)

    # -- faults --------------------------------------------------------------------------------

    def abort(self) -> None:
        self._aborted.set()
        self._barrier.abort()

    def reset(self) -> None:
        self._aborted.clear()
        self._error = None
        self._slots = [None] * self.n
        self._barrier = self._new_barrier()
        with self._mail_lock:
            self._mail.clear()

    def _rank_of(self, device_id: int, op: str) -> int:
        r = self._rank.get(device_id)
        if r is None:
            raise DeviceError(f"{op}: device {device_id} is not one of the communicator's devices {self.ids}")
        return r

    def __repr__(self) -> str:
        return f"InProcessCommunicator({list(self.ids)})"


def _reduce_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise ArgumentError(f"collective reduction must be one of {REDUCE_OPS}, got {op!r}")
    return op


def _reduce(xs: list[torch.Tensor], op: str, out: torch.Tensor) -> torch.Tensor:
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
        torch.cat(xs, dim=dim, out=c.out)


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
