"""``Blob`` (the tensor of one device) and ``DistTensor`` (one Blob per device of a mesh).

A Blob links an operand of the graph to the memory of one device. The Runner counts, per run, the
kernels that still have to read it; when the last one has run the Blob drops its tensor (unless it
is pinned: a param or an output), which keeps peak memory near the live working set.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import torch

from dtorch.core.device import Device
from dtorch.core.errors import ArgumentError, CommunicationError, DeviceError, ShapeError
from dtorch.core.memory import MemoryKind
from dtorch.graph.mesh import DeviceMesh
from dtorch.graph.placement import Partial, Placement, Replicate, Shard, as_placement, shard_offsets, shard_sizes


class Blob:
    """The tensor one device holds for one operand (None until produced or after release)."""

    __slots__ = ("tensor", "device", "kind", "readers", "pinned", "_left", "_lock", "__weakref__")

    def __init__(self, device: Device, kind: MemoryKind = MemoryKind.ACTIVATION, tensor: torch.Tensor | None = None,
                 pinned: bool = False) -> None:
        self.tensor = tensor
        self.device = device
        self.kind = kind
        self.readers = 0  # kernels that read this blob in one run
        self.pinned = pinned
        self._left = 0
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Start of a run: every reader still has to read."""
        self._left = self.readers
        if not self.pinned:
            self.tensor = None

    def read_done(self) -> None:
        """One reader has run; the last one releases the tensor (unless pinned)."""
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

    __slots__ = ("mesh", "placement", "shape", "dtype", "blobs")

    def __init__(self, mesh: DeviceMesh, placement: Placement, shape: Sequence[int], dtype: torch.dtype,
                 blobs: Mapping[int, Blob]) -> None:
        self.mesh = mesh
        self.placement = as_placement(placement)
        self.shape = tuple(shape)
        self.dtype = dtype
        self.blobs = dict(blobs)

    @classmethod
    def from_full(cls, t: torch.Tensor, mesh: DeviceMesh, placement: Placement | str,
                  ids: Sequence[int] | None = None) -> DistTensor:
        """Split a full tensor by ``placement`` (Replicate pieces alias ``t``; Partial puts ``t`` on the first
        device and zeros elsewhere for "sum", ``t`` everywhere for "max")."""
        pl = as_placement(placement)
        ids = tuple(ids) if ids is not None else mesh.ids
        blobs = {i: Blob(mesh.device(i), tensor=local_piece(t, pl, mesh.rank(i), mesh.size)) for i in ids}
        return cls(mesh, pl, t.shape, t.dtype, blobs)

    @classmethod
    def from_local(cls, pieces: Mapping[int, torch.Tensor] | Sequence[torch.Tensor], mesh: DeviceMesh,
                   placement: Placement | str) -> DistTensor:
        """Build from each device's piece (a list in mesh order, or {global id: tensor})."""
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
        blobs = {i: Blob(mesh.device(i), tensor=p) for i, p in pieces.items()}
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
            shape[self.placement.dim] = shard_sizes(self.shape[self.placement.dim], self.mesh.size)[
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
        if isinstance(self.placement, Replicate):
            return self.local(next(iter(self.blobs)))
        if len(self.blobs) != self.mesh.size:
            raise CommunicationError(f"DistTensor.full: a {self.placement} tensor needs all {self.mesh.size} "
                                     f"pieces, this process holds {sorted(self.blobs)}; redistribute it to "
                                     f"Replicate() in the graph")
        pieces = [self.local(i) for i in self.mesh.ids]
        if isinstance(self.placement, Shard):
            return torch.cat(pieces, dim=self.placement.dim)
        stacked = torch.stack(pieces)
        return stacked.sum(0) if self.placement.op == "sum" else stacked.amax(0)

    def __repr__(self) -> str:
        return f"DistTensor({list(self.shape)}, {str(self.dtype).removeprefix('torch.')}, {self.placement}, " \
               f"{self.mesh})"


def local_piece(t: torch.Tensor, placement: Placement, rank: int, n: int) -> torch.Tensor:
    """Device ``rank`` of ``n``'s piece of the full tensor ``t``."""
    if isinstance(placement, Shard):
        d = placement.dim
        size = shard_sizes(t.shape[d], n)[rank]
        piece = t.narrow(d, shard_offsets(t.shape[d], n)[rank], size)
        return piece if piece.is_contiguous() else piece.contiguous()
    if isinstance(placement, Partial) and placement.op == "sum" and rank != 0:
        return torch.zeros_like(t)
    return t
