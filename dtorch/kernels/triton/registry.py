"""The triton backend's kernel declarations: every module of the package adds its kernels here."""

from __future__ import annotations

import torch

from dtorch.dispatch.registration import KernelSet

KERNELS = KernelSet(devices=("cuda",))
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
TRITON = {"provider": "triton"}
