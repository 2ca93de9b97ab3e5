"""Shared test set-up: deterministic seeds and one intra-op thread per test process."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
