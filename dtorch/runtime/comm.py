"""The ``Communicator`` interface the collective kernels call.

Each call names the calling device by its global id and writes into a caller-allocated ``out``.
Every device issues the same collectives in the same order (the Runner pushes them in graph order
onto each device's communicate stream). Implementations live in ``dtorch.distributed``:
``InProcessCommunicator`` for the devices of one process, ``TorchDistCommunicator`` across processes.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch

# The communicator a Runner uses when none is given (resolved lazily: the distributed layer comes after runtime).
DEFAULT = "dtorch.distributed.inprocess:InProcessCommunicator"


class Communicator(ABC):
    """Collectives over the devices ``ids`` of a mesh; ``process`` is this process's index."""

    ids: tuple[int, ...]
    process: int = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self.ids)}, process {self.process})"

    @abstractmethod
    def all_reduce(self, device_id: int, x: torch.Tensor, out: torch.Tensor, op: str = "sum") -> None:
        """out = reduce(op) over every device's x; x, out: the same shape."""

    @abstractmethod
    def all_gather(self, device_id: int, x: torch.Tensor, out: torch.Tensor, dim: int = 0) -> None:
        """out = every device's x concatenated along ``dim`` in mesh order (pieces may be uneven)."""

    @abstractmethod
    def reduce_scatter(self, device_id: int, x: torch.Tensor, out: torch.Tensor, dim: int = 0,
                       op: str = "sum") -> None:
        """out = this device's piece (``torch.tensor_split`` along ``dim``) of reduce(op) over every x."""

    @abstractmethod
    def broadcast(self, device_id: int, x: torch.Tensor, out: torch.Tensor, src: int = 0) -> None:
        """out = x of device ``src``."""

    @abstractmethod
    def send(self, device_id: int, x: torch.Tensor, dst: int) -> None:
        """Send x to device ``dst`` (matched by one ``recv`` there)."""

    @abstractmethod
    def recv(self, device_id: int, out: torch.Tensor, src: int) -> None:
        """Receive into out what device ``src`` sent."""

    def group(self, ids: tuple[int, ...]) -> Communicator:
        """A communicator whose collectives span only ``ids`` (a pipeline stage's tensor-parallel group) and whose
        send/recv reach every device of this one (the other stages)."""
        if tuple(ids) == tuple(self.ids):
            return self
        raise NotImplementedError(f"{type(self).__name__} has no sub-groups; a pipeline needs a communicator "
                                  "that makes them (InProcessCommunicator, TorchDistCommunicator)")

    def apart(self) -> Communicator:
        """A communicator over the same devices whose collectives and messages never meet this one's (a draft model's
        pipeline, whose steps run while the target's micro-batches are in flight). Under torch.distributed every
        process must call it, in the same order (it makes process groups)."""
        raise NotImplementedError(f"{type(self).__name__} cannot make a communicator apart from itself; a draft model "
                                  "on a pipeline needs one (InProcessCommunicator, TorchDistCommunicator)")

    def abort(self) -> None:  # noqa: B027 - optional; the default does nothing
        """Wake every call blocked in a collective with a ``CommunicationError`` (a failed or stuck run)."""

    def reset(self) -> None:  # noqa: B027 - optional; the default does nothing
        """Make the communicator usable again after ``abort``."""

    def drop_messages(self) -> None:  # noqa: B027 - optional; the default does nothing
        """Forget sends no recv took (a pipelined step that failed between its stages), so the next step's recv
        never reads the failed one's activations."""

    def set_timeout(self, seconds: float) -> None:  # noqa: B027 - optional; the default does nothing
        """How long the next collectives wait for a peer (a Runner sets its run's timeout before each run);
        a communicator whose timeout is fixed elsewhere (a process group's) keeps its own."""

    def close(self) -> None:  # noqa: B027 - optional; the default does nothing
        """Release what the communicator holds."""


def default_communicator(ids: tuple[int, ...], timeout: float) -> Communicator:
    module, _, name = DEFAULT.partition(":")
    return getattr(importlib.import_module(module), name)(ids, timeout=timeout)
