"""Dtype and layout helpers: names, families, and the tolerance each dtype is compared with."""

from __future__ import annotations

import torch

from dtorch.core.errors import DTypeError

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INT_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)
ALL_DTYPES: tuple[torch.dtype, ...] = FLOAT_DTYPES + INT_DTYPES

# "strided": ordinary torch tensors. "gguf.*": a weight [N, K] kept in a GGUF block format, stored as a
# uint8 tensor [N, row bytes] (see dtorch/kernels/layouts.py); kernels for these layouts take it as is.
GGUF_LAYOUTS = ("gguf.q8_0", "gguf.q4_0", "gguf.q4_1", "gguf.q4_k", "gguf.q6_k", "gguf.q5_0", "gguf.q5_1",
                "gguf.iq4_nl", "gguf.q2_k", "gguf.q3_k", "gguf.q5_k", "gguf.iq4_xs")
# Q8_0 / Q5_0 with 16 rows interleaved (dtorch/kernels/layouts.py): the projections' layout where AVX-512 VNNI runs
GGUF_X16_LAYOUTS = ("gguf.q8_0x16", "gguf.q5_0x16")
LAYOUTS = ("strided",) + GGUF_LAYOUTS + GGUF_X16_LAYOUTS + ("f16", "bf16")

# (rtol, atol) used by tests and by verify mode to compare two kernels' outputs.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
    torch.int32: (0.0, 0.0),
    torch.int64: (0.0, 0.0),
}

_BY_NAME = {str(d).removeprefix("torch."): d for d in ALL_DTYPES}
_BY_NAME.update({"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16,
                 "half": torch.float16, "float": torch.float32, "double": torch.float64})


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Parse ``"bfloat16"``, ``"bf16"``, ``"torch.float32"`` or a ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        found = _BY_NAME.get(dtype.removeprefix("torch."))
        if found is not None:
            return found
    raise DTypeError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(_BY_NAME))}")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing results computed in ``dtype``."""
    return TOLERANCE.get(dtype, (1e-4, 1e-5))


def is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point
