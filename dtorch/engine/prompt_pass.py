"""Prompt passes on the engine: prompts run once through the model for what their positions give, not to generate.

Two kinds: an embedding (``EmbedJob``: the final hidden states pooled, last token or mean, L2-normalized) and a
prompt's scoring (``ScoreJob``: each token's logprob given the tokens before it, and the top alternatives; OpenAI's
``echo`` with ``logprobs``). The engine keeps them in a queue of their own (``PromptPasses``) and runs them in steps
of their own, taking turns with the generation steps: a step takes jobs of the first job's kind in arrival order
while its token budget lasts (a long prompt goes in chunks over several steps, so no pass holds the engine for longer
than one step), and each job keeps only what it was asked for from its rows: an embedding its pool ([H]), a scoring
one float and ``top`` pairs per position (never the [T, vocab] logits). Jobs hold cache blocks only while they run
and never share them (no prefix cache: a mean needs every position computed). A job belongs to a group (the request
that asked for it): ``abort(group)`` ends every job of it, and the groups count against the engine's
``max_waiting`` until their last job ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from dtorch.core.errors import ArgumentError, DtorchError
from dtorch.models.executor import StepPlan

log = logging.getLogger("dtorch.engine")

POOLINGS = ("last", "mean")
PassSink = Callable[[str, Any], None]  # (job id, the job's result or the exception that ended it), engine thread
EmbedSink = PassSink  # the result: [H] float32


def check_pooling(pooling: str) -> str:
    if pooling not in POOLINGS:
        raise ArgumentError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    return pooling


class PassAborted(DtorchError):
    """The job's request was aborted (its client left) before the pass ended."""


@dataclass
class PassJob:
    """One prompt to run through the model: its ids, where it stands, and where its result goes."""

    hidden: ClassVar[bool]  # what its steps compute: final hidden states [n, H] (True) or logits [n, V]

    job_id: str
    ids: list[int]
    sink: PassSink
    group: str = ""  # the request it belongs to ("": its own id)
    blocks: list[int] = field(default_factory=list)
    state_slot: int = -1
    computed: int = 0

    def __post_init__(self) -> None:
        self.group = self.group or self.job_id

    def add(self, rows: torch.Tensor) -> None:
        """This step's rows of the job: positions ``computed`` .. ``computed + n - 1``."""
        raise NotImplementedError

    def result(self) -> Any:
        raise NotImplementedError


@dataclass
class EmbedJob(PassJob):
    """A prompt's final hidden states pooled: the last row, or the mean of every row."""

    hidden: ClassVar[bool] = True
    pooling: str = "last"
    normalize: bool = True
    pool: torch.Tensor | None = None  # [H] float32: the sum (mean) or the last row (last)

    def add(self, rows: torch.Tensor) -> None:  # rows: [n, H]
        if self.pooling == "mean":
            s = rows.float().sum(0)
            self.pool = s if self.pool is None else self.pool + s
        else:
            self.pool = rows[-1].float()
        self.computed += rows.shape[0]

    def result(self) -> torch.Tensor:
        v = self.pool / len(self.ids) if self.pooling == "mean" else self.pool
        return torch.nn.functional.normalize(v, dim=0) if self.normalize else v


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """A scored prompt of T tokens: ``values[i]`` is the logprob of token i + 1 after tokens 0..i (T - 1 of them;
    the first token has none), ``top[i]`` the ``top`` most likely tokens there as (id, logprob), most likely first."""

    values: list[float]
    top: list[list[tuple[int, float]]]


@dataclass
class ScoreJob(PassJob):
    """A prompt's own tokens' logprobs (and ``top`` alternatives), position by position as its chunks run."""

    hidden: ClassVar[bool] = False
    top: int = 0
    values: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)

    def add(self, rows: torch.Tensor) -> None:  # rows: [n, V] logits; row j predicts token computed + j + 1
        n, at = rows.shape[0], self.computed
        following = torch.tensor(self.ids[at + 1:at + n + 1], dtype=torch.int64)  # n, or n - 1 at the prompt's end
        m = following.numel()
        if m:
            lp = torch.log_softmax(rows[:m].float(), dim=-1)  # [m, V], freed with this step
            self.values += lp.gather(1, following[:, None])[:, 0].tolist()
            if self.top:
                best = torch.topk(lp, self.top, dim=-1)
                self.tops += [list(zip(i, v, strict=True))
                              for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)]
        self.computed += n

    def result(self) -> PromptLogprobs:
        return PromptLogprobs(self.values, self.tops if self.top else [[] for _ in self.values])


class PromptPasses:
    """The engine's prompt-pass jobs in arrival order, and the steps that run them (see the module's docstring).

    ``groups`` (jobs not yet ended, per group) is changed by the threads that add jobs and by the engine's thread,
    under ``lock``."""

    def __init__(self) -> None:
        self.jobs: deque[PassJob] = deque()
        self.groups: Counter[str] = Counter()
        self.lock = threading.Lock()
        self._next = False  # steps alternate while both kinds of work wait

    def admit(self, job: PassJob, room: Callable[[int], bool]) -> bool:
        """Count ``job`` in its group (call before handing it to the engine); False, counting nothing, when its group
        is new and ``room(groups)`` says the engine's queue has no room for it."""
        with self.lock:
            if job.group not in self.groups and not room(len(self.groups)):
                return False
            self.groups[job.group] += 1
            return True

    def turn(self, generating: bool) -> bool:
        """Whether the engine's next step is a pass step (``generating``: sequences run or wait)."""
        mine = bool(self.jobs) and (self._next or not generating)
        self._next = not mine
        return mine

    def step(self, engine: Any) -> bool:
        """One step of jobs of the first job's kind on ``engine``'s model, in arrival order within its token budget;
        False when none could start (no free blocks or state slots yet)."""
        blocks, scheduler, state = engine.blocks, engine.scheduler, engine.cache.has_state
        budget, plan = scheduler.config.max_num_batched_tokens, []
        hidden = self.jobs[0].hidden if self.jobs else True
        for job in self.jobs:
            if budget <= 0:
                break
            if job.hidden != hidden:
                continue
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
            # [T, H] hidden states, or [T, V] logits of this step's rows only (at most the step's token budget)
            rows = engine.executor.step(StepPlan.chunks(plan, state), all_logits=not hidden, hidden=hidden)
            at = 0
            for job, n in plan:
                job.add(rows[at:at + n])
                at += n
        except BaseException as exc:
            for job, _ in plan:
                self._done(engine, job, exc)
            raise
        del rows
        for job, _ in plan:
            if job.computed == len(job.ids):
                self._done(engine, job, job.result())
        engine.count_prefill(at, time.perf_counter() - t0)
        return True

    def abort(self, engine: Any, group: str) -> None:
        """End the jobs of ``group`` (or the job of that id), their sinks getting ``PassAborted``."""
        for job in [j for j in self.jobs if group in (j.group, j.job_id)]:
            self._done(engine, job, PassAborted(f"the pass {job.job_id!r} was aborted"))

    def fail_all(self, engine: Any, exc: BaseException) -> None:
        for job in list(self.jobs):
            self._done(engine, job, exc)

    def _done(self, engine: Any, job: PassJob, result: Any) -> None:
        self.jobs.remove(job)
        engine.scheduler.release(job)
        with self.lock:
            self.groups[job.group] -= 1
            if self.groups[job.group] <= 0:
                del self.groups[job.group]
        try:
            job.sink(job.job_id, result)
        except Exception:
            log.exception("the sink of pass %r failed", job.job_id)
