"""Embeddings on the engine: prompts whose final hidden states are pooled (last token or mean), L2-normalized.

The engine keeps embedding jobs in a queue of their own and runs them in steps of their own, taking turns with the
generation steps: a step takes jobs in arrival order while its token budget lasts (a long prompt goes in chunks over
several steps), computes every row's hidden state (the final norm's output, as transformers' ``last_hidden_state``)
and adds it to its job's pool. Jobs hold cache blocks only while they run and never share them (no prefix cache: a
mean needs every position computed).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dtorch.core.errors import ArgumentError
from dtorch.models.executor import StepPlan

log = logging.getLogger("dtorch.engine")

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


class EmbeddingQueue:
    """The engine's embedding jobs in arrival order, and the steps that run them (see the module's docstring)."""

    def __init__(self) -> None:
        self.jobs: deque[EmbedJob] = deque()
        self._next = False  # steps alternate while both kinds of work wait

    def turn(self, generating: bool) -> bool:
        """Whether the engine's next step is an embedding step (``generating``: sequences run or wait)."""
        mine = bool(self.jobs) and (self._next or not generating)
        self._next = not mine
        return mine

    def step(self, engine: Any) -> bool:
        """One step of jobs on ``engine``'s model, in arrival order within its token budget; False when none could
        start (no free blocks or state slots yet)."""
        blocks, scheduler, state = engine.blocks, engine.scheduler, engine.cache.has_state
        budget, plan = scheduler.config.max_num_batched_tokens, []
        for job in self.jobs:
            if budget <= 0:
                break
            if not job.blocks:
                need = blocks.blocks_for(len(job.ids))
                if need > blocks.num_free or (state and not scheduler.free_state_slots):
                    break
                job.blocks = blocks.allocate(need)
                if state:
                    job.state_slot = scheduler.take_state_slot()
            n = min(len(job.ids) - job.computed, budget)
            plan.append((job, n))
            budget -= n
        if not plan:
            return False
        t0 = time.perf_counter()
        try:
            hidden = engine.executor.step(StepPlan.chunks(plan, state), hidden=True)  # [T, H]
        except BaseException as exc:
            for job, _ in plan:
                self._done(engine, job, exc)
            raise
        at = 0
        for job, n in plan:
            job.add(hidden[at:at + n])
            at += n
            if job.computed == len(job.ids):
                self._done(engine, job, job.result())
        engine.count_prefill(at, time.perf_counter() - t0)
        return True

    def fail_all(self, engine: Any, exc: BaseException) -> None:
        for job in list(self.jobs):
            self._done(engine, job, exc)

    def _done(self, engine: Any, job: EmbedJob, result: torch.Tensor | BaseException) -> None:
        self.jobs.remove(job)
        engine.scheduler.release(job)
        try:
            job.sink(job.job_id, result)
        except Exception:
            log.exception("the sink of embedding %r failed", job.job_id)
