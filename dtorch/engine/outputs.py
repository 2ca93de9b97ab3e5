"""A generate call's requests made, run on the engine, and their ``RequestOutput``s built from its ``Delta``s: each
choice's tokens, text, logprobs (with each token's text) and finish reason, then, once every choice has finished, the
whole text decoded at once (a stop string's output keeps its pieces: their sum is the text up to the stop)."""

from __future__ import annotations

import itertools
import queue
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from dtorch.core.errors import ArgumentError
from dtorch.engine.request import CompletionOutput, Delta, GenerationStats, Logprob, RequestOutput
from dtorch.engine.sampling import SamplingParams

_ids = itertools.count()  # request ids of generate and embed calls


def request_base() -> str:
    """A new call's request id prefix ("7-"): request i of the call is its prefix and i."""
    return f"{next(_ids)}-"


def new_requests(prompts: list[str | Sequence[int]], params: list[SamplingParams],
                 encode: Callable[[str | Sequence[int], int], list[int]]) -> list[RequestOutput]:
    """An empty ``RequestOutput`` per prompt (``n`` choices each), its ids by ``encode(prompt, index)``; an
    ``ArgumentError`` for counts that differ or params that are not ``SamplingParams``."""
    if len(params) != len(prompts):
        raise ArgumentError(f"LLM.generate: got {len(prompts)} prompts but {len(params)} SamplingParams")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise ArgumentError(f"LLM.generate: params must be SamplingParams, got {type(p).__name__}")
    base = request_base()
    return [RequestOutput(base + str(i), p if isinstance(p, str) else None, encode(p, i),
                          [CompletionOutput(k) for k in range(sp.n)])
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]


def run_requests(engine: Any, tokenizer: Any, eos_ids: frozenset[int], outs: list[RequestOutput],
                 params: list[SamplingParams]) -> Iterator[list[tuple[int, str]]]:
    """Queue the requests ``outs`` (params[i] for outs[i]) and step the engine until they finish; yields each step's
    new text (index, piece), index counting the choices of all prompts in order, and returns the call's
    ``GenerationStats``. tokenizer: the model's (None: no text); eos_ids: its end-of-sequence ids."""
    inbox: queue.SimpleQueue[Delta] = queue.SimpleQueue()
    where = {o.request_id: (i, sum(len(x.outputs) for x in outs[:i])) for i, o in enumerate(outs)}
    left = {o.request_id: len(o.outputs) for o in outs}
    before = engine.stats()
    try:
        for o, p in zip(outs, params, strict=True):
            engine.add_request(o.request_id, o.prompt_token_ids, p, inbox.put, force=True)
        while left:
            engine.run_until(lambda: not inbox.empty())
            pieces = []
            while not inbox.empty():
                d = inbox.get()
                i, first = where[d.request_id]
                take(outs[i], d, tokenizer)
                if d.text:
                    pieces.append((first + d.index, d.text))
                if d.finish_reason is not None:
                    left[d.request_id] -= 1
                    if not left[d.request_id]:
                        del left[d.request_id]
                        outs[i].finished = True
            yield pieces
    finally:
        for rid in left:  # an exception or an abandoned stream: the engine drops them at its next step
            engine.abort(rid)
    stats = GenerationStats.between(before, engine.stats())
    if tokenizer is not None:
        for o, p in zip(outs, params, strict=True):
            if p.stop:
                continue
            for c in o.outputs:  # the whole text decoded at once (the pieces are incremental)
                ids = c.token_ids
                if c.finish_reason == "stop" and ids and ids[-1] in (set(p.stop_token_ids) | eos_ids):
                    ids = ids[:-1]
                c.text = tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens, continuation=True)
    return stats


def take(out: RequestOutput, d: Delta, tokenizer: Any) -> None:
    """Add a delta to its choice of ``out`` (logprobs' token texts by ``tokenizer``; None: no text)."""
    c = out.outputs[d.index]
    c.token_ids += d.token_ids
    c.text += d.text
    out.num_cached_tokens = max(out.num_cached_tokens, d.cached_tokens)
    if d.logprobs is not None:
        if c.logprobs is None:
            c.logprobs, c.cumulative_logprob = [], 0.0
        for lp in d.logprobs:
            entry = {t: Logprob(v, rank, token_text(tokenizer, t)) for rank, (t, v) in enumerate(lp.top, 1)}
            entry[lp.token_id] = Logprob(lp.logprob, lp.rank, token_text(tokenizer, lp.token_id))
            c.logprobs.append(entry)
            c.cumulative_logprob += lp.logprob
    if d.finish_reason is not None:
        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason


def token_text(tokenizer: Any, token_id: int) -> str | None:
    """One token's text (None without a tokenizer)."""
    return None if tokenizer is None else tokenizer.decode([token_id], skip_special_tokens=False, continuation=True)
