"""The tool-call formats of the model families: which one a chat template teaches (``tool_format``), and reading a
reply that is nothing but calls, bare, fenced or after the family's tag (``maybe_bare`` while it streams,
``parse_calls`` once it has ended; ``output_parser.OutputParser`` uses them beside its ``<tool_call>`` blocks), and the
grammar of a turn of calls as the family writes them (``call_rules``, for a forced tool choice).

- "hermes": ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5, Qwen3, Hermes, and dtorch's
  default tool rendering).
- "llama3": ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3), after ``<|python_tag|>`` or bare; several
  separated by ``;``.
- "mistral": ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` (Mistral v3, Nemo) or ``[TOOL_CALLS]name[ARGS]{...}``
  (the later templates). The tags are special tokens, which a reply's text leaves out: the bare forms are read too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from dtorch.engine.structured import JSON_OPTIONS

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG, MISTRAL_CALLS, MISTRAL_ARGS = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"
FORMATS = ("hermes", "llama3", "mistral")
_FENCE = re.compile(r"```(?:json)?[ \t]*\n(.*?)\n?```", re.S)
_WORD = re.compile(r"[A-Za-z0-9_-]+")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function without parameters


def tool_format(template: str | None) -> str:
    """The tool-call format a chat template teaches its model (one of ``FORMATS``): "hermes" for templates with
    ``<tool_call>`` blocks and for those without tool support (dtorch renders the tools then, in that format)."""
    source = template or ""
    if CALL_OPEN in source:
        return "hermes"
    if MISTRAL_CALLS in source:
        return "mistral"
    if PYTHON_TAG in source or '"parameters": dictionary of argument name' in source:
        return "llama3"
    return "hermes"


def maybe_bare(text: str, names: Sequence[str], fmt: str) -> bool | None:
    """Whether a reply that starts with ``text`` is a bare call of one of ``names`` (JSON, in a json fence, a list
    of them, or Mistral's ``name[ARGS]{...}``); None: it cannot be told yet."""
    s = text.lstrip()
    if not s:
        return None
    if s[0] == "`":
        if "\n" not in s:
            return None if re.fullmatch(r"`{1,3}(j(s(o(n)?)?)?)?[ \t]*", s) else False
        head, s = s.split("\n", 1)
        if not re.fullmatch(r"```(json)?[ \t]*", head):
            return False
        s = s.lstrip()
    if s[:1] == "[":
        s = s[1:].lstrip()
    if not s:
        return None
    if s[0] == "{":
        m = re.match(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)(")?', s)
        if m is None:
            return None if '{"name":"'.startswith(re.sub(r"\s+", "", s)) else False
        if m.group(2):
            return m.group(1) in names
        return None if any(n.startswith(m.group(1)) for n in names) else False
    m = _WORD.match(s) if fmt == "mistral" else None
    if m is None:
        return False
    word, rest = m.group(), s[m.end():].lstrip()
    if not rest:
        return None if any(n.startswith(word) for n in names) else False
    if word not in names:
        return False
    if rest[0] == "{" or rest.startswith(MISTRAL_ARGS):
        return True
    return None if MISTRAL_ARGS.startswith(rest) else False


def parse_calls(text: str, names: Sequence[str], fmt: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call when the whole ``text`` is calls, else None. Bare calls must name a
    declared tool; after the family's tag any name is a call."""
    s = text.strip()
    fence = _FENCE.fullmatch(s)
    if fence is not None:
        s = fence.group(1).strip()
    tagged = s.startswith((PYTHON_TAG, MISTRAL_CALLS))
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(s):
        if s[i] in " \t\r\n;,":
            i += 1
            continue
        tag = next((t for t in (PYTHON_TAG, MISTRAL_CALLS) if s.startswith(t, i)), None)
        if tag is not None:
            i += len(tag)
            continue
        name = None
        if s[i] not in "{[":
            m = _WORD.match(s, i) if fmt == "mistral" else None
            if m is None:
                return None
            name, i = m.group(), m.end()
            i = len(s) - len(s[i:].lstrip())
            if s.startswith(MISTRAL_ARGS, i):
                i += len(MISTRAL_ARGS)
            i = len(s) - len(s[i:].lstrip())
        try:
            value, i = decoder.raw_decode(s, i)
        except ValueError:
            return None
        items = [{"name": name, "arguments": value}] if name is not None else \
            value if isinstance(value, list) else [value]
        for item in items:
            call = _call_of(item, names, tagged)
            if call is None:
                return None
            calls.append(call)
    return calls or None


def _call_of(item: object, names: Sequence[str], tagged: bool) -> tuple[str, str] | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    args = item.get("arguments", item.get("parameters"))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict) or not (tagged or item["name"] in names):
        return None
    return item["name"], json.dumps(args, ensure_ascii=False)


def call_rules(tools: list[dict[str, Any]], choice: str, parallel: bool, fmt: str) -> str:
    """Lark rules whose ``calls`` is one turn of calls of the chosen tools ("required": any of them; else the one
    named) as ``fmt`` writes them: hermes ``<tool_call>`` blocks, llama3 bare ``{"name", "parameters"}`` objects,
    mistral a JSON list (its ``[TOOL_CALLS]`` tag is a special token, which the reply's text leaves out)."""
    chosen = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice]
    key = "parameters" if fmt == "llama3" else "arguments"
    several = parallel and choice == "required"

    def call(i: int, f: Mapping[str, Any]) -> dict[str, Any]:
        where = f"#/anyOf/{i}" if len(chosen) > 1 else "#"
        params = _rebased(_closed(f.get("parameters") or NO_PARAMETERS), f"{where}/properties/{key}")
        return {"type": "object", "properties": {"name": {"const": f["name"]}, key: params},
                "required": ["name", key], "additionalProperties": False}

    calls = [call(i, f) for i, f in enumerate(chosen)]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    one = json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, "lenient": True}})
    if fmt == "hermes":
        return (f"calls: call{'+' if several else ''}\n"
                f"call: {json.dumps(CALL_OPEN + chr(10))} %json {one} {json.dumps(chr(10) + CALL_CLOSE)}\n")
    more = ' (", " call)*' if several else ""
    if fmt == "mistral":
        return f'calls: "[" call{more} "]"\ncall: %json {one}\n'
    return f"calls: call{more.replace(',', ';')}\ncall: %json {one}\n"


def _rebased(schema: Any, at: str) -> Any:
    """``schema`` moved to JSON pointer ``at`` of a bigger one: its local ``$ref`` s ("#/$defs/User", "#") made to
    point where their targets now are."""
    if isinstance(schema, list):
        return [_rebased(s, at) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: _rebased(v, at) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = at + ref[1:]
    return out


def _closed(schema: Any) -> Any:
    """A parameters schema whose objects with listed properties take no others unless they say so (as OpenAI's
    strict function calling has them): a call then carries only the parameters the function declares."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    nested = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties", "not", "if", "then", "else")
    out = {k: _closed(v) if k in nested else v for k, v in schema.items()}
    for group in ("properties", "$defs", "definitions"):
        if isinstance(schema.get(group), Mapping):
            out[group] = {k: _closed(v) for k, v in schema[group].items()}
    if isinstance(schema.get("properties"), Mapping):
        out.setdefault("additionalProperties", False)
    return out
