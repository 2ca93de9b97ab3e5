"""Shape and dtype inference for ``LogicalGraph``: an op wrapper run on ``meta`` tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dtorch.core.errors import DtorchError, GraphError


class _MetaEmptyLike(torch.overrides.TorchFunctionMode):
    """``torch.empty_like`` of a contiguous meta tensor as ``torch.empty`` of its shape, while inferring.

    Torch's meta ``empty_like`` computes the output's strides through ``torch._refs``, which imports its symbolic
    shapes module and sympy: 33 MiB of resident memory in every process that builds a graph, for strides that a
    contiguous tensor already has.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty_like and len(args) == 1 and args[0].device.type == "meta":
            x, fmt = args[0], kwargs.get("memory_format", torch.preserve_format)
            rest = {k: v for k, v in kwargs.items() if k != "memory_format"}
            if (fmt is torch.contiguous_format or x.is_contiguous()) and set(rest) <= {"dtype", "device"}:
                return torch.empty(x.shape, dtype=rest.get("dtype") or x.dtype, device=rest.get("device") or x.device)
        return func(*args, **kwargs)


def infer_outputs(name: str, infer: Callable, metas: list, nout: int = 1) -> Any:
    """Run ``infer`` on ``metas`` (meta tensors) for graph operator ``name``: its output tensor, or tuple of ``nout``;
    a failure is a GraphError (or the wrapper's own DtorchError) naming the operator."""
    try:
        with _MetaEmptyLike():
            out = infer(metas)
    except DtorchError as exc:
        raise type(exc)(f"graph operator {name}: {exc}") from exc
    except Exception as exc:
        raise GraphError(f"graph operator {name}: inferring its output on meta tensors failed: "
                         f"{type(exc).__name__}: {exc} (give shape= and dtype= for a Python kernel)") from exc
    if isinstance(out, torch.Tensor) or (nout > 1 and isinstance(out, tuple)
                                         and all(isinstance(t, torch.Tensor) for t in out)):
        return out
    raise GraphError(f"graph operator {name}: must produce {'one tensor' if nout == 1 else f'{nout} tensors'}, "
                     f"got {type(out).__name__}")


def as_tuple(name: str, out: Any, nout: int) -> tuple[torch.Tensor, ...]:
    """An inferred output as a tuple of its ``nout`` tensors."""
    outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
    if len(outs) != nout:
        raise GraphError(f"graph operator {name}: inferred {len(outs)} outputs, expected {nout}")
    return outs


def meta_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")
