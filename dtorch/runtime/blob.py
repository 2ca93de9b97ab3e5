"""``Blob`` (the tensor of one device) and ``DistTensor`` (one Blob per device of a mesh).

A Blob links an operand of the graph to the memory of one device. The Runner counts, per run, the
kernels that still have to read it; when the last one has run the Blob drops its tensor (unless it
is pinned: a param or an output), which keeps peak memory near the live working set.

On CUDA a tensor belongs to the stream it was allocated on: the caching allocator hands its memory
back to that stream as soon as it is freed, while a kernel on another stream may not have read it yet.
So a Blob read on a stream other than its writer's (``foreign``, marked once at build by
``mark_cross_stream_reads``) records each reader's stream on its tensor (``record_stream``), and
``record_use`` does the same for the caller's stream with every result returned. Pieces are placed on
their device once (params at build, feeds per run) by ``device_piece``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from dtorch.core.device import Device
from dtorch.core.errors import ArgumentError, CommunicationError, DeviceError, ShapeError
from dtorch.core.memory import MemoryKind
from dtorch.core.placement import Partial, Placement, Replicate, Shard, as_placement, piece_ranges
from dtorch.graph.mesh import DeviceMesh


class Blob:
    """The tensor one device holds for one operand (None until produced or after release)."""

    __slots__ = ("tensor", "device", "kind", "readers", "pinned", "foreign", "_left", "_lock", "__weakref__")

    def __init__(self, device: Device, kind: MemoryKind = MemoryKind.ACTIVATION, tensor: torch.Tensor | None = None,
                 pinned: bool = False) -> None:
        self.tensor = tensor
        self.device = device
        self.kind = kind
        self.readers = 0  # kernels that read this blob in one run
        self.pinned = pinned
        self.foreign = False  # read on a stream other than the one that wrote it (see mark_cross_stream_reads)
        self._left = 0
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Start of a run: every reader still has to read."""
        self._left = self.readers
        if not self.pinned:
            self.tensor = None

    def read_done(self) -> None:
        """One reader has run (on the calling thread's current stream); the last one releases the tensor (unless
        pinned). A foreign tensor first records the reader's stream, so that its memory is not reused before the
        reads this reader enqueued have run. Pinned tensors are freed only after a full synchronize."""
        t = self.tensor
        if self.foreign and not self.pinned and t is not None and _on_gpu(t):
            t.record_stream(_current_stream(t))
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last and not self.pinned:
            self.tensor = None

    def __repr__(self) -> str:
        t = self.tensor
        what = "empty" if t is None else f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        return f"Blob({self.device}, {what}, {self.kind.value})"


class DistTensor:
    """A tensor over ``mesh``: ``blobs[global id]`` holds each local piece, laid out by ``placement``.

    In one process every device's Blob is here; under ``torch.distributed`` only this process's.
    """

    __slots__ = ("mesh", "placement", "shape", "dtype", "blobs", "layout")

    def __init__(self, mesh: DeviceMesh, placement: Placement, shape: Sequence[int], dtype: torch.dtype,
                 blobs: Mapping[int, Blob], layout: str = "strided") -> None:
        self.mesh = mesh
        self.placement = as_placement(placement)
        self.shape = tuple(shape)
        self.dtype = dtype
        self.blobs = dict(blobs)
        self.layout = layout  # "strided", or a block format: then ``shape``/``dtype`` are logical, pieces packed

    @classmethod
    def from_full(cls, t: torch.Tensor, mesh: DeviceMesh, placement: Placement | str,
                  ids: Sequence[int] | None = None) -> DistTensor:
        """Split a full tensor by ``placement`` onto each device (Replicate pieces alias ``t`` where it already
        lives there, else each device gets a copy; Partial puts ``t`` on the first device and zeros elsewhere
        for "sum", ``t`` everywhere for "max")."""
        pl = as_placement(placement)
        ids = tuple(ids) if ids is not None else mesh.ids
        blobs = {i: Blob(mesh.device(i), tensor=device_piece(t, pl, mesh.rank(i), mesh.size, mesh.device(i)))
                 for i in ids}
        return cls(mesh, pl, t.shape, t.dtype, blobs)

    @classmethod
    def from_local(cls, pieces: Mapping[int, torch.Tensor] | Sequence[torch.Tensor], mesh: DeviceMesh,
                   placement: Placement | str) -> DistTensor:
        """Build from each device's piece (a list in mesh order, or {global id: tensor}), each moved to its device."""
        pl = as_placement(placement)
        if not isinstance(pieces, Mapping):
            pieces = dict(zip(mesh.ids, pieces, strict=True))
        if not pieces:
            raise ArgumentError("DistTensor.from_local: no pieces given")
        first = next(iter(pieces.values()))
        shape = list(first.shape)
        if isinstance(pl, Shard):
            if len(pieces) != mesh.size:
                raise ArgumentError(f"DistTensor.from_local: Shard needs all {mesh.size} pieces, got {len(pieces)}")
            shape[pl.dim] = sum(p.shape[pl.dim] for p in pieces.values())
        blobs = {i: Blob(mesh.device(i), tensor=p.to(mesh.device(i).torch)) for i, p in pieces.items()}
        out = cls(mesh, pl, shape, first.dtype, blobs)
        for i, p in pieces.items():
            want = out.local_shape(i)
            if tuple(p.shape) != want:
                raise ShapeError(f"DistTensor.from_local: device {i} piece has shape {list(p.shape)}, "
                                 f"expected {list(want)} for {pl} of {shape}")
        return out

    def local_shape(self, device_id: int) -> tuple[int, ...]:
        if isinstance(self.placement, Shard):
            shape = list(self.shape)
            shape[self.placement.dim] = self.placement.sizes(self.shape[self.placement.dim], self.mesh.size)[
                self.mesh.rank(device_id)]
            return tuple(shape)
        return self.shape

    def local(self, device_id: int) -> torch.Tensor:
        """The piece global device ``device_id`` holds."""
        blob = self.blobs.get(device_id)
        if blob is None or blob.tensor is None:
            raise DeviceError(f"DistTensor: no local piece for device {device_id} in this process "
                              f"(held here: {sorted(self.blobs)})")
        return blob.tensor

    def full(self) -> torch.Tensor:
        """The whole tensor: a Replicate piece, the Shard pieces concatenated, or the Partial pieces reduced."""
        if self.layout != "strided":
            raise ArgumentError(f"DistTensor.full: the pieces of a {self.layout} tensor are packed per device; "
                                "dequantize each piece (dtorch.kernels.layouts.dequantize) instead")
        if isinstance(self.placement, Replicate):
            return self.local(next(iter(self.blobs)))
        if len(self.blobs) != self.mesh.size:
            raise CommunicationError(f"DistTensor.full: a {self.placement} tensor needs all {self.mesh.size} "
                                     f"pieces, this process holds {sorted(self.blobs)}; redistribute it to "
                                     f"Replicate() in the graph")
        first = self.local(self.mesh.ids[0])
        pieces = [self.local(i).to(first.device) for i in self.mesh.ids]  # on GPUs: peer copies to the first
        if isinstance(self.placement, Shard):
            return _unshard(pieces, self.placement, self.shape)
        stacked = torch.stack(pieces)
        return stacked.sum(0) if self.placement.op == "sum" else stacked.amax(0)

    def __repr__(self) -> str:
        layout = "" if self.layout == "strided" else f", {self.layout}"
        return f"DistTensor({list(self.shape)}, {str(self.dtype).removeprefix('torch.')}{layout}, {self.placement}, " \
               f"{self.mesh})"


def _unshard(pieces: list[torch.Tensor], shard: Shard, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole tensor from every device's piece of a (possibly blocked) shard."""
    d = shard.dim
    if shard.blocks is None:
        return torch.cat(pieces, dim=d)  # a plain or unit shard: the pieces follow each other
    n = len(pieces)
    runs = [[len_ for _, len_ in piece_ranges(shard, shape[d], r, n)] for r in range(n)]
    split = [p.split(r, dim=d) for p, r in zip(pieces, runs, strict=True)]
    return torch.cat([split[r][b] for b in range(len(shard.blocks)) for r in range(n)], dim=d)


def _on_gpu(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in a stream-ordered allocator (CUDA), where a cross-stream free must be recorded."""
    return t.is_cuda


def _current_stream(t: torch.Tensor) -> object:
    """The calling thread's current stream on ``t``'s device (a stream thread's is its own stream)."""
    return torch.cuda.current_stream(t.device)


def record_use(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, noted as used by work on the calling thread's current stream (a result handed to the caller, a
    feed copied on a stream thread): the allocator does not reuse its memory before that work has run."""
    if t is not None and _on_gpu(t):
        t.record_stream(_current_stream(t))
    return t


def mark_cross_stream_reads(kernels: Iterable[Any]) -> None:
    """Mark ``foreign`` every Blob that a kernel reads on a stream other than the one that writes it; a Blob no
    kernel writes (a param, a feed) is written by the caller, outside every stream, so its readers mark it."""
    writer = {id(b): k.stream for k in kernels for b in k.outputs}
    for k in kernels:
        for b in k.inputs:
            if b is not None and writer.get(id(b)) is not k.stream:
                b.foreign = True


def device_piece(t: torch.Tensor, placement: Placement, rank: int, n: int, device: Device) -> torch.Tensor:
    """``local_piece`` placed on ``device``: a copy when ``t`` lives elsewhere (each GPU of a Replicate gets its
    own), ``t`` itself or a view of it when it already lives there (every ``cpu:N`` is torch's cpu)."""
    target = device.torch
    if isinstance(placement, Partial) and placement.op == "sum" and rank != 0:
        return torch.zeros(t.shape, dtype=t.dtype, device=target)
    return local_piece(t, placement, rank, n).to(target)


def local_piece(t: torch.Tensor, placement: Placement, rank: int, n: int) -> torch.Tensor:
    """Device ``rank`` of ``n``'s piece of the full tensor ``t``."""
    if isinstance(placement, Shard):
        d = placement.dim
        runs = [t.narrow(d, start, length) for start, length in piece_ranges(placement, t.shape[d], rank, n)]
        piece = runs[0] if len(runs) == 1 else torch.cat(runs, d)
        return piece if piece.is_contiguous() else piece.contiguous()
    if isinstance(placement, Partial) and placement.op == "sum" and rank != 0:
        return torch.zeros_like(t)
    return t
