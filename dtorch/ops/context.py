"""The two contexts of a prepared operator: what to prepare for, and where a step runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dtorch.core.device import Device, as_device
from dtorch.core.dtypes import LAYOUTS, as_dtype
from dtorch.core.errors import ArgumentError


@dataclass(slots=True)
class OperatorInitContext:
    """Prepare time: which (device, dtype, layout) a kernel is bound for, and whether it will be captured
    (``capture=True``: only candidates whose ``KernelMeta.capture_safe`` holds are chosen)."""

    device: Device | str = "cpu"
    dtype: torch.dtype | str = torch.float32
    layout: str = "strided"
    capture: bool = False

    def __post_init__(self) -> None:
        self.device = as_device(self.device)
        self.dtype = as_dtype(self.dtype)
        if self.layout not in LAYOUTS:
            raise ArgumentError(f"OperatorInitContext: layout must be one of {LAYOUTS}, got {self.layout!r}")


@dataclass(slots=True)
class RuntimeContext:
    """Run time: the device, the stream to issue on (None: current), a WorkspaceArena, the step index."""

    device: Device | str = "cpu"
    stream: Any = None
    workspace: Any = None
    step: int = 0

    def __post_init__(self) -> None:
        self.device = as_device(self.device)
