"""The scheduler: continuous batching with chunked prefill and preemption, first come first served.

Every step it picks, within ``max_num_seqs`` running sequences and ``max_num_batched_tokens`` tokens:

1. the running sequences, oldest first, each with its next tokens (one for a decoding sequence, the next chunk of
   the prompt for one still prefilling). When the cache has no block for one, the newest running sequence is
   preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed later (its
   generated tokens are kept and become part of what it recomputes). Nothing is lost.
2. then, if nothing was preempted, waiting sequences in arrival order while tokens, sequence slots and blocks
   allow: each first takes the cached blocks of its longest cached prompt prefix, then computes from there. The
   other choices of a request with ``n`` > 1 wait until its first choice has computed the prompt, then share its
   blocks the same way.

A sequence's tokens are ``ids`` (prompt, then what it generated); ``computed`` of them have keys in the cache.

Sliding windows: when every attention layer of the model slides (``window``, the widest), a running sequence's blocks
that lie wholly before the window of its next token are freed before each step (its entry in ``blocks`` becomes -1),
so a long generation holds about its window of cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq, Set
from dataclasses import dataclass
from typing import Any

import torch

from dtorch.engine.block_manager import BlockManager
from dtorch.engine.request import Sink
from dtorch.engine.sampling import SamplingParams


class Sequence:
    """One choice of one request as it runs."""

    __slots__ = ("request_id", "index", "params", "ids", "num_prompt", "sink", "generator", "blocks", "computed",
                 "prefix_key", "state_slot", "decoder", "text", "emitted", "limit", "stop_ids", "finish_reason",
                 "stop_reason", "cached_tokens", "output_ids", "matcher", "spec")

    def __init__(self, request_id: str, index: int, prompt: list[int], params: SamplingParams, sink: Sink,
                 limit: int, stop_ids: frozenset[int], decoder,
                 device: torch.device | str = "cpu", matcher=None) -> None:
        self.request_id, self.index, self.params, self.sink = request_id, index, params, sink
        self.ids = list(prompt)
        self.num_prompt = len(prompt)
        self.output_ids: list[int] = []
        # sampling draws on the logits' device: no copy of the probabilities to the host per step
        self.generator: torch.Generator | None = None if params.greedy else params.generator(index, device)
        self.blocks: list[int] = []
        self.computed = 0
        self.prefix_key = -1
        self.state_slot = -1
        self.decoder = decoder
        self.text = ""
        self.emitted = 0  # characters of text already sent
        self.limit = limit  # new tokens at most
        self.stop_ids = stop_ids
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cached_tokens = 0
        self.matcher = matcher  # the grammar's state over output_ids (structured outputs), or None
        self.spec = None  # what speculative decoding keeps for it (``speculative.SeqSpec``), or None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


class Scheduler:
    """Which sequences run in the next step, and how many of their tokens; owns the waiting and running queues."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager, num_state_slots: int = 0,
                 reset_state=None, window: int | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.window = window  # keys past which no layer looks (None: some layer reads them all)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._state_slots = list(range(num_state_slots - 1, -1, -1)) if num_state_slots else None
        self._reset_state = reset_state
        self.preemptions = 0
        self.prefix_queries = 0  # prompt tokens of admitted sequences
        self.prefix_hits = 0  # of them, found in the prefix cache

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, busy: Set[int] = frozenset(), max_seqs: int | None = None) -> list[tuple[Sequence, int]]:
        """The step: (sequence, tokens to compute from ``seq.computed``) pairs, running sequences first.

        ``busy``: ids (``id(seq)``) of running sequences whose last step is still in flight (a pipeline's other
        micro-batches): they are neither stepped nor preempted. ``max_seqs``: sequences in this step at most (a
        micro-batch's share of them)."""
        bm = self.blocks
        budget = self.config.max_num_batched_tokens
        cap = self.config.max_num_seqs if max_seqs is None else max_seqs
        out: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0 and len(out) < cap:
            seq = self.running[i]
            if id(seq) in busy:
                i += 1
                continue
            self._slide(seq)
            n = min(len(seq.ids) - seq.computed, budget)
            need = bm.blocks_for(seq.computed + n) - len(seq.blocks)
            while need > bm.num_free and (victim := self._victim(seq, busy)) is not None:
                self.running.remove(victim)
                self.preempt(victim)
                preempted = True
            if need > bm.num_free:  # not even alone: it waits for blocks itself
                self.running.remove(seq)
                self.preempt(seq)
                preempted = True
                break
            if need > 0:
                seq.blocks += bm.allocate(need)
            out.append((seq, n))
            budget -= n
            i += 1
        if preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and len(out) < cap:
            if self._state_slots is not None and not self._state_slots:
                break
            seq = self.waiting[0]
            if seq.index > 0 and bm.enable_prefix_caching and self._sibling_prefilling(seq):
                break  # choice i > 0 of a request waits for choice 0's prompt blocks, then shares them
            cached, key = bm.cached_prefix(seq.ids)
            start = len(cached) * bm.block_size
            n = min(len(seq.ids) - start, budget)
            need = bm.blocks_for(start + n) - len(cached)
            if need > bm.num_free - sum(1 for b in cached if bm.holders[b] == 0):
                break
            self.waiting.popleft()
            bm.hold(cached)
            seq.blocks = cached + bm.allocate(need)
            seq.computed, seq.prefix_key = start, key
            seq.cached_tokens = max(seq.cached_tokens, start)
            self.prefix_queries += len(seq.ids)
            self.prefix_hits += start
            if self._state_slots is not None:
                seq.state_slot = self._state_slots.pop()
                self._reset_state(seq.state_slot)
            self.running.append(seq)
            out.append((seq, n))
            budget -= n
        return out

    def _victim(self, seq: Sequence, busy: Set[int]) -> Sequence | None:
        """The sequence to preempt so that ``seq`` gets blocks: the newest running one after it (not yet in this
        step) whose step is not in flight; None when there is none."""
        for s in reversed(self.running):
            if s is seq:
                return None
            if id(s) not in busy:
                return s
        return None

    def reserve(self, plan: Seq[tuple[Sequence, int]], wants: Seq[int]) -> list[int]:
        """Room for ``wants[i]`` draft tokens after the tokens of ``plan[i]`` (a speculative step): as many as the
        step's token budget left and the free blocks allow, in plan order, never by preempting; their blocks are
        allocated. Returns how many each entry got."""
        bm = self.blocks
        budget = self.config.max_num_batched_tokens - sum(n for _, n in plan)
        out = []
        for (seq, n), want in zip(plan, wants, strict=True):
            end = seq.computed + n
            k = max(0, min(want, budget, (len(seq.blocks) + bm.num_free) * bm.block_size - end))
            need = bm.blocks_for(end + k) - len(seq.blocks)
            if need > 0:
                seq.blocks += bm.allocate(need)
            budget -= k
            out.append(k)
        return out

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks of ``seq`` past its computed tokens (rejected drafts held them)."""
        keep = self.blocks.blocks_for(seq.computed)
        if len(seq.blocks) > keep:
            self.blocks.free(seq.blocks[keep:])
            del seq.blocks[keep:]

    @property
    def free_state_slots(self) -> int:
        return len(self._state_slots or ())

    def take_state_slot(self) -> int:
        """A free row of the state cache, reset (for work outside the queues: an embedding)."""
        slot = self._state_slots.pop()
        self._reset_state(slot)
        return slot

    def _slide(self, seq: Sequence) -> None:
        """Free the blocks of ``seq`` that lie wholly before the window of its next token (the oldest key any of its
        next queries sees is computed - window + 1): no layer reads them again."""
        if self.window is None:
            return
        dead = max(0, seq.computed - self.window + 1) // self.blocks.block_size
        gone = [b for b in seq.blocks[:dead] if b >= 0]
        if gone:
            self.blocks.free(gone)
            seq.blocks[:dead] = [-1] * dead

    def _sibling_prefilling(self, seq: Sequence) -> bool:
        return any(s.request_id == seq.request_id and s.index == 0 and s.computed < s.num_prompt
                   for s in self.running)

    def computed(self, seq: Sequence, n: int) -> None:
        """Record that a step computed ``n`` more tokens of ``seq``; name its newly full blocks for sharing."""
        first = seq.computed
        seq.computed += n
        seq.prefix_key = self.blocks.register(seq.blocks, seq.ids, first, seq.computed, seq.prefix_key)

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and state slot and put it at the front of the queue (it is recomputed)."""
        self.release(seq)
        seq.computed, seq.prefix_key = 0, -1
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seqs: Seq[Sequence]) -> None:
        """Take finished (or aborted) sequences out of the queues and free what they hold."""
        gone = {id(s) for s in seqs}
        self.running = [s for s in self.running if id(s) not in gone]
        if any(id(s) in gone for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if id(s) not in gone)
        for s in seqs:
            self.release(s)

    def release(self, seq: Any) -> None:
        """Give back the cache blocks and state row of ``seq`` (a sequence, or an embedding job: anything with
        ``blocks`` and ``state_slot``)."""
        if seq.blocks:
            self.blocks.free(seq.blocks)
            seq.blocks = []
        if seq.state_slot >= 0:
            self._state_slots.append(seq.state_slot)
            seq.state_slot = -1
