"""Where a model runs: the mesh, the communicator and this process's devices for a device and a tensor-parallel size.

In one process, ``tensor_parallel_size=n`` is ``DeviceMesh.cpu(n)`` (or n GPUs) with the in-process
communicator. Under ``torchrun`` (``torch.distributed`` initialised, or torchrun's ``WORLD_SIZE`` set) it is
one device per rank with ``TorchDistCommunicator`` (gloo on CPU, NCCL on GPU), and the world size must equal
``n``: every rank builds the same graphs and runs them SPMD.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dtorch.core import env
from dtorch.core.errors import ArgumentError, DeviceError
from dtorch.graph import DeviceMesh
from dtorch.runtime.comm import Communicator


@dataclass(frozen=True, slots=True)
class MeshSetup:
    mesh: DeviceMesh
    communicator: Communicator
    local_ids: tuple[int, ...]
    rank: int  # this process's rank (0 in one process)
    spmd: bool  # one process per device under torch.distributed
    timeout: float  # seconds a step's synchronization waits (SPMD: past the process group's own timeout)


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of several started by torchrun (WORLD_SIZE > 1)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def setup_mesh(device: str, tensor_parallel_size: int) -> MeshSetup:
    """The mesh for ``device`` ("cpu" or "cuda") and ``tensor_parallel_size`` devices (see the module doc)."""
    import torch.distributed as dist

    n = tensor_parallel_size
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ArgumentError(f"LLM: tensor_parallel_size must be an int >= 1, got {n!r}")
    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise DeviceError(f"LLM: device must be 'cpu' or 'cuda', got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise DeviceError("LLM: device 'cuda' asked for, but this torch has no usable CUDA device "
                          f"(torch {torch.__version__}, cuda available: False); use device='cpu'")
    if launched_by_torchrun() and not (dist.is_available() and dist.is_initialized()):
        from dtorch.distributed.torchdist import init_process_group

        init_process_group(backend="nccl" if kind == "cuda" else "gloo")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from dtorch.distributed.torchdist import TorchDistCommunicator

        world, rank = dist.get_world_size(), dist.get_rank()
        if world != n:
            raise ArgumentError(f"LLM: torch.distributed has {world} ranks but tensor_parallel_size is {n}; run "
                                f"torchrun --nproc-per-node {n} (one device per rank), or pass "
                                f"--tensor-parallel-size {world}")
        mesh = DeviceMesh.distributed(kind)
        comm = TorchDistCommunicator()
        return MeshSetup(mesh, comm, (rank,), rank, True, _past_group_timeout(comm.timeout))
    from dtorch.distributed.inprocess import InProcessCommunicator

    mesh = DeviceMesh.cuda(n) if kind == "cuda" else DeviceMesh.cpu(n)
    timeout = env.sync_timeout()
    return MeshSetup(mesh, InProcessCommunicator(mesh.ids, timeout=timeout), mesh.ids, 0, False, timeout)


def _past_group_timeout(group: float | None) -> float:
    """The step sync timeout under a process group whose collectives give up after ``group`` seconds: longer
    (by a step's own time at least), so that a stuck peer surfaces as the collective's CommunicationError naming
    the peer, not as a SyncTimeout of the step."""
    base = env.sync_timeout()
    return base if group is None else max(base, group + max(10.0, group / 4))
