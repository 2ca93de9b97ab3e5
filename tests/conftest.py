"""Shared test set-up: deterministic seeds, one intra-op thread per test process, and triton's interpreter (the
triton kernels run on CPU tensors; it is chosen when a kernel is decorated, so before any of them is imported;
a GPU run sets TRITON_INTERPRET=0 to compile them)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
