"""Speculative decoding: guesses of a sequence's next tokens (drafts), checked by the target model in the engine's
ordinary step.

``SpeculativeConfig`` is vLLM's ``speculative_config``: ``{"method": "ngram" | "draft_model", "model": ...,
"num_speculative_tokens": k, "prompt_lookup_max": ..., "prompt_lookup_min": ...}``. Each step, every running sequence
whose next tokens reach its end (a decode, or a prompt's last chunk) may get up to k drafts: prompt lookup
(``NgramIndex``: the tokens that followed the latest earlier occurrence of the longest suffix of its tokens, from
``prompt_lookup_max`` down to ``prompt_lookup_min`` long) or a smaller model (``dtorch.engine.draft_model``). The
scheduler gives drafts what room is left (the step's token budget, free blocks; it never preempts for them), the step
scores a drafted sequence's last token and its drafts as k + 1 rows against its paged cache beside everyone else's
decodes and prompt chunks, and ``dtorch.engine.verify`` keeps the drafts the target agrees with plus one token of its
own. The kept drafts' keys are already in the cache; a rejected draft's slot lies past the sequence's computed tokens,
where the next step writes, and blocks that held only rejected drafts go back to the free list.

Adaptive k (``Adaptive``): per sequence, an estimate of the chance that a draft token is accepted (recent rounds
weigh more) picks the k that makes the most tokens per unit of step time (``step_cost``: what a step of k + 1 rows
costs against a decode step, by device); when no k pays, the sequence drafts nothing for a while (twice as long each
time, up to ``MAX_PAUSE`` steps), then tries one draft token again. The choice depends on the sequence's own history
only, so a seeded request draws the same numbers each time it runs.

Gated delta net layers (hybrid models) advance a recurrent state over every row, rejected drafts included: the state
rows of a drafted sequence are copied before its step and put back when a draft is rejected, and the tokens it kept
are computed again in its next step (``Rollback``).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtorch.core.errors import ArgumentError
from dtorch.engine.kept import Kept
from dtorch.engine.verify import verify

log = logging.getLogger("dtorch.engine")

METHODS = ("ngram", "draft_model")
MAX_PAUSE = 32  # steps a sequence whose drafts do not pay waits at most before it tries again
DECAY = 0.7  # weight of the previous rounds in the acceptance estimate
PRIOR = (1.4, 2.0)  # (accepted, drafted) pseudo-counts the estimate starts from: a chance of 0.7
# what a step's second row and each further one cost, as shares of a one-row decode step (bench/speculative.py, the
# default model on one thread): with AVX2 the native integer kernels take the rows of x in pairs, so a second row
# costs about a third of a step and each further one about 0.7 (17.2 ms a step of one row, 23.2 of two, 33.9 of
# three, 68.5 of five); with AVX-512 VNNI one row already runs at about the speed of several (the same tiles of
# 64-byte dot products), and rows cost alike, about 0.3 of a step each since a row's last super-group of under 16
# blocks has its own pass (9 rows forced at every step of the copy task: 23.2 ms a step against 6.8 for one row, 13
# rows 28.7 against 7.1, prompt steps included); on a GPU a step of a few rows costs about what one row does
ROW_COST = {"cpu": (0.35, 0.7), "cpu-avx512": (0.3, 0.3), "cuda": (0.05, 0.05)}


def row_cost(device_type: str) -> tuple[float, float]:
    """``ROW_COST``'s entry for a device type; on a CPU, for the native kernels' ISA that runs now."""
    if device_type != "cpu":
        return ROW_COST.get(device_type, ROW_COST["cuda"])
    from dtorch.kernels import native

    try:
        return ROW_COST["cpu-avx512"] if native.isa() == "avx512" else ROW_COST["cpu"]
    except native.NativeUnavailable:
        return ROW_COST["cpu"]


def step_cost(rows: int, row_cost: tuple[float, float]) -> float:
    """What a step of one sequence's ``rows`` rows costs against a one-row step (``row_cost``: as ``ROW_COST``'s),
    counting the rows its step shape pads them to (past 16 rows, a power of two: 17 rows compute 32)."""
    from dtorch.models.bucket import bucket_for

    rows = bucket_for(rows, 1, rows=rows).tokens if rows > 1 else 1
    second, more = row_cost
    return 1.0 + (second if rows > 1 else 0.0) + more * max(0, rows - 2)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How to draft (vLLM's names). method: "ngram" (prompt lookup) or "draft_model" (``model``: a path or Hugging
    Face id of a smaller model with the same vocabulary); num_speculative_tokens: drafts per step at most;
    prompt_lookup_max / prompt_lookup_min: the longest and shortest suffix the n-gram drafter looks up (both default
    to 5, one defaults to the other, as vLLM)."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ArgumentError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ArgumentError("speculative_config: method 'draft_model' needs 'model': the path or Hugging Face "
                                    "id of the draft model")
            return
        if self.model is not None:
            raise ArgumentError(f"speculative_config: method 'ngram' takes no model, got {self.model!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None:
                _positive(name, value)
        lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
        if lo > hi:
            raise ArgumentError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """The config of vLLM's dict (``model`` without ``method`` means "draft_model"); an ``ArgumentError`` naming an
        unknown key (with the nearest known one) or a missing or bad value."""
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, Mapping):
            raise ArgumentError(f"speculative_config must be a dict, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in names:
                near = difflib.get_close_matches(str(key), names, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else f"; the keys are {', '.join(names)}"
                raise ArgumentError(f"speculative_config: unknown key {key!r}{hint}")
        d = dict(d)
        d.setdefault("method", "draft_model" if d.get("model") is not None else None)
        if d["method"] is None:
            raise ArgumentError("speculative_config: give 'method' ('ngram' or 'draft_model')")
        if "num_speculative_tokens" not in d:
            raise ArgumentError("speculative_config: give 'num_speculative_tokens', the drafts per step at most")
        return cls(**d)


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArgumentError(f"speculative_config: {name} must be an int >= 1, got {value!r}")


def best_k(chance: float, k_max: int, row_cost: tuple[float, float]) -> int:
    """The number of drafts that makes the most tokens per unit of step time: k drafts, each accepted with
    probability ``chance`` (given the ones before it), give 1 + chance + ... + chance^k tokens for a step of k + 1
    rows; 0 when no k beats a plain step."""
    best, value = 0, 1.0
    made, p = 1.0, 1.0
    for k in range(1, k_max + 1):
        p *= chance
        made += p
        if made / step_cost(k + 1, row_cost) > value:
            best, value = k, made / step_cost(k + 1, row_cost)
    return best


class Adaptive:
    """A sequence's draft count: the acceptance estimate (decayed counts of accepted and drafted tokens) and the
    pause after rounds that did not pay."""

    __slots__ = ("accepted", "drafted", "pause", "wait")

    def __init__(self) -> None:
        self.accepted, self.drafted = 0.0, 0.0
        self.pause = 0  # steps left without drafts
        self.wait = 1  # the next pause

    def want(self, k_max: int, row_cost: tuple[float, float]) -> int:
        """Drafts to ask for this step (the probe after a pause: one)."""
        if self.pause > 0:
            self.pause -= 1
            return 1 if self.pause == 0 else 0
        chance = (self.accepted + PRIOR[0]) / (self.drafted + PRIOR[1])
        k = best_k(chance, k_max, row_cost)
        if k == 0:
            self.pause, self.wait = self.wait, min(2 * self.wait, MAX_PAUSE)
        return k

    def observe(self, drafted: int, accepted: int) -> None:
        """A round's outcome: ``accepted`` of ``drafted`` drafts kept."""
        self.accepted = DECAY * self.accepted + accepted
        self.drafted = DECAY * self.drafted + accepted + (accepted < drafted)  # the run of successes and one failure
        if accepted == drafted:
            self.wait = 1


class NgramIndex:
    """Prompt lookup over a sequence's tokens (they only grow): for each n in [lo, hi], each n-gram -> the position
    after its latest occurrence that has a token after it."""

    __slots__ = ("lo", "hi", "maps", "done")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(hi - lo + 1)]
        self.done = 0  # n-grams ending before this position are indexed

    def propose(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of ``ids`` (from
        ``hi`` down to ``lo`` tokens long); [] when there is none."""
        end = len(ids) - 1  # the last token: every n-gram ending before it has a successor
        for e in range(self.done, end):
            for n in range(self.lo, min(self.hi, e + 1) + 1):
                self.maps[n - self.lo][tuple(ids[e - n + 1:e + 1])] = e + 1
        self.done = max(self.done, end)
        for n in range(min(self.hi, len(ids)), self.lo - 1, -1):
            at = self.maps[n - self.lo].get(tuple(ids[len(ids) - n:]))
            if at is not None:
                return list(ids[at:at + k])
        return []


class SeqSpec:
    """What speculation keeps per sequence: its adaptive draft count, its n-gram index, how many of its tokens the
    draft model has keys for, and the tokens its next step computes again after a rollback."""

    __slots__ = ("adaptive", "ngrams", "draft_computed", "redo")

    def __init__(self, config: SpeculativeConfig) -> None:
        self.adaptive = Adaptive()
        self.ngrams = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max) \
            if config.method == "ngram" else None
        self.draft_computed = -1  # -1: not seen yet (its computed tokens are taken as the draft model's too)
        self.redo = 0


@dataclass
class Drafts:
    """A step's drafts: per entry of the plan, the draft tokens and (for a draft model's sampled drafts) their
    proposal distributions (a ``Kept`` per draft; None: each draft was picked outright), and the rows of the hybrid
    state saved before the step (``Rollback``)."""

    tokens: list[list[int]]
    probs: list[list[Kept] | None]
    rollback: Rollback | None = None

    @property
    def widths(self) -> list[int]:
        """Logits rows per entry: its last token's and each draft's."""
        return [1 + len(d) for d in self.tokens]


class Rollback:
    """The gated delta net state rows of drafted sequences (``seqs``), copied from ``cache`` before a step."""

    def __init__(self, cache: Any, seqs: Sequence[Any]) -> None:
        self.cache = cache
        if any(t.is_cuda for s in seqs[:1] for t in cache.state_rows(s.state_slot)):
            torch.cuda.synchronize()  # the runtime's streams wrote them
        self.saved = {id(s): (s.computed, [t.clone() for t in cache.state_rows(s.state_slot)]) for s in seqs}

    def restore(self, seq: Any) -> int:
        """Put ``seq``'s state rows back as they were before the step; returns its computed count then."""
        computed, saved = self.saved[id(seq)]
        for row, copy in zip(self.cache.state_rows(seq.state_slot), saved, strict=True):
            row.copy_(copy)
        return computed


class Speculator:
    """The engine's drafting: which sequences of a step get drafts and how many (``draft``), and what follows the
    verified step (``settle``). ``row_cost``: the device's ``ROW_COST``. ``drafter``: a ``DraftModel`` for method
    "draft_model", else None (prompt lookup).
    Counts drafted and accepted tokens since the engine started."""

    def __init__(self, config: SpeculativeConfig, row_cost: tuple[float, float], drafter: Any = None) -> None:
        self.config, self.row_cost, self.drafter = config, row_cost, drafter
        self.drafted = self.accepted = 0

    def state(self, seq: Any) -> SeqSpec:
        if seq.spec is None:
            seq.spec = SeqSpec(self.config)
        return seq.spec

    def draft(self, engine: Any, plan: Sequence[tuple[Any, int]], long: bool) -> Drafts | None:
        """Drafts for the entries of ``plan`` whose tokens reach their end, within what the scheduler can give them
        (their blocks held); None when no entry gets any. ``long``: the step's prompts are all long
        (``model.long_prompts``)."""
        k_max = self.config.num_speculative_tokens
        # a long prompt step drafts nothing: with drafts its rows would keep two levels (model.COARSE_PROMPT_ROWS);
        # one step without drafts costs a decode step, the 8-bit prompt rows 1.4-1.9x less prefill
        from dtorch.models.bucket import bucket_for

        step = bucket_for(sum(n for _, n in plan), len(plan), long=long)
        long_prompt = engine.executor.model.coarse(step) and not step.decode
        wants, found = [], []
        for s, n in plan:
            st, want, tokens = self.state(s), 0, None
            room = s.limit - len(s.output_ids) - 1  # the step adds the kept drafts and one more token
            if s.computed + n == len(s.ids) and room > 0 and not long_prompt:
                want = min(st.adaptive.want(k_max, self.row_cost), room)
            if want and st.ngrams is not None:
                tokens = st.ngrams.propose(s.ids, want)
                want = len(tokens)
            wants.append(want)
            found.append(tokens)
        ks = engine.scheduler.reserve(plan, wants) if any(wants) else wants
        if self.drafter is not None:
            tokens, probs = self.drafter.propose(engine, plan, ks)  # also when none drafts: it keeps up with the plan
        else:
            tokens, probs = [t[:k] if k else [] for t, k in zip(found, ks, strict=True)], [None] * len(plan)
        if not any(tokens):
            return None
        drafted = [s for (s, _), d in zip(plan, tokens, strict=True) if d]
        return Drafts(tokens, probs, Rollback(engine.cache, drafted) if engine.cache.has_state else None)

    def verify(self, engine: Any, seqs: Sequence[Any], logits: torch.Tensor, drafts: Drafts, entries: Sequence[int]
               ) -> tuple[list[list[int]], list[list[Any]]]:
        """Each of ``seqs``'s tokens this step and their logprobs (``verify.verify`` on rank 0; every rank takes
        rank 0's). ``logits``: their rows; ``entries``: each one's entry in ``drafts``."""
        tokens = [drafts.tokens[i] for i in entries]
        if engine.rank == 0:
            runs, logprobs = _verify_apart(logits, seqs, tokens, [drafts.probs[i] for i in entries], engine.grammars)
        else:
            runs, logprobs = [[0] for _ in seqs], [[None] for _ in seqs]
        if engine.agree is not None:  # a fixed width per sequence (its drafts and one), padded with -1
            flat = engine.agree([t for r, d in zip(runs, tokens, strict=True)
                                 for t in r + [-1] * (len(d) + 1 - len(r))])
            at = list(itertools.accumulate((len(d) + 1 for d in tokens), initial=0))
            runs = [[t for t in flat[a:b] if t >= 0] for a, b in itertools.pairwise(at)]
            logprobs = [lp + [None] * (len(r) - len(lp)) for r, lp in zip(runs, logprobs, strict=True)]
        return runs, logprobs

    def shapes(self, max_seqs: int, max_tokens: int) -> set:
        """The step shapes of speculative steps where every row is a drafted sequence's (``Engine.warmup``)."""
        from dtorch.models.bucket import bucket_for

        k = self.config.num_speculative_tokens
        return {bucket_for(t, n, rows=t) for n in range(1, max_seqs + 1)
                for t in range(n + 1, min(max_tokens, n * (k + 1)) + 1)}

    def decode_rows(self, seq: Any) -> int:
        """The rows a step computes for ``seq`` when it decodes: 1, or more when a rollback left tokens to compute
        again (read once: the step computes them)."""
        st = seq.spec
        if st is None or not st.redo:
            return 1
        redo, st.redo = st.redo, 0
        return 1 + redo

    def settle(self, engine: Any, seq: Any, draft: Sequence[int], tokens: Sequence[int], taken: int,
               rollback: Rollback | None) -> None:
        """After ``seq`` took ``taken`` of ``tokens`` (the drafts verification kept, then the target's own; fewer when
        it ended on one): count them and feed the adaptive k; mark the kept drafts it took computed (their keys are in
        the cache; their full blocks are named for the prefix cache, also when it ended) or, where a rejected draft
        advanced the hybrid state, put the state back and compute the kept tokens again next step; unless it ended,
        give back the blocks past its computed tokens."""
        st = self.state(seq)
        kept = len(tokens) - 1
        self.drafted += len(draft)
        self.accepted += kept
        st.adaptive.observe(len(draft), kept)
        if self.drafter is not None:
            st.draft_computed += min(kept, len(draft) - 1)  # the draft model has keys for the drafts it read
        if rollback is not None and kept < len(draft):
            if not seq.finished:
                seq.computed = rollback.restore(seq)
                st.redo = len(seq.ids) - 1 - seq.computed
        else:
            engine.scheduler.computed(seq, min(kept, taken))
        if not seq.finished:
            engine.scheduler.trim(seq)

    def close(self) -> None:
        if self.drafter is not None:
            self.drafter.close()


def speculator_for(config: SpeculativeConfig | None, llm: Any, dtype: torch.dtype, where: Any) -> Speculator | None:
    """The ``Speculator`` of ``config`` for ``llm`` (its model, mesh and cache built; ``where``: its ``MeshSetup``),
    loading the draft model of method "draft_model"; None without a config."""
    if config is None:
        return None
    drafter = None
    if config.method == "draft_model":
        from dtorch.engine.draft_model import DraftModel

        drafter = DraftModel.load(config.model, llm, dtype, where.communicator, where.timeout)
    return Speculator(config, row_cost(llm.device.type), drafter)


def _verify_apart(logits: torch.Tensor, seqs: Sequence[Any], drafts: Sequence[Sequence[int]],
                  probs: Sequence[Sequence[Kept] | None], grammars: Any) -> tuple[list[list[int]], list[list[Any]]]:
    """``verify.verify`` over the batch; if it fails, each sequence alone (its 1 + len(draft) rows of ``logits``),
    one that still fails getting an empty run (the engine ends it): a request's own failure must not end the
    requests batched with it."""
    try:
        return verify(logits, seqs, drafts, probs, grammars)
    except Exception:
        if len(seqs) == 1:
            log.exception("verifying request %r failed; it is aborted", seqs[0].request_id)
            return [[]], [[]]
    runs: list[list[int]] = []
    logprobs: list[list[Any]] = []
    at = 0
    for s, d, q in zip(seqs, drafts, probs, strict=True):
        rows = logits[at:at + len(d) + 1]  # [1 + len(d), V]
        at += len(d) + 1
        try:
            (run,), (lps,) = verify(rows, [s], [d], [q], grammars)
        except Exception:
            log.exception("verifying request %r failed; it is aborted", s.request_id)
            run, lps = [], []
        runs.append(run)
        logprobs.append(lps)
    return runs, logprobs
