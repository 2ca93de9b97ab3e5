"""``Device``: a device type and an index, e.g. ``cpu:1`` or ``cuda:0``.

Several CPU devices (``cpu:0``, ``cpu:1``, ...) live in one process and all hold ordinary
torch CPU tensors; they exist so that multi-device code runs on machines without GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache

import torch

from dtorch.core.errors import DeviceError

# "meta" holds shape-only tensors: graphs infer metadata by running the op wrappers on them.
DEVICE_TYPES = ("cpu", "cuda", "meta")


@dataclass(frozen=True, slots=True)
class Device:
    """A device: ``type`` is "cpu" or "cuda", ``index`` its number within that type."""

    type: str
    index: int = 0

    def __post_init__(self) -> None:
        if self.type not in DEVICE_TYPES:
            raise DeviceError(f"device type must be one of {DEVICE_TYPES}, got {self.type!r}")
        if not isinstance(self.index, int) or self.index < 0:
            raise DeviceError(f"device index must be a non-negative int, got {self.index!r}")

    @property
    def torch(self) -> torch.device:
        """The torch device holding this device's tensors (every ``cpu:N`` is torch's ``cpu``)."""
        return _torch_device(self.type, self.index)

    def __str__(self) -> str:
        return f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        return f"Device('{self}')"


@cache
def _torch_device(type_: str, index: int) -> torch.device:
    if type_ in ("cpu", "meta"):
        return torch.device(type_)
    return torch.device(type_, index)


DeviceLike = "Device | str | torch.device"


def as_device(device: Device | str | torch.device) -> Device:
    """Parse ``"cpu"``, ``"cpu:1"``, ``"cuda"``, a ``torch.device`` or a ``Device``."""
    if isinstance(device, Device):
        return device
    if isinstance(device, torch.device):
        return Device(device.type, device.index or 0)
    if isinstance(device, str):
        return _parse(device)
    raise DeviceError(f"expected a device (Device, 'cpu:0', torch.device), got {type(device).__name__}")


@lru_cache(maxsize=64)
def _parse(text: str) -> Device:
    type_, _, index = text.strip().partition(":")
    if index and not index.isdigit():
        raise DeviceError(f"cannot parse device {text!r}: the index after ':' must be a number")
    return Device(type_, int(index) if index else 0)


_OF_TORCH: dict[torch.device, Device] = {}


def device_of(t: torch.Tensor) -> Device:
    """The dtorch device of a torch tensor (a CPU tensor is ``cpu:0``); cached per torch device."""
    d = t.device
    found = _OF_TORCH.get(d)
    if found is None:
        found = _OF_TORCH[d] = as_device(d)
    return found
