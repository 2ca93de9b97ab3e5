"""``KernelKey`` — the exact index of the kernel registry: (op, device type, dtype, layout)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import NamedTuple

import torch

from dtorch.core.device import DEVICE_TYPES, Device
from dtorch.core.dtypes import LAYOUTS, as_dtype, dtype_name
from dtorch.core.errors import ArgumentError


class KernelKey(NamedTuple):
    """``op`` is ``category.name`` (``binary.add``, ``llm.flash_attention``); ``device`` a device type.

    A NamedTuple so hashing in the hot path is a C tuple hash. Build checked keys with ``KernelKey.of``.
    """

    op: str
    device: str
    dtype: torch.dtype
    layout: str = "strided"

    @classmethod
    def of(cls, op: str, device: Device | str, dtype: torch.dtype | str, layout: str = "strided") -> KernelKey:
        """A checked key: ``op`` must be ``category.name``; device may be ``Device``, ``"cuda:1"`` or ``"cpu"``."""
        if not isinstance(op, str) or op.count(".") < 1 or op.startswith(".") or op.endswith("."):
            raise ArgumentError(f"op name must look like 'category.name' (e.g. 'binary.add'), got {op!r}")
        dev = device.type if isinstance(device, Device) else str(device).partition(":")[0]
        if dev not in DEVICE_TYPES:
            raise ArgumentError(f"KernelKey device must be one of {DEVICE_TYPES}, got {device!r}"
                                + _hint(dev, DEVICE_TYPES))
        if layout not in LAYOUTS:
            raise ArgumentError(f"KernelKey layout must be one of {LAYOUTS}, got {layout!r}" + _hint(layout, LAYOUTS))
        return cls(op, dev, as_dtype(dtype), layout)

    def __str__(self) -> str:
        suffix = "" if self.layout == "strided" else f"/{self.layout}"
        return f"{self.op}/{self.device}/{dtype_name(self.dtype)}{suffix}"


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """"did you mean 'x'?" naming the known name closest to a misspelled ``name``, or "" when none is close."""
    near = difflib.get_close_matches(name, sorted(known), n=1)
    return f"did you mean {near[0]!r}?" if near else ""


def _hint(name: str, known: Iterable[str]) -> str:
    hint = did_you_mean(name, known)
    return f"; {hint}" if hint else ""
