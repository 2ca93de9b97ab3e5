"""``TorchDistCommunicator``: collectives over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

The same graph runs SPMD, one process per device (global device id = rank), e.g. under ``torchrun``:
every process builds the same graph and a ``Runner`` with this communicator, and drives its own device.
gloo has no reduce-scatter and needs equal pieces for all-gather, so reduce-scatter is an all-reduce
and a local slice, and uneven all-gathers pad to the largest piece.

Ranks of one host talk through shared memory (``dtorch.distributed.shm``) instead: a group whose ranks are all on
this host runs its collectives of CPU tensors there, and a send between two ranks of one host goes through their
ring (~10-50 us against gloo's ~500 us on loopback). ``DTORCH_SHM_COMM=0`` keeps everything on gloo.

Every collective keeps the timeout the group was built with (``init_process_group(timeout=...)``). A
failure raises ``CommunicationError`` naming the op, this rank and the peer: a peer whose process died
closes its connections, and gloo raises at once ("Connection closed by peer"); a peer alive but stuck
raises after the group's timeout. A Runner driving this communicator should have a sync timeout longer
than the group's, so that the communicate stream's error, not a ``SyncTimeout``, is what surfaces.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from dtorch.core import env
from dtorch.core.errors import ArgumentError, CommunicationError
from dtorch.core.placement import Shard, shard_sizes
from dtorch.distributed.shm import HostShm, ShmError
from dtorch.graph.mesh import local_cuda_index
from dtorch.runtime.blob import local_piece
from dtorch.runtime.comm import Communicator

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def init_process_group(rank: int | None = None, world_size: int | None = None, *, backend: str = "gloo",
                       addr: str | None = None, port: int | None = None, timeout: float | None = None) -> None:
    """Join the process group. ``rank``/``world_size`` default to torchrun's ``RANK``/``WORLD_SIZE``, the
    rendezvous to ``MASTER_ADDR``/``MASTER_PORT``; ``timeout`` seconds (default DTORCH_SYNC_TIMEOUT) bounds
    every collective of the group, so a lost peer surfaces as an error instead of a hang. With "nccl" the
    rank's local GPU is made current first (``local_cuda_index``)."""
    rank = _env_int("RANK", 0) if rank is None else rank
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    addr = addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = port or _env_int("MASTER_PORT", 29500)
    seconds = env.sync_timeout() if timeout is None else float(timeout)
    if seconds <= 0:
        raise ArgumentError(f"init_process_group: timeout must be > 0 seconds, got {timeout!r}")
    if backend == "nccl":
        torch.cuda.set_device(local_cuda_index(rank))
    try:
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=seconds))
    except (RuntimeError, ValueError) as exc:
        raise CommunicationError(f"init_process_group(rank {rank} of {world_size}, {backend}, {addr}:{port}) "
                                 f"failed: {exc}") from exc


def _env_int(name: str, default: int) -> int:
    """A torchrun variable (not a dtorch flag) as an int."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    if not raw.strip().isdigit():
        raise ArgumentError(f"init_process_group: environment variable {name}={raw!r} is not a non-negative int")
    return int(raw)


def group_timeout(group: object | None = None) -> float | None:
    """Seconds the process group's collectives wait for a peer (None if torch does not say)."""
    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout.total_seconds()  # type: ignore[union-attr]
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


class TorchDistCommunicator(Communicator):
    """Collectives over the initialised default process group; device id ``r`` is rank ``r``."""

    def __init__(self, group: object | None = None, ids: tuple[int, ...] | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise CommunicationError("TorchDistCommunicator: torch.distributed is not initialised "
                                     "(call dtorch.distributed.init_process_group first)")
        self.pg = group  # the process group (None: the default one)
        self.process = dist.get_rank()  # the global rank: device id and process index
        self.ids = tuple(range(dist.get_world_size())) if ids is None else ids  # the group's ranks (global)
        self._position = self.ids.index(self.process) if self.process in self.ids else -1
        self.timeout = group_timeout(group)  # what every collective waits for a peer; set by the group
        self._groups: dict[tuple[int, ...], TorchDistCommunicator] = {}
        # send/recv between stages: a group of every rank of its own (made with the stages' groups), so that the stage
        # threads' messages never meet the collectives the engine's thread runs on the default group meanwhile
        self._p2p: object | None = None
        # this host's ranks of the group in shared memory (collectives when all are here; sends between two of them)
        self.shm = HostShm.join(group, self.timeout or env.sync_timeout()) if self._position >= 0 else None
        self._p2p_shm = self.shm  # the world's segment (a stage's group shares its parent's)

    def group(self, ids: tuple[int, ...]) -> TorchDistCommunicator:
        """Collectives among the ranks ``ids`` (a pipeline stage's tp group), send/recv to any rank. Every rank must
        ask for every stage's group, in the same order (``dist.new_group`` is collective), also those it is not in."""
        ids = tuple(ids)
        if ids == self.ids:
            return self
        if self._p2p is None:
            self._p2p = dist.new_group(list(range(dist.get_world_size())))
        sub = self._groups.get(ids)
        if sub is None:
            pg = dist.new_group(list(ids))
            sub = self._groups[ids] = TorchDistCommunicator(pg, ids) if self.process in ids else self
            sub._p2p, sub._p2p_shm = self._p2p, self._p2p_shm
        return sub

    def apart(self) -> TorchDistCommunicator:
        """The same ranks on a new process group (collective: every rank calls it, in the same order); its stages'
        groups and send/recv group are new too."""
        return TorchDistCommunicator(dist.new_group(list(self.ids)), self.ids)

    def _do(self, what: str, fn: Callable[[], None], peer: int | None = None) -> None:
        """Run one collective (``peer``: the other side of a send/recv); any failure becomes a CommunicationError."""
        try:
            fn()
        except ShmError as exc:  # names the peer and why already
            raise CommunicationError(f"{what} on rank {self.process} of {len(self.ids)} failed: {exc}") from exc
        except (RuntimeError, ValueError) as exc:  # gloo and NCCL errors (DistBackendError) are RuntimeErrors
            raise CommunicationError(self._explain(what, exc, peer)) from exc

    def _explain(self, what: str, exc: BaseException, peer: int | None) -> str:
        others = [peer] if peer is not None else [r for r in self.ids if r != self.process]
        who = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {others}"
        text = str(exc)
        low = text.lower()
        if any(k in low for k in ("closed by peer", "connection reset", "broken pipe", "connection refused")):
            why = f"{who} was lost: its connection closed (the process exited or crashed; see its log)"
        elif "timed out" in low or "timeout" in low:
            limit = f"{self.timeout:g}s" if self.timeout is not None else "the group's timeout"
            why = (f"{who} did not answer within {limit}, the process group's timeout (a stuck or slow peer; "
                   f"a longer wait is init_process_group(timeout=...))")
        else:
            why = f"{who} may be lost"
        return f"{what} on rank {self.process} of {len(self.ids)} failed: {why}. {type(exc).__name__}: {text}"

    def _local(self, t: torch.Tensor) -> HostShm | None:
        """The shared-memory segment a collective of ``t`` goes through (None: gloo / NCCL)."""
        shm = self.shm
        return shm if shm is not None and shm.whole and t.device.type == "cpu" else None

    def all_reduce(self, device_id: int, x: torch.Tensor, out: torch.Tensor, op: str = "sum") -> None:
        shm = self._local(out)
        if shm is not None:
            return self._do("all_reduce", lambda: shm.all_reduce(x, out, _op_name(op)))
        out.copy_(x)
        self._do("all_reduce", lambda: dist.all_reduce(out, op=_op(op), group=self.pg))

    def all_gather(self, device_id: int, x: torch.Tensor, out: torch.Tensor, dim: int = 0) -> None:
        shm = self._local(out)
        if shm is not None:
            return self._do("all_gather", lambda: shm.all_gather(x, out, dim % max(out.dim(), 1)))
        sizes = shard_sizes(out.shape[dim], len(self.ids))
        big = max(sizes)
        padded = x
        if x.shape[dim] < big:
            pad_shape = list(x.shape)
            pad_shape[dim] = big - x.shape[dim]
            padded = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
        bufs = [torch.empty_like(padded) for _ in self.ids]
        self._do("all_gather", lambda: dist.all_gather(bufs, padded.contiguous(), group=self.pg))
        torch.cat([b.narrow(dim, 0, s) for b, s in zip(bufs, sizes, strict=False)], dim=dim, out=out)

    def reduce_scatter(self, device_id: int, x: torch.Tensor, out: torch.Tensor, dim: int = 0,
                       op: str = "sum") -> None:
        shm = self._local(out)
        if shm is not None:
            return self._do("reduce_scatter", lambda: shm.reduce_scatter(x, out, dim % max(x.dim(), 1), _op_name(op)))
        full = x.clone()
        self._do("reduce_scatter", lambda: dist.all_reduce(full, op=_op(op), group=self.pg))
        out.copy_(local_piece(full, Shard(dim), self._position, len(self.ids)))

    def broadcast(self, device_id: int, x: torch.Tensor, out: torch.Tensor, src: int = 0) -> None:
        shm = self._local(out)
        if shm is not None and src in self.ids:
            return self._do("broadcast", lambda: shm.broadcast(x, out, self.ids.index(src)))
        out.copy_(x)
        self._do("broadcast", lambda: dist.broadcast(out, src=src, group=self.pg))

    # point to point between any two ranks (pipeline stages): global ranks, on the stages' own group of every rank
    def send(self, device_id: int, x: torch.Tensor, dst: int) -> None:
        shm = self._p2p_shm
        if shm is not None and dst in shm.ranks and x.device.type == "cpu":
            return self._do("send", lambda: shm.send(x, shm.ranks.index(dst)), peer=dst)
        self._do("send", lambda: dist.send(x.contiguous(), dst=dst, group=self._p2p), peer=dst)

    def recv(self, device_id: int, out: torch.Tensor, src: int) -> None:
        shm = self._p2p_shm
        if shm is not None and src in shm.ranks and out.device.type == "cpu":
            return self._do("recv", lambda: shm.recv(out, shm.ranks.index(src)), peer=src)
        self._do("recv", lambda: dist.recv(out, src=src, group=self._p2p), peer=src)

    def abort(self) -> None:
        """Wake this rank's waits in shared memory with a ``CommunicationError`` (gloo's keep their timeout)."""
        for shm in (self.shm, self._p2p_shm):
            if shm is not None:
                shm.abort()

    def reset(self) -> None:
        for shm in (self.shm, self._p2p_shm):
            if shm is not None:
                shm.reset()

    def close(self) -> None:
        if self.pg is None and dist.is_initialized():
            dist.destroy_process_group()

    def __repr__(self) -> str:
        via = f", shared memory with ranks {list(self.shm.ranks)}" if self.shm is not None else ""
        return f"TorchDistCommunicator(rank {self.process} of {len(self.ids)}, {dist.get_backend(self.pg)}{via})"


def _op(op: str) -> dist.ReduceOp:
    return _OPS[_op_name(op)]


def _op_name(op: str) -> str:
    if op not in _OPS:
        raise ArgumentError(f"collective reduction must be one of {sorted(_OPS)}, got {op!r}")
    return op
