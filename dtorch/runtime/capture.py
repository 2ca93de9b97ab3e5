"""Recording a static Runner's kernels once and replaying them: CUDA graphs for the decode step.

A ``Recorder`` turns ``issue`` (a function that issues one run's device work, kernel after kernel, on the current
stream) into a ``Recording`` whose ``replay()`` issues the same work again in one call. ``CudaGraphRecorder``
records into a ``torch.cuda.CUDAGraph`` on a side stream; its recordings share one memory pool, so the temporaries
of every captured bucket of a model live in one pool (replays never overlap: one Runner runs at a time). Recording
requires every kernel to read no device value on the host (``KernelMeta.capture_safe``): the Runner binds only such
kernels when it is asked to capture, and says why it cannot when one is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from dtorch.core.device import Device


class Recording(Protocol):
    def replay(self) -> None: ...


class Recorder(Protocol):
    def record(self, issue: Callable[[], None]) -> Recording: ...


class CudaGraphRecorder:
    """Records on ``device`` (a cuda ``Device``) into CUDA graphs that share one memory pool."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.pool: Any = None  # the first graph's pool, handed to the later ones

    def record(self, issue: Callable[[], None]) -> Recording:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device.torch):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            # torch.cuda.graph synchronizes before and after recording and makes ``side`` current while ``issue``
            # runs, so every kernel (torch ops and triton launches alike) is recorded on it
            with torch.cuda.graph(graph, pool=self.pool, stream=side):
                issue()
            torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = graph.pool()
        return graph


def default_recorder(device: Device) -> Recorder | None:
    """The recorder for ``device``'s type, or None where there is nothing to record into (a CPU runs its kernels
    as they are issued; ``no_recorder`` says so)."""
    return CudaGraphRecorder(device) if device.type == "cuda" else None


def no_recorder(device: Device) -> str:
    """Why nothing records on ``device`` (where ``default_recorder`` is None)."""
    return f"nothing records kernels on {device.type} (CUDA graphs need a cuda device)"
