"""What a kernel receives besides its tensors: ``KernelContext`` and its owned ``KernelParams``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from dtorch.core.device import Device
from dtorch.core.errors import ArgumentError

_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, Device)


def _freeze(name: str, value: Any) -> Any:
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(name, v) for v in value)
    if isinstance(value, torch.Tensor):
        raise ArgumentError(f"KernelParams: {name!r} is a tensor; pass tensors as kernel inputs, not params")
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(f"{name}.{k}", v) for k, v in value.items()})
    if callable(value) or hasattr(value, "__dataclass_fields__"):
        return value  # functions and (frozen) dataclasses are kept by reference
    raise ArgumentError(f"KernelParams: {name!r} has type {type(value).__name__}; params must be immutable "
                        "values (numbers, str, bool, None, dtype, tuples of them)")


class KernelParams:
    """An immutable bag of non-tensor parameters, owned by whoever holds it.

    Values are copied and frozen at construction (lists become tuples), so a kernel queued on an
    asynchronous stream never reads a value the caller changed or freed afterwards.
    ``p = KernelParams(eps=1e-6); p.eps; p.get("scale", None)``.
    """

    __slots__ = ("_items",)

    def __init__(self, **items: Any) -> None:
        object.__setattr__(self, "_items", {k: _freeze(k, v) for k, v in items.items()})

    def __getattr__(self, name: str) -> Any:
        try:
            return self._items[name]
        except KeyError:
            if name.startswith("__"):  # a protocol probe (help, copy, pickle), not a missing param
                raise AttributeError(name) from None
            raise ArgumentError(f"kernel param {name!r} was not given; params are {sorted(self._items)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise ArgumentError("KernelParams are immutable; build a new one with .replace(...)")

    def get(self, name: str, default: Any = None) -> Any:
        return self._items.get(name, default)

    def replace(self, **changes: Any) -> KernelParams:
        return KernelParams(**{**self._items, **changes})

    def items(self) -> Iterator[tuple[str, Any]]:
        return iter(self._items.items())

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KernelParams) and self._items == other._items

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in self._items.items())))

    def __repr__(self) -> str:
        return "KernelParams(" + ", ".join(f"{k}={v!r}" for k, v in self._items.items()) + ")"


NO_PARAMS = KernelParams()


class KernelContext(NamedTuple):
    """Everything a kernel gets besides tensors: its device, stream, workspace and params.

    ``stream`` is None for the current stream (a ``torch.cuda.Stream`` on CUDA devices);
    ``workspace`` a ``WorkspaceArena`` or None.
    """

    device: Device
    stream: Any = None
    workspace: Any = None
    params: KernelParams = NO_PARAMS
