"""GGUF block bytes into the packed rows of ``dtorch.kernels.layouts``, in C++ (csrc/repack.h): one pass over the
bytes, rows split over torch's intra-op threads, bit for bit ``layouts.pack``'s result (its torch code is the
reference, and the fallback for the formats and machines this does not serve)."""

from __future__ import annotations

import torch

from dtorch.core.memory import empty_weight
from dtorch.kernels import layouts
from dtorch.kernels.native import loader

# the formats csrc/repack.h packs (the others: layouts.pack)
NATIVE_LAYOUTS = ("gguf.q8_0", "gguf.q4_0", "gguf.q4_1", "gguf.q5_0", "gguf.q5_1", "gguf.iq4_nl", "gguf.q4_k",
                  "gguf.q6_k", "gguf.q8_0x16", "gguf.q5_0x16")


def x16_wanted(dtype: torch.dtype) -> bool:
    """Whether a model computing in ``dtype`` on the cpu keeps its Q8_0 / Q5_0 projections with 16 rows interleaved
    (``layouts.X16``): where the native kernels in use are AVX-512 VNNI's (``DTORCH_CPU_FEATURES=-avx512`` or
    ``-avx512_vnni`` turns it off) and serve matmul.linear on that layout. Elsewhere the layout would be read back as
    rows at every product: the row layout serves better. The pack cache keeps the answer in its identity."""
    from dtorch.dispatch import KernelKey, dispatcher

    try:
        lib = loader.load()
    except loader.NativeUnavailable:
        return False
    if lib.isa() != "avx512":
        return False
    return dispatcher.explain(KernelKey("matmul.linear", "cpu", dtype, "gguf.q8_0x16")).winner.provider == "native"


def repack(raw: torch.Tensor, layout: str, k: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """uint8 [N, row_bytes(layout, k)] from ``raw`` uint8 [N, GGUF row bytes] (rows of one stride, each dense: a
    view of the file map will do), or None where the native kernels do not load or do not pack ``layout`` (then
    ``layouts.pack`` does). ``out``: the result's storage, [N, row_bytes] contiguous."""
    if layout not in NATIVE_LAYOUTS or raw.dim() != 2 or raw.dtype != torch.uint8 or raw.device.type != "cpu":
        return None
    try:
        lib = loader.load()
    except loader.NativeUnavailable:
        return None
    if out is None:  # the weight's own memory: in 2 MiB pages from its first write, unless asked not to
        out = empty_weight((raw.shape[0], layouts.row_bytes(layout, k)), torch.uint8)
    return out if lib.repack(raw, out, layouts.format_code(layout), k) else None
