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
    """What every response of one HTTP request names: its id, the served model, and how a token id reads: its text
    (OpenAI's: ``\\xNN`` escapes for bytes that are part of a UTF-8 character) and its bytes."""

    id: str
    model: str
    token_text: Callable[[int], str]
    token_bytes: Callable[[int], bytes]
    created: int = field(default_factory=lambda: int(time.time()))


class TextLogprobs:
    """A chat choice's logprobs, held back with its text so that the tokens given are those of the text sent: an
    entry comes out once its token's bytes are all in the text, and at the end the tokens that added nothing to it
    (the end-of-turn token, the tokens of a stop string) are left out. A token cut by a stop string stays."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self.token_bytes = token_bytes
        self.pending: list[TokenLogprob] = []
        self.sent = self.text = 0  # bytes of the tokens given out, bytes of the text

    def add(self, d: Delta) -> list[TokenLogprob]:
        """The entries that ``d`` makes ready."""
        self.pending += d.logprobs or ()
        self.text += len(d.text.encode("utf-8", "surrogatepass"))
        out = []
        while self.pending and (self.sent + len(self.token_bytes(self.pending[0].token_id)) <= self.text
                                or (d.finish_reason is not None and self.sent < self.text)):
            out.append(self.pending.pop(0))
            self.sent += len(self.token_bytes(out[-1].token_id))
        if d.finish_reason is not None:
            self.pending = []
        return out


@dataclass
class Choices:
    """What the deltas of one HTTP request add up to; choice ``index`` is prompt * n + the engine's index. With
    ``token_bytes`` (chat), each choice's logprobs are those of its text (``TextLogprobs``)."""

    count: int
    token_bytes: Callable[[int], bytes] | None = None
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
        self.aligned = [TextLogprobs(self.token_bytes) for _ in range(self.count)] if self.token_bytes else None

    def add(self, index: int, d: Delta) -> list[TokenLogprob]:
        """Add a delta of choice ``index``; returns the logprobs it makes ready."""
        self.texts[index] += d.text
        ready = self.aligned[index].add(d) if self.aligned is not None else list(d.logprobs or ())
        self.logprobs[index].extend(ready)
        self.finish[index] = d.finish_reason
        self.completion_tokens[index] = d.completion_tokens
        self.prompt_tokens[d.request_id] = d.prompt_tokens
        self.cached_tokens[d.request_id] = d.cached_tokens
        return ready

    def usage(self) -> dict[str, Any]:
        prompt, completion = sum(self.prompt_tokens.values()), sum(self.completion_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}}


def chat_logprobs(lps: list[TokenLogprob], a: Answer) -> dict[str, Any]:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``; each token's ``bytes`` are its
    own, so that the chosen tokens' bytes joined are the text's."""
    def entry(token_id: int, lp: float) -> dict[str, Any]:
        return {"token": a.token_text(token_id), "logprob": lp, "bytes": list(a.token_bytes(token_id))}

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


class ChatReply:
    """How one chat request's choices read: the parser of each (reasoning, content, tool calls), the echoed prefix,
    whether more than one tool call is kept."""

    def __init__(self, body: ChatCompletionRequest, setup: Any) -> None:
        self.parsers = [setup.parser() for _ in range(body.n)]
        self.parallel = setup.parallel_tool_calls
        self.forced = setup.structured_outputs is not None  # a reply of calls: no content, even when cut short
        self.echo = echo_prefix(body)

    def delta(self, i: int, text: str, final: bool) -> dict[str, Any]:
        """The chat delta of new text of choice i (empty keys left out)."""
        p = self.parsers[i].feed(text, final)
        out: dict[str, Any] = {}
        if p.reasoning:
            out["reasoning_content"] = p.reasoning
        if p.content:
            out["content"] = p.content
        calls = [c for c in p.tool_calls if self.parallel or c.index == 0]
        if calls:
            out["tool_calls"] = [tool_call_delta(c) for c in calls]
        return out

    def message(self, i: int) -> dict[str, Any]:
        """The whole message of choice i, once its text has all been fed."""
        p = self.parsers[i]
        calls = p.tool_calls() if self.parallel else p.tool_calls()[:1]
        content = self.echo + p.content
        msg: dict[str, Any] = {"role": "assistant", "content": content or (None if calls or self.forced else "")}
        if p.reasoning:
            msg["reasoning_content"] = p.reasoning
        if calls:
            msg["tool_calls"] = [c.to_openai() for c in calls]
        return msg

    def finish(self, i: int, reason: str | None) -> str | None:
        """"tool_calls" for a choice that stopped after calling tools."""
        return "tool_calls" if reason == "stop" and self.parsers[i].calls else reason


def tool_call_delta(c: Any) -> dict[str, Any]:
    """OpenAI's streamed tool call: index, id, type and name first, then argument chunks."""
    out: dict[str, Any] = {"index": c.index}
    if c.id is not None:
        out |= {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
    else:
        out["function"] = {"arguments": c.arguments}
    return out


def echo_prefix(body: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content when it has the role of the reply."""
    last = body.messages[-1]
    role = "assistant" if body.add_generation_prompt else last.role
    if not body.echo or last.role != role:
        return ""
    return last.as_template_input().get("content") or ""


async def chat_response(a: Answer, body: ChatCompletionRequest, setup: Any, run: Run) -> dict[str, Any]:
    acc, reply = Choices(body.n, a.token_bytes), ChatReply(body, setup)
    async with aclosing(run):
        async for i, d in run:
            acc.add(i, d)
    for i in range(acc.count):
        reply.delta(i, acc.texts[i], True)
    choices = [{"index": i, "message": reply.message(i),
                "logprobs": chat_logprobs(acc.logprobs[i], a) if body.logprobs else None,
                "finish_reason": reply.finish(i, acc.finish[i])} for i in range(acc.count)]
    return {"id": a.id, "object": "chat.completion", "created": a.created, "model": a.model, "choices": choices,
            "usage": acc.usage()}


@dataclass(frozen=True)
class Echo:
    """A completion's echoed prompt: its text and, when logprobs were asked for, its tokens' logprobs (completions'
    shape, the first token's null)."""

    text: str
    logprobs: dict[str, Any] | None = None


def _joined(echo: Echo | None, lps: dict[str, Any] | None) -> dict[str, Any] | None:
    if echo is None or echo.logprobs is None or lps is None:
        return lps
    return {k: echo.logprobs[k] + lps[k] for k in lps}


async def completion_response(a: Answer, body: CompletionRequest, prompts: int, run: Run,
                              echoes: list[Echo] | None = None) -> dict[str, Any]:
    acc = Choices(prompts * body.n)
    async with aclosing(run):
        async for i, d in run:
            acc.add(i, d)
    choices = []
    for i in range(acc.count):
        echo = echoes[i // body.n] if echoes else None
        lps = completion_logprobs(acc.logprobs[i], a.token_text, len(echo.text) if echo else 0) \
            if body.logprobs is not None else None
        choices.append({"index": i, "text": (echo.text if echo else "") + acc.texts[i], "logprobs": _joined(echo, lps),
                        "finish_reason": acc.finish[i]})
    return {"id": a.id, "object": "text_completion", "created": a.created, "model": a.model, "choices": choices,
            "usage": acc.usage()}


def scored_response(a: Answer, body: CompletionRequest, ids: list[list[int]],
                    echoes: list[Echo] | None) -> dict[str, Any]:
    """A completion of ``max_tokens`` 0, as OpenAI answers it (prompt scoring): no token is generated; each choice
    is its echoed prompt (with ``logprobs``, its tokens' logprobs, the first null), or empty text without ``echo``."""
    choices = []
    for i in range(len(ids) * body.n):
        echo = echoes[i // body.n] if echoes else None
        choices.append({"index": i, "text": echo.text if echo else "",
                        "logprobs": echo.logprobs if echo and body.logprobs is not None else None,
                        "finish_reason": "length"})
    prompt = sum(len(p) for p in ids)
    return {"id": a.id, "object": "text_completion", "created": a.created, "model": a.model, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt,
                      "prompt_tokens_details": {"cached_tokens": 0}}}


async def scored_events(a: Answer, body: CompletionRequest, ids: list[list[int]],
                        echoes: list[Echo] | None) -> AsyncIterator[str]:
    """``scored_response`` as ``text_completion`` events: a chunk per choice, then usage when asked for."""
    reply = scored_response(a, body, ids, echoes)
    head = {"id": a.id, "object": "text_completion", "created": a.created, "model": a.model}
    for choice in reply["choices"]:
        yield sse(head | {"choices": [choice]} | ({"usage": reply["usage"]} if body.continuous_usage else {}))
    if body.include_usage:
        yield sse(head | {"choices": [], "usage": reply["usage"]})


def sse(obj: Any) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def chat_events(a: Answer, body: ChatCompletionRequest, setup: Any, run: Run) -> AsyncIterator[str]:
    """``chat.completion.chunk`` events: a role chunk per choice (with the echoed text), then reasoning, content and
    tool call deltas; each choice's last chunk carries its finish_reason; with include_usage, a last chunk with no
    choices and the usage (with continuous_usage_stats, every chunk carries the usage so far)."""
    acc, reply = Choices(body.n, a.token_bytes), ChatReply(body, setup)

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        if body.continuous_usage and choices:
            extra["usage"] = acc.usage()
        return sse({"id": a.id, "object": "chat.completion.chunk", "created": a.created, "model": a.model,
                    "choices": choices, **extra})

    for i in range(body.n):
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": reply.echo}, "logprobs": None,
                      "finish_reason": None}])
    async with aclosing(run):
        async for i, d in run:
            ready = acc.add(i, d)
            delta = reply.delta(i, d.text, d.finish_reason is not None)
            if delta or ready or d.finish_reason:
                lps = chat_logprobs(ready, a) if body.logprobs and ready else None
                yield chunk([{"index": i, "delta": delta, "logprobs": lps,
                              "finish_reason": reply.finish(i, d.finish_reason)}])
    if body.include_usage:
        yield chunk([], usage=acc.usage())


async def completion_events(a: Answer, body: CompletionRequest, prompts: int, run: Run,
                            echoes: list[Echo] | None = None) -> AsyncIterator[str]:
    """``text_completion`` events: each choice's echoed prompt first (when asked for), then one per delta that adds
    something; usage last when asked for (with continuous_usage_stats, in every chunk)."""
    acc = Choices(prompts * body.n)

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        if body.continuous_usage and choices:
            extra["usage"] = acc.usage()
        return sse({"id": a.id, "object": "text_completion", "created": a.created, "model": a.model,
                    "choices": choices, **extra})

    for i in range(acc.count) if echoes else ():
        echo = echoes[i // body.n]
        yield chunk([{"index": i, "text": echo.text, "logprobs": echo.logprobs if body.logprobs is not None else None,
                      "finish_reason": None}])
    async with aclosing(run):
        async for i, d in run:
            offset = len(acc.texts[i]) + (len(echoes[i // body.n].text) if echoes else 0)
            acc.add(i, d)
            if d.text or d.logprobs or d.finish_reason:
                lps = completion_logprobs(list(d.logprobs), a.token_text, offset) \
                    if body.logprobs is not None and d.logprobs else None
                yield chunk([{"index": i, "text": d.text, "logprobs": lps, "finish_reason": d.finish_reason}])
    if body.include_usage:
        yield chunk([], usage=acc.usage())
