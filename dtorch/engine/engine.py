"""``Engine``: requests in, one batched model step at a time, ``Delta`` s out.

``add_request`` and ``abort`` may be called from any thread: they go into an inbox that the next step takes in.
``step`` runs one scheduler step on the model (``Executor``), samples the sequences whose tokens are all computed,
detokenizes, applies stop conditions and hands each request's news to its sink. Whoever calls ``step`` drives the
engine; ``run_until`` lets several threads share that job (one steps, the others wait for the steps), and
``loop.EngineLoop`` steps whenever there is work (the server's driver).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence as Seq

import torch

from dtorch.core.errors import ArgumentError, ContextLengthError, EngineBusy, SamplingError
from dtorch.engine.block_manager import BlockManager
from dtorch.engine.prompt_pass import EmbedJob, EmbedSink, PassJob, PassSink, PromptPasses, ScoreJob, check_pooling
from dtorch.engine.request import EngineStats, Sink
from dtorch.engine.sampling import SamplingParams
from dtorch.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from dtorch.engine.speculative import Speculator
from dtorch.engine.structured import Grammars
from dtorch.engine.tokens import TokenTaking
from dtorch.models.bucket import Bucket, long_prompts
from dtorch.models.executor import Executor, StepPlan
from dtorch.models.kv_cache import KVCache

log = logging.getLogger("dtorch.engine")
IDLE_PREFIX_KEEP = 0.25  # share of the cache's blocks that keep their cached prefixes when the engine goes idle


class Engine(TokenTaking):
    """Continuous batching over ``executor``'s model on the paged ``cache``.

    tokenizer: for text deltas and stop strings (None: deltas carry ids only). eos_token_ids: end a sequence unless
    its params say ``ignore_eos``. max_len: tokens of a sequence at most (prompt and output). max_waiting: queued
    requests at most before ``add_request`` raises ``EngineBusy``. agree: makes every rank take rank 0's sampled
    tokens (SPMD); rank: this process's rank (only rank 0 samples); device: where the logits are (and the sampling
    generators). speculator: drafts tokens that each step verifies (``speculative.Speculator``), or None.
    """

    def __init__(self, executor: Executor, cache: KVCache, *, tokenizer, eos_token_ids: frozenset[int], vocab_size: int,
                 max_len: int, max_num_seqs: int, max_num_batched_tokens: int, enable_prefix_caching: bool,
                 max_waiting: int, rank: int = 0, agree: Callable[[list[int]], list[int]] | None = None,
                 device: torch.device | str = "cpu", speculator: Speculator | None = None) -> None:
        self.executor, self.cache, self.tokenizer = executor, cache, tokenizer
        self.eos_token_ids, self.vocab_size, self.max_len = eos_token_ids, vocab_size, max_len
        self.max_waiting, self.rank, self.agree, self.device = max_waiting, rank, agree, torch.device(device)
        self.speculator = speculator
        prefix = enable_prefix_caching and not cache.has_state  # a recurrent state cannot start mid-prompt
        self.blocks = BlockManager(cache.num_blocks, cache.block_size, prefix)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens), self.blocks,
                                   cache.num_state_slots if cache.has_state else 0, cache.reset_state,
                                   window=executor.model.config.kv_window)
        self._requests: dict[str, list[Sequence]] = {}
        self._inbox: deque = deque()
        self._inbox_lock = threading.Lock()
        self.drive_lock = threading.RLock()  # held by whoever runs steps
        # step shapes queued to be built while the engine is idle (start_warmup): (bucket, for the drafter)
        self._warming: list[tuple[Bucket, bool]] = []
        self.warm_total, self.warm_built = 0, 0
        self.stepped = threading.Condition()  # notified after every step and when new work arrives
        self.accepting = True
        self.grammars = Grammars(tokenizer, vocab_size, sorted(eos_token_ids))
        self.passes = PromptPasses()  # embeddings and prompt scoring, in steps of their own
        self._counts = dict(prompt=0, generation=0, decode=0, steps=0)
        # steps started and not yet sampled (a pipeline's micro-batches): (plan, drafts, Pending, start time), oldest
        # first; the ids of their sequences; when the last one was sampled
        self._flights: deque = deque()
        self._busy: set[int] = set()
        self._landed = 0.0
        self._seconds = dict(prefill=0.0, decode=0.0)

    # -- requests (any thread) ---------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, sink: Sink, *,
                    force: bool = False) -> None:
        """Queue a request: ``params.n`` choices of continuing ``prompt_token_ids``; ``sink`` gets its deltas.

        Raises ``EngineBusy`` when ``max_waiting`` requests already wait (``force``: queue anyway) or the engine is
        shutting down, ``ArgumentError`` / ``ModelError`` for bad ids or a prompt that leaves no room,
        ``SamplingError`` for a logit_bias id past the vocabulary or a grammar that does not compile.
        """
        if not isinstance(params, SamplingParams):
            raise ArgumentError(f"add_request: params must be SamplingParams, got {type(params).__name__}")
        ids = self.check_prompt(prompt_token_ids, "the prompt")
        for field, given in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in given if t >= self.vocab_size]
            if bad:
                raise SamplingError(f"SamplingParams: {field} has token id {bad[0]}; ids must be in "
                                    f"[0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:  # stop strings match text, and there is none to match
            raise SamplingError("SamplingParams: stop strings need the model's tokenizer, and this model has none; "
                                "use stop_token_ids")
        so = params.structured_outputs
        matchers = [self.grammars.matcher(so) for _ in range(params.n)] if so is not None else [None] * params.n
        if not self.accepting:
            raise EngineBusy("the engine is shutting down and takes no new requests")
        if not force and self._queued() + len(self.passes.groups) >= self.max_waiting:
            raise EngineBusy(f"the engine's queue is full ({self.max_waiting} requests waiting); try again later")
        room = self.max_len - len(ids)
        limit = room if params.max_tokens is None else min(params.max_tokens, room)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        seqs = [Sequence(request_id, i, ids, params, sink, limit, stop_ids,
                         self.tokenizer.stream_decoder(params.skip_special_tokens) if self.tokenizer is not None
                         else None, self.device, matchers[i])
                for i in range(params.n)]
        with self._inbox_lock:
            if request_id in self._requests or any(a[0] == "add" and a[1] == request_id for a in self._inbox):
                raise ArgumentError(f"add_request: request id {request_id!r} is already in use")
            self._inbox.append(("add", request_id, seqs))
        with self.stepped:
            self.stepped.notify_all()

    def add_embedding(self, job_id: str, prompt_token_ids: Seq[int], pooling: str, sink: EmbedSink,
                      normalize: bool = True, *, group: str = "", force: bool = False) -> None:
        """Queue a prompt to embed: ``sink(job_id, vector)`` gets its final hidden states pooled ("last" token or
        "mean"), L2-normalized unless ``normalize`` is False, a [hidden] float32 tensor (or the exception that ended
        it) on the engine's thread. Pass steps take turns with generation steps (``prompt_pass``). ``group``: the
        request it belongs to (``abort(group)`` ends all of them; default: its own id); a new group past
        ``max_waiting`` raises ``EngineBusy`` unless ``force``."""
        ids = self.check_prompt(prompt_token_ids, "the input")
        check_pooling(pooling)
        self._add_pass(EmbedJob(job_id, ids, sink, group, pooling=pooling, normalize=normalize), force)

    def add_scoring(self, job_id: str, prompt_token_ids: Seq[int], top: int, sink: PassSink, *, group: str = "",
                    force: bool = False) -> None:
        """Queue a prompt to score: ``sink(job_id, PromptLogprobs)`` gets each token's logprob after the tokens
        before it and the ``top`` most likely tokens at each position (``prompt_pass.ScoreJob``), computed in chunks
        on the engine's steps beside other work; ``group`` and ``force`` as ``add_embedding``."""
        ids = self.check_prompt(prompt_token_ids, "the prompt")
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= self.vocab_size:
            raise ArgumentError(f"add_scoring: top must be an int in [0, {self.vocab_size}], got {top!r}")
        self._add_pass(ScoreJob(job_id, ids, sink, group, top=top), force)

    def _add_pass(self, job: PassJob, force: bool) -> None:
        if not self.accepting:
            raise EngineBusy("the engine is shutting down and takes no new requests")

        def room(groups: int) -> bool:  # pass requests count as waiting ones until they end
            return force or self._queued() + groups < self.max_waiting

        if not self.passes.admit(job, room):
            raise EngineBusy(f"the engine's queue is full ({self.max_waiting} requests waiting); try again later")
        with self._inbox_lock:
            self._inbox.append(("pass", job.job_id, job))
        with self.stepped:
            self.stepped.notify_all()

    def _queued(self) -> int:
        """Generation requests waiting (queued, or in the inbox)."""
        return len(self.scheduler.waiting) + sum(a[0] == "add" for a in list(self._inbox))

    def abort(self, request_id: str) -> None:
        """Cancel a request: each unfinished choice ends with finish_reason "abort" and frees its blocks at the next
        step boundary; a prompt pass (or a group of them) ends with ``PassAborted``. Unknown or finished ids are
        ignored."""
        with self._inbox_lock:
            self._inbox.append(("abort", request_id, None))
        with self.stepped:
            self.stepped.notify_all()

    def check_prompt(self, ids: Seq[int], what: str) -> list[int]:
        """``ids`` as a list, checked: non-empty ints in the vocabulary, leaving room for one new token. ``what``
        names the prompt in errors ("LLM: prompt 3")."""
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Seq):
            raise ArgumentError(f"{what} must be a list of token ids, got {type(ids).__name__}")
        ids = list(ids)
        if not ids:
            raise ArgumentError(f"{what} is empty; give at least one token")
        vocab = self.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ArgumentError(f"{what} has token id {t!r}; ids must be ints in [0, {vocab})")
        self.check_length(len(ids), what)
        return ids

    def check_length(self, tokens: int, what: str, at_least: bool = False) -> None:
        """``ModelError`` when a prompt of ``tokens`` tokens (``at_least``: a lower bound of its count, found before
        encoding it) leaves no room for a new token."""
        if tokens >= self.max_len:
            raise ContextLengthError(f"{what} has {'at least ' if at_least else ''}{tokens} tokens, but the context "
                                     f"is {self.max_len} tokens (max_model_len) and at least one new token must fit",
                                     tokens=tokens, limit=self.max_len, at_least=at_least)

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._inbox or self.passes.jobs)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting) + sum(a[0] == "add" for a in list(self._inbox)),
                           self.blocks.num_used, self.blocks.num_blocks, self.blocks.num_resident,
                           self._counts["prompt"],
                           self._counts["generation"], self._counts["decode"], s.preemptions, s.prefix_queries,
                           s.prefix_hits, self._counts["steps"], self._seconds["prefill"], self._seconds["decode"],
                           *((spec.drafted, spec.accepted) if (spec := self.speculator) is not None else (0, 0)))

    def warmup(self, progress: Callable[[list], Iterable] = iter) -> int:
        """Build the graph of every step shape the scheduler can make, so no request waits for one (a graph takes
        ~0.1 s to build), and record the decode shapes where the executor captures; returns how many there are.
        ``progress`` wraps the list of shapes as they are built (a progress bar). ``dtorch serve`` builds them in
        the background instead (``start_warmup``, then ``warm_next`` between steps)."""
        shapes = self.start_warmup()
        for _ in progress(list(shapes)):
            self.warm_next()
        return len(shapes)

    def start_warmup(self) -> list:
        """Queue every step shape the scheduler can make (smallest first) for ``warm_next`` to build; returns them."""
        from dtorch.models.bucket import bucket_for

        cfg = self.scheduler.config
        shapes = {bucket_for(t, n, long=long) for t in range(1, cfg.max_num_batched_tokens + 1)
                  for n in range(1, min(t, cfg.max_num_seqs) + 1) for long in (False, True)}
        spec = self.speculator
        drafted = spec.shapes(cfg.max_num_seqs, cfg.max_num_batched_tokens) if spec is not None else set()
        order = sorted(shapes | drafted, key=lambda b: (b.tokens, b.seqs, b.decode, b.rows))
        drafter = spec.drafter if spec is not None else None
        self._warming = [(b, False) for b in order] + [(b, True) for b in sorted(
            shapes, key=lambda b: (b.tokens, b.seqs, b.decode, b.rows)) if drafter is not None]
        self.warm_total, self.warm_built = len(self._warming), 0
        return order

    def warm_next(self) -> bool:
        """Build the next queued step shape (``start_warmup``); False when none is left. A shape a request needed
        first was built then (``Executor.runner`` builds on first use) and costs nothing here."""
        with self.drive_lock:
            if not self._warming:
                return False
            b, drafter = self._warming.pop(0)
            if drafter:
                self.speculator.drafter.executor.runner(b)
            else:
                self.executor.runner(b)
                if b.decode:
                    self.executor.capture_now(b)
            self.warm_built += 1
            return True

    @property
    def warm(self) -> bool:
        """Whether no step shape waits to be built (``start_warmup``): every request runs on built graphs."""
        return not self._warming

    # -- driving ---------------------------------------------------------------------------------------

    def run_until(self, done: Callable[[], bool], timeout: float | None = None) -> None:
        """Step until ``done()``; when another thread is stepping, wait for its steps instead (``done`` is called
        after each). ``timeout``: seconds at most (then ``EngineBusy``)."""
        end = None if timeout is None else time.monotonic() + timeout
        while not done():
            if end is not None and time.monotonic() > end:
                raise EngineBusy(f"run_until: not done after {timeout} s")
            if self.drive_lock.acquire(blocking=False):
                try:
                    while not done():
                        if not self.step():
                            with self.stepped:
                                self.stepped.wait(0.05)
                        if end is not None and time.monotonic() > end:
                            break
                finally:
                    self.drive_lock.release()
            else:
                with self.stepped:
                    self.stepped.wait(0.05)

    @torch.no_grad()
    def step(self) -> bool:
        """Run one step; False when there was nothing to do. A pipeline of P stages keeps up to P steps (micro-batches
        of the running sequences) in flight: a step starts as many as it may, then takes the oldest one's logits,
        samples them and returns, so that micro-batch's next step starts at the next call while the others run."""
        with self.drive_lock:
            self._take_inbox()
            if self.passes.turn(bool(self.scheduler.running or self.scheduler.waiting)) and self.passes.step(self):
                with self.stepped:
                    self.stepped.notify_all()
                return True
            depth = self.executor.depth
            while len(self._flights) < depth:
                busy = self._busy
                # a micro-batch's share of the sequences, so that the others have some
                cap = None if depth == 1 else -(-(len(self.scheduler.running) + len(self.scheduler.waiting)) // depth)
                plan = self.scheduler.schedule(busy, cap) if busy or cap else self.scheduler.schedule()
                if not plan:
                    break
                self._launch(plan)
            if not self._flights:
                return False
            try:
                self._land(self._flights.popleft())
            except BaseException:  # the steps still in flight failed with it (or may have): end them too
                while self._flights:
                    try:
                        self._land(self._flights.popleft())
                    except BaseException:  # noqa: BLE001, S110 - their sequences were aborted; the first error goes up
                        pass
                raise
            if not self.scheduler.running and not self.scheduler.waiting and not self._inbox:
                self.cache.release(self.blocks.trim(int(self.blocks.num_blocks * IDLE_PREFIX_KEEP)))
        with self.stepped:
            self.stepped.notify_all()
        return True

    def _launch(self, plan: list[tuple[Sequence, int]]) -> None:
        """Draft for ``plan`` (speculative decoding) and start its step on the executor."""
        t0 = time.perf_counter()
        try:
            long = long_prompts(plan)
            drafts = self.speculator.draft(self, plan, long) if self.speculator is not None else None
            step = StepPlan.chunks(plan, self.cache.has_state, drafts and drafts.tokens, long)
            # one stage: the step runs now, and its logits are sampled (_land) before the next step runs, so they
            # need no copy (borrow); a pipeline's step is in flight (an ``Executor.Pending``)
            pending = self.executor.step(step, borrow=True) if self.executor.depth == 1 else self.executor.submit(step)
        except BaseException:
            self._end([s for s, _ in plan], "abort")  # their cache contents are unknown now
            raise
        self._busy.update(id(s) for s, _ in plan)
        self._flights.append((plan, drafts, pending, t0))

    def _land(self, flight: tuple) -> None:
        """Take a started step's logits, account its tokens and sample the sequences it completed. Sequences that
        ended while it was in flight (aborted) give back what they hold now."""
        plan, drafts, pending, t0 = flight
        made = self._counts["generation"]
        self._busy.difference_update(id(s) for s, _ in plan)
        try:
            logits = pending if isinstance(pending, torch.Tensor) else pending.result()
        except BaseException:
            self._end([s for s, _ in plan], "abort")  # their cache contents are unknown now
            raise
        gone = [s for s, _ in plan if s.finished]
        if gone:
            self.scheduler.finish(gone)
        widths = drafts.widths if drafts is not None else [1] * len(plan)
        ready, rows, mine, at, decode = [], [], [], 0, True
        for i, ((s, n), w) in enumerate(zip(plan, widths, strict=True)):
            if s.finished:
                at += w
                continue
            one = self.speculator.decode_rows(s) if self.speculator is not None else 1
            if not (n == one and s.output_ids and s.computed + n == len(s.ids)):  # not a decode token
                self._counts["prompt"] += n
                decode = False
            self.scheduler.computed(s, n)
            if s.computed == len(s.ids):
                ready.append(s)
                rows += range(at, at + w)
                mine.append(i)
            at += w
        try:
            if ready and drafts is None:
                self._accept(ready, logits[rows] if len(rows) < logits.shape[0] else logits)
            elif ready:
                self._verify(ready, logits[rows], drafts, mine)
        except BaseException:
            self._end([s for s in ready if not s.finished], "abort")  # half-taken: computed, but no new token
            raise
        now = time.perf_counter()  # steps in flight together: each counts from the one before it landed
        self._seconds["decode" if decode else "prefill"] += now - max(t0, self._landed)
        self._landed = now
        if decode:
            self._counts["decode"] += self._counts["generation"] - made
        self._counts["steps"] += 1

    def _take_inbox(self) -> None:
        with self._inbox_lock:
            items = list(self._inbox)
            self._inbox.clear()
            for kind, rid, seqs in items:
                if kind == "add":
                    self._requests[rid] = seqs
        for kind, rid, seqs in items:
            if kind == "add":
                for s in seqs:
                    self.scheduler.add(s)
            elif kind == "pass":
                self.passes.jobs.append(seqs)
            else:
                self._end([s for s in self._requests.get(rid, ()) if not s.finished], "abort")
                self.passes.abort(self, rid)

    def count_prefill(self, tokens: int, seconds: float) -> None:
        """Account for a step of prompt tokens run outside the scheduler (a prompt pass)."""
        self._counts["prompt"] += tokens
        self._counts["steps"] += 1
        self._seconds["prefill"] += seconds

    def _end(self, seqs: list[Sequence], reason: str) -> None:
        """Finish ``seqs`` early (abort): each sink gets a last delta."""
        for s in seqs:
            if not s.finished:
                s.finish_reason = reason
                self._emit(s, (), "", None if s.params.logprobs is None else ())
        self._finish(seqs)

    def _finish(self, seqs: list[Sequence]) -> None:
        # a sequence whose step is in flight keeps its blocks and state row until the step lands (its stages still
        # write them)
        self.scheduler.finish([s for s in seqs if id(s) not in self._busy])
        for rid in {s.request_id for s in seqs}:
            mine = self._requests.get(rid)
            if mine is not None and all(s.finished for s in mine):
                del self._requests[rid]

    def abort_all(self) -> None:
        """Abort every request, queued or running (at shutdown)."""
        with self.drive_lock:
            while self._flights:  # what is in flight lands first: its sequences give back their blocks
                try:
                    self._land(self._flights.popleft())
                except BaseException:  # noqa: BLE001, S110 - shutting down: its sequences were aborted
                    pass
            self._take_inbox()
            self.passes.fail_all(self, EngineBusy("the engine shut down before the prompt's pass (an embedding or "
                                                  "its scoring) was done"))
            self._end([s for seqs in list(self._requests.values()) for s in seqs if not s.finished], "abort")

