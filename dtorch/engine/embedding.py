"""Embeddings on the engine: prompts whose final hidden states are pooled (last token or mean), L2-normalized.

The engine keeps embedding jobs in a queue of their own and runs them in steps of their own, taking turns with the
generation steps: a step takes jobs in arrival order while its token budget lasts (a long prompt goes in chunks over
several steps), computes every row's hidden state (the final norm's output, as transformers' ``last_hidden_state``)
and adds it to its job's pool. Jobs hold cache blocks only while they run and never share them (no prefix cache: a
mean needs every position computed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dtorch.core.errors import ArgumentError

POOLINGS = ("last", "mean")
EmbedSink = Callable[[str, "torch.Tensor | BaseException"], None]  # (job id, [H] float32 or the failure)


def check_pooling(pooling: str) -> str:
    if pooling not in POOLINGS:
        raise ArgumentError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    return pooling


@dataclass
class EmbedJob:
    """One prompt to embed: its ids, how to pool, and where it stands."""

    job_id: str
    ids: list[int]
    pooling: str
    sink: EmbedSink
    normalize: bool = True
    blocks: list[int] = field(default_factory=list)
    state_slot: int = -1
    computed: int = 0
    pool: torch.Tensor | None = None  # [H] float32: the sum (mean) or the last row (last)

    def add(self, rows: torch.Tensor) -> None:
        """This step's hidden rows of the job: [n, H]."""
        if self.pooling == "mean":
            s = rows.float().sum(0)
            self.pool = s if self.pool is None else self.pool + s
        else:
            self.pool = rows[-1].float()
        self.computed += rows.shape[0]

    def result(self) -> torch.Tensor:
        v = self.pool / len(self.ids) if self.pooling == "mean" else self.pool
        return torch.nn.functional.normalize(v, dim=0) if self.normalize else v
