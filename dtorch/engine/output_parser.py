"""Splitting a chat model's output into reasoning, content and tool calls, piece by piece as it streams.

Reasoning is what a model writes between ``<think>`` and ``</think>`` (Qwen3, and every template that opens the think
block in the prompt); tool calls are Hermes-style blocks, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(Qwen2.5, Qwen3, and dtorch's default tool rendering). ``OutputParser.feed(piece)`` returns what the piece adds to
each part, holding back any text that may be the start of a tag, so no half tag ever reaches the content; a call's
id and name come out as soon as its name is read, then its arguments as they arrive. Feeding the whole text at once
gives the same parts as feeding it piece by piece.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,?\s*')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


@dataclass
class ToolCallDelta:
    """What one piece added to tool call ``index``: its id and name (first time only), more argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    """What one piece added: reasoning text, content text, tool call deltas."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class ToolCall:
    """A whole tool call: ``arguments`` is JSON text (OpenAI's shape)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class _Call:
    """One ``<tool_call>`` block as it streams: the id and name once the name is read, then the arguments (an object
    or array value) as their text arrives; ``arguments`` is all the argument text sent."""

    def __init__(self, index: int) -> None:
        self.index, self.body = index, ""
        self.id: str | None = None
        self.name: str | None = None
        self.arguments = ""
        self.args_at: int | None = None  # where the arguments value starts in body
        self.depth, self.in_str, self.escape, self.done = 0, False, False, False

    def push(self, text: str) -> ToolCallDelta | None:
        """Add body text; what it makes known."""
        self.body += text
        out = ToolCallDelta(self.index)
        m = _NAME.match(self.body)
        if m is None:
            return None
        if self.name is None:
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:  # a bad escape: the name as written
                name = m.group(1)
            self.id, self.name = new_call_id(), name
            out.id, out.name = self.id, self.name
        if self.args_at is None:
            m2 = _ARGS.match(self.body, m.end())
            if m2 is not None and m2.end() < len(self.body) and self.body[m2.end()] in "{[":
                self.args_at = m2.end()
        if self.args_at is not None and not self.done:
            out.arguments = self._scan()
            self.arguments += out.arguments
        return out if out.id or out.arguments else None

    def _scan(self) -> str:
        """The arguments value's new characters, up to its end (the bracket that closes it)."""
        start, end = self.args_at + len(self.arguments), len(self.body)
        for i in range(start, len(self.body)):
            c = self.body[i]
            if self.in_str:
                self.in_str = not (c == '"' and not self.escape)
                self.escape = c == "\\" and not self.escape
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done, end = True, i + 1
                    break
        return self.body[start:end]

    def close(self, closed: bool) -> tuple[ToolCallDelta | None, str | None]:
        """At ``</tool_call>`` (``closed``) or the end of the output: the delta that completes the call, or (None, the
        raw block) when the block is no call."""
        try:
            obj = json.loads(self.body)
        except ValueError:
            obj = None
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        ok = isinstance(obj, dict) and isinstance(obj.get("name"), str) and args is not None
        text = (args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)) if ok else "{}"
        if self.id is None:
            if not ok:
                return None, CALL_OPEN + self.body + (CALL_CLOSE if closed else "")
            self.id, self.name, self.arguments = new_call_id(), obj["name"], text
            return ToolCallDelta(self.index, self.id, self.name, text), None
        if not self.arguments:  # the name came, the arguments never streamed (a string value, another key order)
            self.arguments = text
            return ToolCallDelta(self.index, arguments=text), None
        return None, None


class OutputParser:
    """A streaming split of one choice's text.

    reasoning: the template uses ``<think>`` blocks; thinking: the prompt already opened one (the output starts in
    it). tools: parse ``<tool_call>`` blocks (a request that offers tools).
    """

    def __init__(self, reasoning: bool = False, thinking: bool = False, tools: bool = False) -> None:
        self.tools = tools
        self.state = "think" if thinking and reasoning else "start" if reasoning else "content"
        self.pending = ""  # text not yet given to a part
        self.spaces = ""  # blank text after a tool call, dropped unless content follows
        self.call: _Call | None = None
        self.calls: list[_Call] = []
        self.reasoning, self.content = "", ""

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        """Add ``text``; ``final``: it is the end of the output (flush what was held back)."""
        out = ParsedDelta()
        self.pending += text
        while self._step(out, final):
            pass
        self.reasoning += out.reasoning
        self.content += out.content
        return out

    def _step(self, out: ParsedDelta, final: bool) -> bool:
        """Move the pending text on by one state; False when it must wait for more (or has nothing left)."""
        if self.state == "start":  # does the output open a think block?
            lead = self.pending.lstrip()
            if lead.startswith(THINK_OPEN):
                self.pending, self.state = lead[len(THINK_OPEN):], "think"
                return True
            if not final and THINK_OPEN.startswith(lead):
                return False
            self.state = "content"
            return True
        if self.state == "think":
            at = self.pending.find(THINK_CLOSE)
            if at >= 0:
                out.reasoning += self.pending[:at]
                self.pending, self.state = self.pending[at + len(THINK_CLOSE):], "after_think"
                return True
            cut = len(self.pending) - (0 if final else _held(self.pending, THINK_CLOSE))
            out.reasoning += self.pending[:cut]
            self.pending = self.pending[cut:]
            return False
        if self.state == "after_think":  # the blank lines between </think> and the answer
            self.pending = self.pending.lstrip()
            if not self.pending and not final:
                return False
            self.state = "content"
            return True
        if self.state == "content":
            if not self.tools:
                out.content += self.pending
                self.pending = ""
                return False
            at = self.pending.find(CALL_OPEN)
            if at >= 0:
                self._say(out, self.pending[:at])
                self.pending = self.pending[at + len(CALL_OPEN):]
                self.call, self.state = _Call(len(self.calls)), "call"
                return True
            cut = len(self.pending) - (0 if final else _held(self.pending, CALL_OPEN))
            self._say(out, self.pending[:cut])
            self.pending = self.pending[cut:]
            return False
        # in a <tool_call> block
        at = self.pending.find(CALL_CLOSE)
        cut = at if at >= 0 else len(self.pending) - (0 if final else _held(self.pending, CALL_CLOSE))
        d = self.call.push(self.pending[:cut]) if cut else None
        if d is not None:
            out.tool_calls.append(d)
        self.pending = self.pending[cut:]
        if at < 0 and not final:
            return False
        if at >= 0:
            self.pending = self.pending[len(CALL_CLOSE):]
        d, raw = self.call.close(at >= 0)
        if d is not None:
            out.tool_calls.append(d)
        if raw is not None:
            self._say(out, raw)
        else:
            self.calls.append(self.call)
        self.call, self.state = None, "content"
        return True

    def _say(self, out: ParsedDelta, text: str) -> None:
        """Content text; blank text after a tool call waits to see whether content follows it."""
        if not text:
            return
        if self.calls and not text.strip():
            self.spaces += text
            return
        out.content += self.spaces + text
        self.spaces = ""

    def tool_calls(self) -> list[ToolCall]:
        """The calls parsed so far (whole once the output has ended)."""
        return [ToolCall(c.id, c.name, c.arguments) for c in self.calls]
