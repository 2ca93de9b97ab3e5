"""The kernel ABI, checked where it costs nothing: a kernel writes into the outputs it is given and returns None
(or those outputs themselves: ``lambda ctx, ins, outs: outs[0].copy_(ins[0])`` keeps the ABI).

An output that a kernel resized, retyped or re-pointed at other storage (``out.resize_``, ``out.set_``) would reach
the caller with no error, and a kernel that returns its result instead of writing it leaves the outputs unwritten.
``snapshot`` / ``check`` compare an output's (shape, stride, dtype, data pointer) before and after a call; who calls
them when is said where they are called (``PreparedKernel``'s first call after each bind, the functional path's
first call of each candidate, every call in verify mode).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtorch.core.errors import KernelFailure

Facts = tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype, int], ...]


def snapshot(outputs: Sequence[torch.Tensor]) -> Facts:
    """(shape, stride, dtype, data pointer) of each output: what a kernel must leave as it found it."""
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.data_ptr()) for t in outputs)


def check(name: str, where: str, before: Facts, outputs: Sequence[torch.Tensor], returned: object) -> None:
    """Raise ``KernelFailure`` naming kernel ``name`` (run for ``where``) if it returned a value or changed an
    output's shape, stride, dtype or storage."""
    if not returns_outputs(returned, outputs):
        raise KernelFailure(f"{where}: kernel {name} returned a {type(returned).__name__} that is not one of its "
                            f"outputs; a kernel writes its result into the outputs it is given and returns None")
    for i, (t, (shape, stride, dtype, ptr)) in enumerate(zip(outputs, before, strict=True)):
        if tuple(t.shape) != shape or t.dtype != dtype or t.stride() != stride or t.data_ptr() != ptr:
            raise KernelFailure(f"{where}: kernel {name} changed output {i} from {list(shape)} {dtype} to "
                                f"{list(t.shape)} {t.dtype}{' in other storage' if t.data_ptr() != ptr else ''}; "
                                f"a kernel must write into its outputs in place, keeping their shape, dtype and "
                                f"storage")


def returns_outputs(returned: object, outputs: Sequence[torch.Tensor]) -> bool:
    """Whether ``returned`` is None or the outputs themselves (an output, or a tuple / list of them)."""
    if returned is None or any(returned is t for t in outputs):
        return True
    return isinstance(returned, (tuple, list)) and all(any(r is t for t in outputs) for r in returned)


def inputs_unchanged(name: str, where: str, inputs: Sequence, before: Sequence, outputs: Sequence[torch.Tensor]
                     ) -> None:
    """Raise ``KernelFailure`` if kernel ``name`` wrote into an input that is not also one of its outputs
    (``before``: copies of ``inputs`` taken before the call; an input sharing storage with an output is the
    in-place case and may change)."""
    written = {t.untyped_storage().data_ptr() for t in outputs}
    for i, (t, old) in enumerate(zip(inputs, before, strict=True)):
        if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in written:
            continue
        if not _same_bits(t, old):
            raise KernelFailure(f"{where}: kernel {name} wrote into input {i} ({list(t.shape)} {t.dtype}); a kernel "
                                f"may write only its outputs")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal (NaN equals NaN of the same bits); the tensors have the same shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
