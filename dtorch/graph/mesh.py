"""``DeviceMesh``: an n-dimensional grid of global device ids with axis names.

``DeviceMesh.cpu(n)`` is ``n`` CPU devices of this process (``cpu:0`` ... ``cpu:n-1``), so everything
multi-device runs on a machine without GPUs. ``DeviceMesh.distributed()`` spans the processes of an
initialised ``torch.distributed`` group, one device per process: global id ``r`` lives in rank ``r``, on
that process's own GPU (``local_cuda_index``) for "cuda".
A logical graph places tensors over ``mesh.ids`` in order (the mesh read as one axis).

A mesh with an axis named "pp" is pipelined: ``DeviceMesh.cpu(4, (2, 2), ("pp", "tp"))`` is two stages of two
devices each. ``stage(s)`` is the tensor-parallel group of stage ``s`` (a 1-D "tp" mesh): a stage's step graph is
placed on it, so its placement rules and collectives act within that group only, and activations cross from one
stage to the next by send/recv between the devices at the same tp coordinate (the same position in
``stage(s).ids``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

from dtorch.core.device import DEVICE_TYPES, Device
from dtorch.core.errors import ArgumentError, DeviceError


class DeviceMesh:
    """Global device ids arranged in ``shape`` with ``axis_names``; ``devices_per_process`` ids per process."""

    __slots__ = ("device_type", "ids", "shape", "axis_names", "devices_per_process", "device_index")

    def __init__(self, device_type: str, ids: Sequence[int], shape: Sequence[int] | None = None,
                 axis_names: Sequence[str] | None = None, devices_per_process: int | None = None,
                 device_index: Mapping[int, int] | None = None) -> None:
        if device_type not in DEVICE_TYPES or device_type == "meta":
            raise DeviceError(f"DeviceMesh: device_type must be 'cpu' or 'cuda', got {device_type!r}")
        ids = tuple(int(i) for i in ids)
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ArgumentError(f"DeviceMesh: ids must be distinct non-negative ints, got {ids}")
        shape = tuple(shape) if shape is not None else (len(ids),)
        if math.prod(shape) != len(ids):
            raise ArgumentError(f"DeviceMesh: shape {shape} holds {math.prod(shape)} devices, but {len(ids)} ids given")
        names = tuple(axis_names) if axis_names is not None else tuple(f"dim{i}" for i in range(len(shape)))
        if len(names) != len(shape) or len(set(names)) != len(names):
            raise ArgumentError(f"DeviceMesh: need {len(shape)} distinct axis names, got {names}")
        self.device_type = device_type
        self.ids = ids
        self.shape = shape
        self.axis_names = names
        self.devices_per_process = devices_per_process or len(ids)
        # global id -> local device index where it is not id % devices_per_process (a torchrun rank's own GPU)
        self.device_index = dict(device_index or {})

    @classmethod
    def cpu(cls, n: int, shape: Sequence[int] | None = None, axis_names: Sequence[str] | None = None) -> DeviceMesh:
        """``n`` CPU devices of this process, ``cpu:0`` ... ``cpu:n-1``."""
        if not isinstance(n, int) or n < 1:
            raise ArgumentError(f"DeviceMesh.cpu: n must be an int >= 1, got {n!r}")
        return cls("cpu", range(n), shape, axis_names)

    @classmethod
    def cuda(cls, n: int | None = None, shape: Sequence[int] | None = None,
             axis_names: Sequence[str] | None = None) -> DeviceMesh:
        """The visible GPUs of this process (or the first ``n``)."""
        import torch

        count = torch.cuda.device_count()
        n = count if n is None else n
        if n < 1 or n > count:
            raise DeviceError(f"DeviceMesh.cuda: asked for {n} GPUs, {count} visible")
        return cls("cuda", range(n), shape, axis_names)

    @classmethod
    def distributed(cls, device_type: str = "cpu", shape: Sequence[int] | None = None,
                    axis_names: Sequence[str] | None = None) -> DeviceMesh:
        """One device per process of the initialised ``torch.distributed`` world (global id = rank), arranged in
        ``shape`` (default: one axis).

        For "cuda", this rank's device is its local GPU (``local_cuda_index``), made the current CUDA device."""
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise DeviceError("DeviceMesh.distributed: torch.distributed is not initialised "
                              "(call dtorch.distributed.init_process_group first)")
        rank, world = dist.get_rank(), dist.get_world_size()
        index = {}
        if device_type == "cuda":
            index[rank] = local_cuda_index(rank)
            torch.cuda.set_device(index[rank])
        return cls(device_type, range(world), shape, axis_names, devices_per_process=1, device_index=index)

    # -- reading -------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.ids)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def axis_size(self, axis: str | int) -> int:
        return self.shape[self._axis(axis)]

    def _axis(self, axis: str | int) -> int:
        if isinstance(axis, int) and 0 <= axis < self.ndim:
            return axis
        if axis in self.axis_names:
            return self.axis_names.index(axis)
        raise ArgumentError(f"DeviceMesh: no axis {axis!r}; axes are {self.axis_names}")

    def coordinate(self, device_id: int) -> tuple[int, ...]:
        """The mesh coordinate of a global device id."""
        pos = self.rank(device_id)
        coord = []
        for s in reversed(self.shape):
            pos, r = divmod(pos, s)
            coord.append(r)
        return tuple(reversed(coord))

    def submesh(self, axis: str | int, device_id: int) -> DeviceMesh:
        """The 1-D mesh along ``axis`` through ``device_id`` (e.g. its tensor-parallel group)."""
        a = self._axis(axis)
        coord = list(self.coordinate(device_id))
        ids = []
        for i in range(self.shape[a]):
            coord[a] = i
            ids.append(self.ids[self._flat(coord)])
        return DeviceMesh(self.device_type, ids, (len(ids),), (self.axis_names[a],), self.devices_per_process,
                          self.device_index)

    # -- pipeline stages (an axis named "pp") ---------------------------------------------------

    @property
    def pp_size(self) -> int:
        """Pipeline stages: the extent of the "pp" axis (1 without one)."""
        return self.axis_size("pp") if "pp" in self.axis_names else 1

    @property
    def tp_size(self) -> int:
        """Devices per stage (the tensor-parallel group's size)."""
        return self.size // self.pp_size

    def stage(self, s: int) -> DeviceMesh:
        """The tensor-parallel group of pipeline stage ``s`` as a 1-D "tp" mesh (the mesh itself without a "pp"
        axis). The devices of one stage are those with pp coordinate ``s``, in mesh order."""
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self.pp_size:
            raise ArgumentError(f"DeviceMesh.stage: stage must be an int in [0, {self.pp_size}), got {s!r}")
        if "pp" not in self.axis_names:
            return self
        a = self._axis("pp")
        ids = tuple(i for i in self.ids if self.coordinate(i)[a] == s)
        return DeviceMesh(self.device_type, ids, (len(ids),), ("tp",), self.devices_per_process, self.device_index)

    def stage_of(self, device_id: int) -> int:
        """The pipeline stage of a global device id."""
        return self.coordinate(device_id)[self._axis("pp")] if "pp" in self.axis_names else 0

    def _flat(self, coord: Sequence[int]) -> int:
        pos = 0
        for c, s in zip(coord, self.shape, strict=False):
            pos = pos * s + c
        return pos

    def rank(self, device_id: int) -> int:
        """The position of a global device id in ``ids``."""
        try:
            return self.ids.index(device_id)
        except ValueError:
            raise DeviceError(f"DeviceMesh: device id {device_id} is not in the mesh {self.ids}") from None

    def process_of(self, device_id: int) -> int:
        return device_id // self.devices_per_process

    def device(self, device_id: int) -> Device:
        """The local ``Device`` that holds global id ``device_id`` in its own process."""
        index = self.device_index.get(device_id)
        return Device(self.device_type, device_id % self.devices_per_process if index is None else index)

    def local_ids(self, process: int = 0) -> tuple[int, ...]:
        """The ids driven by process ``process``."""
        return tuple(i for i in self.ids if self.process_of(i) == process)

    # device_index says where this process keeps its devices, not which mesh it is: not compared
    def __eq__(self, other: object) -> bool:
        return (isinstance(other, DeviceMesh) and self.device_type == other.device_type and self.ids == other.ids
                and self.shape == other.shape and self.devices_per_process == other.devices_per_process)

    def __hash__(self) -> int:
        return hash((self.device_type, self.ids, self.shape))

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape, strict=False))
        return f"DeviceMesh({self.device_type}, ids={list(self.ids)}, {axes})"


def local_cuda_index(rank: int) -> int:
    """The GPU of process ``rank`` on its machine: ``LOCAL_RANK`` when torchrun set it, else rank % GPUs."""
    import torch

    count = torch.cuda.device_count()
    if count < 1:
        raise DeviceError(f"DeviceMesh.distributed('cuda'): rank {rank} sees no GPU (torch.cuda.device_count() "
                          f"is 0); use device_type='cpu' with gloo, or check CUDA_VISIBLE_DEVICES")
    local = os.environ.get("LOCAL_RANK")  # torchrun's variable, not a dtorch flag
    if local is None:
        return rank % count
    if not local.isdigit() or int(local) >= count:
        raise DeviceError(f"DeviceMesh.distributed('cuda'): LOCAL_RANK={local!r} of rank {rank}, but this machine "
                          f"shows {count} GPU(s); start at most {count} processes per node (--nproc-per-node)")
    return int(local)
