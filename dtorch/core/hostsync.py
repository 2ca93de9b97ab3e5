"""Forbid host reads of tensor values: the rule that a model step never syncs with the host, made checkable.

Inside ``forbid_host_sync()`` every torch call that reads a tensor's values on the host raises ``SyncError``
naming the call and the function that made it: ``.tolist()``, ``.item()``, ``bool/int/float/index(t)``,
``.numpy()``, ``nonzero`` / ``argwhere`` / one-argument ``where``, ``masked_select``, ``unique``, ``bincount``,
``repeat_interleave`` of tensor repeats without ``output_size``, boolean-mask indexing (get and set),
``equal`` / ``allclose`` / ``is_nonzero``, and ``.cpu()`` / ``.to(cpu)`` / a CPU ``copy_`` of a device tensor.
Ordinary device work (and allocation) is allowed. On CUDA the region also sets
``torch.cuda.set_sync_debug_mode("error")``, which catches the syncs torch makes inside its own ops.

torch function modes are per thread: a region covers the thread that opened it. The kernel streams cover their
own threads: ``KernelStream.execute`` enters the mode while ``ON`` is true, i.e. while ``DTORCH_FORBID_SYNC`` is
set or any thread has a region open, so a step's kernels are checked wherever they run.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

from dtorch.core import env
from dtorch.core.errors import SyncError

Tensor = torch.Tensor
_ALWAYS = {  # calls that read values whatever their arguments (a bool, a number, a value-sized result)
    Tensor.tolist, Tensor.item, Tensor.__bool__, Tensor.__int__, Tensor.__float__, Tensor.__index__,
    Tensor.__complex__, Tensor.numpy, Tensor.__array__, Tensor.__contains__, Tensor.is_nonzero, torch.is_nonzero,
    Tensor.nonzero, torch.nonzero, torch.argwhere, Tensor.argwhere, Tensor.masked_select, torch.masked_select,
    Tensor.unique, torch.unique, Tensor.unique_consecutive, torch.unique_consecutive, torch._unique,
    torch._unique2, Tensor.bincount, torch.bincount, torch.equal, Tensor.equal, torch.allclose, Tensor.allclose,
}
_REPEAT = {Tensor.repeat_interleave, torch.repeat_interleave}
_WHERE = {torch.where, Tensor.where}
_INDEX = {Tensor.__getitem__, Tensor.__setitem__}
_MOVE = {Tensor.cpu, Tensor.to, Tensor.numpy}
_MASKS = (torch.bool, torch.uint8)

_FLAG = env.forbid_sync()
_open = 0  # regions open in any thread
_lock = threading.Lock()
_local = threading.local()  # .depth: regions open in this thread
ON = _FLAG  # read by the kernel streams: enter the mode for each item they run


def _is_mask(index: object) -> bool:
    if isinstance(index, Tensor):
        return index.dtype in _MASKS
    if isinstance(index, (tuple, list)):
        return any(isinstance(i, Tensor) and i.dtype in _MASKS for i in index)
    return False


def _to_host(tensor: object, args: tuple, kwargs: dict) -> bool:
    """Whether ``tensor.to(*args, **kwargs)`` copies a device tensor to the CPU."""
    if not isinstance(tensor, Tensor) or tensor.device.type == "cpu":
        return False
    for a in (*args, kwargs.get("device")):
        if isinstance(a, Tensor):
            return a.device.type == "cpu"
        if isinstance(a, (str, torch.device)):
            return torch.device(a).type == "cpu"
    return False


def reads_host(func: object, args: tuple, kwargs: dict) -> bool:
    """Whether the torch call ``func(*args, **kwargs)`` reads tensor values on the host."""
    if func in _ALWAYS:
        return True
    if func in _INDEX:
        return len(args) > 1 and _is_mask(args[1])
    if func in _REPEAT:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if func is torch.repeat_interleave else 0)
        return isinstance(repeats, Tensor) and repeats.numel() != 1 and kwargs.get("output_size") is None
    if func in _WHERE:
        return len(args) + len(kwargs) == 1
    if func is Tensor.cpu:
        return isinstance(args[0], Tensor) and args[0].device.type != "cpu"
    if func is Tensor.to:
        return _to_host(args[0], args[1:], kwargs)
    if func is Tensor.copy_:
        return args[0].device.type == "cpu" and isinstance(args[1], Tensor) and args[1].device.type != "cpu"
    return False


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _caller() -> str:
    """file:line in function of the first frame outside torch and this module."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename == __file__ or f.f_code.co_filename.startswith(_TORCH_DIR)):
        f = f.f_back
    if f is None:
        return "?"
    return f"{f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})"


def _name(func: object) -> str:
    owner = "Tensor" if getattr(func, "__objclass__", None) is torch._C.TensorBase or func in _INDEX | _MOVE \
        else "torch"
    return f"{owner}.{getattr(func, '__name__', func)}"


class _Forbid(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if reads_host(func, args, kwargs):
            raise SyncError(f"{_name(func)} read tensor values on the host in {_caller()}, inside a "
                            "forbid_host_sync() region (DTORCH_FORBID_SYNC): a model step must not sync with the "
                            "host; validate such values where they are made (the step's feeds, on the host) and "
                            "keep the kernel on the device")
        return func(*args, **kwargs)


def _set_global(delta: int) -> None:
    """Count a region opened (+1) or closed (-1) in any thread; on CUDA set torch's sync debug mode to "error" at
    the first open and restore the mode in force before it at the last close."""
    global _open, ON, _cuda_before
    with _lock:
        _open += delta
        ON = _FLAG or _open > 0
        if torch.cuda.is_initialized():
            if delta > 0 and _open == 1:
                _cuda_before = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
            elif delta < 0 and _open == 0 and _cuda_before is not None:
                torch.cuda.set_sync_debug_mode(_cuda_before)
                _cuda_before = None


_cuda_before: int | None = None


@contextmanager
def forbid_host_sync() -> Iterator[None]:
    """While active in this thread (and in the kernel streams' threads, see the module docstring), a host read of
    tensor values raises ``SyncError``. Nested regions are one region."""
    depth = getattr(_local, "depth", 0)
    if depth:
        _local.depth = depth + 1
        try:
            yield
        finally:
            _local.depth = depth
        return
    _local.depth = 1
    _set_global(+1)
    try:
        with _Forbid():
            yield
    finally:
        _local.depth = 0
        _set_global(-1)


def forbidding() -> bool:
    """Whether this thread is inside a ``forbid_host_sync()`` region."""
    return getattr(_local, "depth", 0) > 0


__all__ = ["ON", "forbid_host_sync", "forbidding", "reads_host"]
