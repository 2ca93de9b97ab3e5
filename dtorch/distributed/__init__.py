"""Communicators: ``InProcessCommunicator`` for the devices of one process, ``TorchDistCommunicator``
over ``torch.distributed`` (gloo / NCCL) across processes and machines, whose ranks of one host talk through
shared memory (``dtorch.distributed.shm``)."""

from dtorch.distributed.inprocess import InProcessCommunicator
from dtorch.distributed.torchdist import TorchDistCommunicator, init_process_group

__all__ = ["InProcessCommunicator", "TorchDistCommunicator", "init_process_group"]
