"""The declaration list every kernel file adds to, and the dtype groups kernels are declared for."""

from __future__ import annotations

import torch

from dtorch.dispatch.registration import KernelSet

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INTS = (torch.int32, torch.int64)
NUMERIC = FLOATS + INTS

# Kernels written with torch primitives run wherever torch does, so they are declared for both
# device types; device-specific kernels (BLAS tricks, Triton) name their device explicitly.
KERNELS = KernelSet(devices=("cpu", "cuda"))
