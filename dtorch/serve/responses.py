"""OpenAI's response shapes, built from the engine's deltas: chat and text completions, whole or as server-sent
events, with usage and the two shapes of logprobs (chat: ``content`` entries; completions: parallel lists).

Each builder reads ``run``, an async iterator of (choice index, Delta) that ends when every choice has finished,
and closes it however it ends (which aborts what is unfinished).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from dtorch.engine.request import Delta, TokenLogprob
from dtorch.serve.protocol import ChatCompletionRequest, CompletionRequest

Run = AsyncIterator[tuple[int, Delta]]


@dataclass(frozen=True, slots=True)
class Answer:
    """What every response of one HTTP request names: its id, the served model, and how a token id reads."""

    id: str
    model: str
    token_text: Callable[[int], str]
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class Choices:
    """What the deltas of one HTTP request add up to; choice ``index`` is prompt * n + the engine's index."""

    count: int
    texts: list[str] = field(init=False)
    logprobs: list[list[TokenLogprob]] = field(init=False)
    finish: list[str | None] = field(init=False)
    completion_tokens: list[int] = field(init=False)
    prompt_tokens: dict[str, int] = field(default_factory=dict)  # per engine request
    cached_tokens: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.texts = [""] * self.count
        self.logprobs = [[] for _ in range(self.count)]
        self.finish = [None] * self.count
        self.completion_tokens = [0] * self.count

    def add(self, index: int, d: Delta) -> None:
        self.texts[index] += d.text
        if d.logprobs:
            self.logprobs[index].extend(d.logprobs)
        self.finish[index] = d.finish_reason
        self.completion_tokens[index] = d.completion_tokens
        self.prompt_tokens[d.request_id] = d.prompt_tokens
        self.cached_tokens[d.request_id] = d.cached_tokens

    def usage(self) -> dict[str, Any]:
        prompt, completion = sum(self.prompt_tokens.values()), sum(self.completion_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}}


def chat_logprobs(lps: list[TokenLogprob], token_text: Callable[[int], str]) -> dict[str, Any]:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``."""
    def entry(token_id: int, lp: float) -> dict[str, Any]:
        s = token_text(token_id)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [entry(t.token_id, t.logprob) | {"top_logprobs": [entry(i, lp) for i, lp in t.top]}
                        for t in lps]}


def completion_logprobs(lps: list[TokenLogprob], token_text: Callable[[int], str], offset: int = 0) -> dict[str, Any]:
    """``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``; offsets into the
    completion's text, starting at ``offset``."""
    tokens = [token_text(t.token_id) for t in lps]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [t.logprob for t in lps],
            "top_logprobs": [{token_text(i): lp for i, lp in t.top} for t in lps], "text_offset": offsets}


async def chat_response(a: Answer, body: ChatCompletionRequest, run: Run) -> dict[str, Any]:
    acc = Choices(body.n)
    async with aclosing(run):
        async for i, d in run:
            acc.add(i, d)
    choices = [{"index": i, "message": {"role": "assistant", "content": acc.texts[i]},
                "logprobs": chat_logprobs(acc.logprobs[i], a.token_text) if body.logprobs else None,
                "finish_reason": acc.finish[i]} for i in range(acc.count)]
    return {"id": a.id, "object": "chat.completion", "created": a.created, "model": a.model, "choices": choices,
            "usage": acc.usage()}


async def completion_response(a: Answer, body: CompletionRequest, prompts: int, run: Run) -> dict[str, Any]:
    acc = Choices(prompts * body.n)
    async with aclosing(run):
        async for i, d in run:
            acc.add(i, d)
    choices = [{"index": i, "text": acc.texts[i],
                "logprobs": completion_logprobs(acc.logprobs[i], a.token_text) if body.logprobs is not None else None,
                "finish_reason": acc.finish[i]} for i in range(acc.count)]
    return {"id": a.id, "object": "text_completion", "created": a.created, "model": a.model, "choices": choices,
            "usage": acc.usage()}


def sse(obj: Any) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def chat_events(a: Answer, body: ChatCompletionRequest, run: Run) -> AsyncIterator[str]:
    """``chat.completion.chunk`` events: a role chunk per choice, then content; each choice's last chunk carries its
    finish_reason; with include_usage, a last chunk with no choices and the usage."""
    acc = Choices(body.n)

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse({"id": a.id, "object": "chat.completion.chunk", "created": a.created, "model": a.model,
                    "choices": choices, **extra})

    for i in range(body.n):
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    async with aclosing(run):
        async for i, d in run:
            acc.add(i, d)
            if d.text or d.logprobs or d.finish_reason:
                lps = chat_logprobs(list(d.logprobs), a.token_text) if body.logprobs and d.logprobs else None
                delta = {"content": d.text} if d.text else {}
                yield chunk([{"index": i, "delta": delta, "logprobs": lps, "finish_reason": d.finish_reason}])
    if body.include_usage:
        yield chunk([], usage=acc.usage())


async def completion_events(a: Answer, body: CompletionRequest, prompts: int, run: Run) -> AsyncIterator[str]:
    """``text_completion`` events, one per delta that adds something; usage last when asked for."""
    acc = Choices(prompts * body.n)

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse({"id": a.id, "object": "text_completion", "created": a.created, "model": a.model,
                    "choices": choices, **extra})

    async with aclosing(run):
        async for i, d in run:
            offset = len(acc.texts[i])
            acc.add(i, d)
            if d.text or d.logprobs or d.finish_reason:
                lps = completion_logprobs(list(d.logprobs), a.token_text, offset) \
                    if body.logprobs is not None and d.logprobs else None
                yield chunk([{"index": i, "text": d.text, "logprobs": lps, "finish_reason": d.finish_reason}])
    if body.include_usage:
        yield chunk([], usage=acc.usage())
