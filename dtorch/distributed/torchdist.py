"""``TorchDistCommunicator``: collectives over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

The same graph runs SPMD, one process per device (global device id = rank), e.g. under ``torchrun``:
every process builds the same graph and a ``Runner`` with this communicator, and drives its own device.
gloo has no reduce-scatter and needs equal pieces for all-gather, so reduce-scatter is an all-reduce
and a local slice, and uneven all-gathers pad to the largest piece. Failures, including a lost peer
(a closed connection, or nothing within the process group's timeout), raise ``CommunicationError``.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from dtorch.core import env
from dtorch.core.errors import ArgumentError, CommunicationError
from dtorch.graph.placement import Shard, shard_sizes
from dtorch.runtime.blob import local_piece
from dtorch.runtime.comm import Communicator

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def init_process_group(rank: int, world_size: int, *, backend: str = "gloo", addr: str | None = None,
                       port: int | None = None, timeout: float | None = None) -> None:
    """Join the process group (``MASTER_ADDR``/``MASTER_PORT`` unless given); ``timeout`` seconds bounds every
    collective, so a lost peer surfaces as an error instead of a hang."""
    addr = addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = port or int(os.environ.get("MASTER_PORT", "29500"))
    seconds = env.sync_timeout() if timeout is None else timeout
    try:
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=seconds))
    except (RuntimeError, ValueError) as exc:
        raise CommunicationError(f"init_process_group(rank {rank} of {world_size}, {backend}, {addr}:{port}) "
                                 f"failed: {exc}") from exc


class TorchDistCommunicator(Communicator):
    """Collectives over the initialised default process group; device id ``r`` is rank ``r``."""

    def __init__(self, group: object | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise CommunicationError("TorchDistCommunicator: torch.distributed is not initialised "
                                     "(call dtorch.distributed.init_process_group first)")
        self.group = group
        self.process = dist.get_rank(group)
        self.ids = tuple(range(dist.get_world_size(group)))

    def _do(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except (RuntimeError, ValueError, dist.DistBackendError) as exc:
            raise CommunicationError(f"{what} on rank {self.process} of {len(self.ids)} failed (a peer may be "
                                     f"lost): {type(exc).__name__}: {exc}") from exc

    def all_reduce(self, device_id: int, x: torch.Tensor, out: torch.Tensor, op: str = "sum") -> None:
        out.copy_(x)
        self._do("all_reduce", lambda: dist.all_reduce(out, op=_op(op), group=self.group))

    def all_gather(self, device_id: int, x: torch.Tensor, out: torch.Tensor, dim: int = 0) -> None:
        sizes = shard_sizes(out.shape[dim], len(self.ids))
        big = max(sizes)
        padded = x
        if x.shape[dim] < big:
            pad_shape = list(x.shape)
            pad_shape[dim] = big - x.shape[dim]
            padded = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
        bufs = [torch.empty_like(padded) for _ in self.ids]
        self._do("all_gather", lambda: dist.all_gather(bufs, padded.contiguous(), group=self.group))
        torch.cat([b.narrow(dim, 0, s) for b, s in zip(bufs, sizes, strict=False)], dim=dim, out=out)

    def reduce_scatter(self, device_id: int, x: torch.Tensor, out: torch.Tensor, dim: int = 0,
                       op: str = "sum") -> None:
        full = x.clone()
        self._do("reduce_scatter", lambda: dist.all_reduce(full, op=_op(op), group=self.group))
        out.copy_(local_piece(full, Shard(dim), self.process, len(self.ids)))

    def broadcast(self, device_id: int, x: torch.Tensor, out: torch.Tensor, src: int = 0) -> None:
        out.copy_(x)
        self._do("broadcast", lambda: dist.broadcast(out, src=src, group=self.group))

    def send(self, device_id: int, x: torch.Tensor, dst: int) -> None:
        self._do("send", lambda: dist.send(x.contiguous(), dst=dst, group=self.group))

    def recv(self, device_id: int, out: torch.Tensor, src: int) -> None:
        self._do("recv", lambda: dist.recv(out, src=src, group=self.group))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def __repr__(self) -> str:
        return f"TorchDistCommunicator(rank {self.process} of {len(self.ids)}, {dist.get_backend(self.group)})"


def _op(op: str) -> dist.ReduceOp:
    if op not in _OPS:
        raise ArgumentError(f"collective reduction must be one of {sorted(_OPS)}, got {op!r}")
    return _OPS[op]
