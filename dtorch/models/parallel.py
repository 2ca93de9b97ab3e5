"""Where a model runs: the mesh, the communicator and this process's devices for a device and a tensor-parallel size.

In one process, ``tensor_parallel_size=n`` is ``DeviceMesh.cpu(n)`` (or n GPUs) with the in-process
communicator. Under ``torchrun`` (``torch.distributed`` initialised, or torchrun's ``WORLD_SIZE`` set) it is
one device per rank with ``TorchDistCommunicator`` (gloo on CPU, NCCL on GPU), and the world size must equal
``n``: every rank builds the same graphs and runs them SPMD.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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


def setup_mesh(device: str, tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> MeshSetup:
    """The mesh for ``device`` ("cpu" or "cuda"), ``tensor_parallel_size`` devices per stage and
    ``pipeline_parallel_size`` stages (see the module doc): with stages, a (pp, tp) mesh, stage after stage."""
    import torch.distributed as dist

    for name, value in (("tensor_parallel_size", tensor_parallel_size),
                        ("pipeline_parallel_size", pipeline_parallel_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ArgumentError(f"LLM: {name} must be an int >= 1, got {value!r}")
    pp = pipeline_parallel_size
    n = tensor_parallel_size * pp
    shape = ((pp, tensor_parallel_size), ("pp", "tp")) if pp > 1 else (None, None)
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
            sizes = f"tensor_parallel_size is {n}" if pp == 1 else \
                f"tensor_parallel_size x pipeline_parallel_size is {tensor_parallel_size} x {pp} = {n}"
            raise ArgumentError(f"LLM: torch.distributed has {world} ranks but {sizes}; run torchrun "
                                f"--nproc-per-node {n} (one device per rank), or pass sizes whose product is {world}")
        mesh = DeviceMesh.distributed(kind, *shape)
        comm = TorchDistCommunicator()
        return MeshSetup(mesh, comm, (rank,), rank, True, _past_group_timeout(comm.timeout))
    from dtorch.distributed.inprocess import InProcessCommunicator

    mesh = DeviceMesh.cuda(n, *shape) if kind == "cuda" else DeviceMesh.cpu(n, *shape)
    timeout = env.sync_timeout()
    return MeshSetup(mesh, InProcessCommunicator(mesh.ids, timeout=timeout), mesh.ids, 0, False, timeout)


def _past_group_timeout(group: float | None) -> float:
    """The step sync timeout under a process group whose collectives give up after ``group`` seconds: longer
    (by a step's own time at least), so that a stuck peer surfaces as the collective's CommunicationError naming
    the peer, not as a SyncTimeout of the step."""
    base = env.sync_timeout()
    return base if group is None else max(base, group + max(10.0, group / 4))


@dataclass(frozen=True, slots=True)
class Stage:
    """Pipeline stage ``index``: its layers run on ``mesh`` (its tensor-parallel group); the first stage also embeds
    the ids, the last also norms and projects to logits."""

    index: int
    mesh: DeviceMesh
    layers: range
    first: bool
    last: bool

    def holds(self, weight: str) -> bool:
        """Whether weight ``weight`` ("embed", "layers.3.qkv", "final_norm" ...) belongs to this stage."""
        if weight.startswith("layers."):
            return int(weight.split(".")[1]) in self.layers
        return self.first if weight == "embed" else self.last


def head_cost(config: Any) -> float:
    """What the vocabulary projection of ``config`` (a ``ModelConfig``) costs in layers, by their weights' sizes
    (attention and a dense MLP per layer): SmolLM2-135M's head of 49152 x 576 is about 8 of its 30 layers."""
    h = config.hidden_size
    layer = h * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads) + 3 * h * config.intermediate_size
    return config.vocab_size * h / layer if layer else 0.0


def pipeline_stages(mesh: DeviceMesh, num_layers: int, pp_layers: Sequence[int] | None = None,
                    head_layers: float = 0.0) -> tuple[Stage, ...]:
    """The stages of ``mesh`` (its "pp" axis; one stage without) over ``num_layers`` layers: contiguous runs, or
    ``pp_layers`` layers each. By default the work is spread evenly: the last stage, which also projects to the
    vocabulary (``head_layers``: what the head costs, in layers), takes that many fewer layers (at least one), and
    the others share the rest as evenly as it goes (the first ones take one more where it does not divide)."""
    p = mesh.pp_size
    if pp_layers is None:
        last = 0 if p == 1 else min(num_layers - (p - 1), max(1, round((num_layers + head_layers) / p - head_layers)))
        q, r = divmod(num_layers - last, p - 1 if p > 1 else 1)
        counts = [q + (s < r) for s in range(max(1, p - 1))] + ([last] if p > 1 else [])
    else:
        counts = list(pp_layers)
        if len(counts) != p or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts) \
                or sum(counts) != num_layers:
            raise ArgumentError(f"LLM: pp_layers must be {p} ints >= 1 (one per pipeline stage) adding up to the "
                                f"model's {num_layers} layers, got {counts}")
    if min(counts) < 1:
        raise ArgumentError(f"LLM: pipeline_parallel_size {p} is more than the model's {num_layers} layers")
    starts = list(itertools.accumulate(counts, initial=0))
    return tuple(Stage(s, mesh.stage(s), range(starts[s], starts[s + 1]), s == 0, s == p - 1) for s in range(p))
