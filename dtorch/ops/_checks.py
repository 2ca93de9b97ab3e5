"""Validation helpers shared by the op wrappers; each raises the right ``DtorchError`` subclass."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from dtorch.core import hostsync
from dtorch.core.device import Device, device_of
from dtorch.core.dtypes import dtype_name
from dtorch.core.errors import ArgumentError, DeviceError, DTypeError, LayoutError, ShapeError

STRIDED = torch.strided  # the one layout with kernels (see dtorch.core.dtypes.LAYOUTS)


def tensor(op: str, name: str, t: object) -> torch.Tensor:
    """``t`` is a torch.Tensor of a layout that has kernels (strided)."""
    if not isinstance(t, torch.Tensor):
        raise DTypeError(f"{op}: argument {name!r} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not STRIDED:
        layout_error(op, name, t)
    return t


def layout_error(op: str, name: str, t: torch.Tensor) -> None:
    """Raise the ``LayoutError`` for a tensor whose layout is not strided."""
    raise LayoutError(f"{op}: argument {name!r} has layout {t.layout}, which has no kernel; dtorch kernels take "
                      f"strided (dense) tensors only (convert it with .to_dense())")


def host_readable(t: torch.Tensor) -> bool:
    """Whether a wrapper may read ``t``'s values to validate them: only on the CPU (a free read) and outside a
    ``forbid_host_sync()`` region. Values on a device are trusted: they are validated where they are made (a model
    step's feeds, built on the host), so no wrapper syncs with the device."""
    return t.device.type == "cpu" and not (hostsync.ON and hostsync.forbidding())


def dtype_in(op: str, name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        raise DTypeError(f"{op}: argument {name!r} has dtype {dtype_name(t.dtype)}; expected one of "
                         f"{', '.join(dtype_name(d) for d in allowed)}")


def same_dtype(op: str, named: dict[str, torch.Tensor]) -> torch.dtype:
    it = iter(named.items())
    first_name, first = next(it)
    for name, t in it:
        if t.dtype != first.dtype:
            raise DTypeError(f"{op}: dtypes disagree: {first_name!r} is {dtype_name(first.dtype)}, "
                             f"{name!r} is {dtype_name(t.dtype)}")
    return first.dtype


def on_device(op: str, name: str, t: torch.Tensor, ctx_device: Device | None) -> Device:
    """The device of ``t``, which must hold the context's device (type and index) when a context is given;
    every ``cpu:N`` holds torch's ``cpu`` tensors."""
    if ctx_device is not None:
        if t.device != ctx_device.torch:
            device_error(op, name, t, ctx_device)
        return ctx_device
    return device_of(t)


def device_error(op: str, name: str, t: torch.Tensor, expected: Device) -> None:
    """Raise the ``DeviceError`` for a tensor that is not on ``expected``'s torch device."""
    raise DeviceError(f"{op}: argument {name!r} is on {t.device}, but the context device is {expected} "
                      f"(torch device {expected.torch}; type and index must match)")


def same_device(op: str, named: dict[str, torch.Tensor], device: Device | None = None) -> Device:
    """All tensors on one device (and on ``device``, type and index, when given); returns it."""
    it = iter(named.items())
    first_name, first = next(it)
    if device is not None and first.device != device.torch:
        device_error(op, first_name, first, device)
    dev = device_of(first)
    for name, t in it:
        if t.device != first.device:
            raise DeviceError(f"{op}: devices disagree: {first_name!r} is on {first.device}, {name!r} on {t.device}")
    return device if device is not None else dev


def rank(op: str, name: str, t: torch.Tensor, *ranks: int) -> None:
    if t.dim() not in ranks:
        want = " or ".join(str(r) for r in ranks)
        raise ShapeError(f"{op}: argument {name!r} must have rank {want}, got shape {tuple(t.shape)}")


def dim_eq(op: str, what: str, got: int, want: int) -> None:
    if got != want:
        raise ShapeError(f"{op}: {what} must be {want}, got {got}")


def broadcast(op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Size:
    if a.shape == b.shape:
        return a.shape
    try:
        return torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        raise ShapeError(f"{op}: shapes {tuple(a.shape)} and {tuple(b.shape)} do not broadcast") from None


def out(op: str, out: object, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
        name: str = "out") -> torch.Tensor:
    """A caller-allocated output (``name``) must be a tensor of exactly ``shape``, ``dtype`` and ``device``."""
    if not isinstance(out, torch.Tensor):
        raise DTypeError(f"{op}: {name!r} must be a torch.Tensor, got {type(out).__name__}")
    if out.layout is not STRIDED:
        layout_error(op, name, out)
    if out.shape != shape and tuple(out.shape) != tuple(shape):
        raise ShapeError(f"{op}: {name!r} must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise DTypeError(f"{op}: {name!r} must have dtype {dtype_name(dtype)}, got {dtype_name(out.dtype)}")
    if out.device != device:
        raise DeviceError(f"{op}: {name!r} must be on {device}, got {out.device}")
    return out


def dense(op: str, named: dict[str, torch.Tensor]) -> None:
    for name, t in named.items():
        if not t.is_contiguous():
            raise LayoutError(f"{op}: the active kernel requires dense tensors; argument {name!r} with shape "
                              f"{tuple(t.shape)} has strides {t.stride()} (call .contiguous() first)")


def dim_index(op: str, dim: int, ndim: int) -> int:
    """Normalise a possibly negative ``dim`` for a tensor of rank ``ndim``."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise ArgumentError(f"{op}: 'dim' must be an int, got {type(dim).__name__}")
    lo, hi = (-ndim, ndim - 1) if ndim else (-1, 0)
    if not lo <= dim <= hi:
        raise ArgumentError(f"{op}: 'dim' {dim} is out of range for a tensor of rank {ndim} "
                            f"(expected {lo}..{hi})")
    return dim % ndim if ndim else 0


def positive_int(op: str, name: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ArgumentError(f"{op}: {name!r} must be an int >= {minimum}, got {value!r}")
    return value


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) bytes of memory ``t`` can touch (strides of any sign; conservative for gaps between rows)."""
    lo = hi = 0
    for size, stride in zip(t.shape, t.stride(), strict=True):
        reach = (size - 1) * stride
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    item = t.element_size()
    base = t.data_ptr()
    return base + lo * item, base + (hi + 1) * item


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory: same device and storage, and intersecting byte ranges
    (meta and empty tensors share nothing)."""
    if a.device != b.device or a.device.type == "meta" or not a.numel() or not b.numel():
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


def no_alias(op: str, outputs: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor | None]) -> None:
    """Refuse an output that overlaps an input or another output of the same call (the kernel would read what it
    has already overwritten). Ops that do allow in place say so in their docstring and do not call this."""
    named = list(outputs.items())
    for i, (name, out) in enumerate(named):
        others = [(n, t) for n, t in inputs.items() if t is not None] + named[i + 1:]
        for other, t in others:
            if overlaps(out, t):
                raise ArgumentError(f"{op}: {name!r} overlaps {other!r} (they share memory); {op} cannot write in "
                                    f"place: pass a separate {name!r} tensor (e.g. torch.empty_like)")


MAX_ELEMENTS = 2**40  # more elements than any one device holds today: a size this big is a mistake, not a request


def _device_bytes(device: torch.device) -> int | None:
    """Memory of ``device`` (CPU: the machine's physical memory; CUDA: the GPU's), or None when unknown."""
    try:
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
    except (ValueError, OSError, RuntimeError, AssertionError):
        return None
    return None


def allocation(op: str, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, before allocating, a tensor [shape] of more than 2**40 elements or more bytes than ``device`` has."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    limit = _device_bytes(device) if device.type != "meta" else None
    if numel > MAX_ELEMENTS or (limit is not None and nbytes > limit):
        room = f"{device} has {limit / 2**30:.1f} GiB" if limit is not None else f"the bound is {MAX_ELEMENTS} elements"
        raise ArgumentError(f"{op}: {name} of shape {tuple(shape)} would hold {numel} elements "
                            f"({nbytes / 2**30:.1f} GiB of {dtype_name(dtype)}), more than 2**40 elements or the "
                            f"device's memory ({room}); ask for a smaller size")
