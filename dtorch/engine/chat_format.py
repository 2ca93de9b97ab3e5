"""A chat request turned into a prompt, and back: messages with tool calls, tools for the template, tool_choice as a
grammar, and the parser that splits the reply (``OutputParser``). ``LLM.chat``, ``dtorch chat`` and the server all
come through ``prepare_chat``.

Tools reach the chat template as ``tools`` (a list of ``{"type": "function", "function": {...}}``, as transformers'
``apply_chat_template(tools=...)`` passes them). A template that never reads ``tools`` gets dtorch's default
rendering instead (Hermes style, as Qwen2.5's template writes it): the tools and how to call them are added to the
system message; an assistant turn's calls are written as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
blocks in its content; tool results become a user turn of ``<tool_response>`` blocks.

``tool_choice``: "none" (the reply is text), "auto" (the model decides; its calls are parsed in its family's format,
which the template shows: ``tool_formats``), "required" (at least one call) or ``{"type": "function", "function":
{"name": ...}}`` (that one): the last two are a grammar of calls in that format over the tools' parameter schemas
(objects with listed properties closed to others unless they say otherwise, as in OpenAI's strict mode), so any model
makes a valid call. A JSON schema for the answer (``response_format``) with tools: under "auto" a turn of calls or
the answer, under a forced choice the call (``ChatSetup.with_answer``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dtorch.core.errors import ArgumentError, SamplingError
from dtorch.engine.grammar_bounds import nesting_depth
from dtorch.engine.output_parser import THINK_OPEN, OutputParser
from dtorch.engine.request import CompletionOutput
from dtorch.engine.sampling import SamplingParams
from dtorch.engine.structured import JSON_OPTIONS, StructuredOutputsParams, check_finite
from dtorch.engine.tool_formats import CALL_CLOSE, CALL_OPEN, NO_PARAMETERS, call_rules, tool_format

ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_USES_TOOLS = re.compile(r"\btools\b")

DEFAULT_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


MAX_ARGUMENT_DEPTH = 64  # levels of lists / dicts in a history's tool-call arguments
# levels of lists / dicts in anything else that reaches the template (messages, tools, chat_template_kwargs): its
# escaping and the template walk them by recursion (two Python frames a level), ~1000 deep was a RecursionError
MAX_TEMPLATE_DEPTH = 128


def field_error(param: str, message: str) -> ArgumentError:
    """An ``ArgumentError`` that names the request field at fault (``param``: "tools", "messages" ...)."""
    e = ArgumentError(message)
    e.param = param  # type: ignore[attr-defined]
    return e


@dataclass(frozen=True)
class ChatSetup:
    """A chat ready to generate: its prompt, the grammar its tool_choice asks for, and how to split its reply.

    reasoning: the template writes ``<think>`` blocks; thinking: the prompt opened one (the reply starts inside it);
    tools: calls in the reply are read (those of ``tool_names``, in the family's ``tool_format``); parallel_tool_calls:
    keep more than the first call. structured_outputs is the grammar of a forced call (tool_choice "required" or
    named); ``calls`` the grammar of one turn of calls, whatever the choice (None: no tools).
    """

    prompt_ids: list[int]
    structured_outputs: StructuredOutputsParams | None = None
    reasoning: bool = False
    thinking: bool = False
    tools: bool = False
    parallel_tool_calls: bool = True
    tool_names: tuple[str, ...] = ()
    tool_format: str = "hermes"
    calls: str | None = None

    def parser(self) -> OutputParser:
        """A fresh parser for one choice of the reply."""
        return OutputParser(self.reasoning, self.thinking, self.tool_names or self.tools, self.tool_format,
                            forced=self.structured_outputs is not None)

    def with_answer(self, answer: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
        """The grammar of a reply that has tools and must also match ``answer`` (a ``response_format``): under a
        forced choice the call now (the format applies to a later turn's answer), under "auto" a turn of calls or
        the answer, without tools the answer."""
        if self.structured_outputs is not None or answer is None:
            return self.structured_outputs or answer
        if not self.tools or self.calls is None:
            return answer
        schema = answer.json if answer.json is not None else {"type": "object"} if answer.json_object else None
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, Mapping):  # a regex, choice or grammar (or a bare true): the caller shapes it all
            return answer
        check_finite(dict(schema))  # the %json below is a grammar's: compile checks json fields only
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, "lenient": not answer.strict}}
        return StructuredOutputsParams(grammar=f"start: calls | answer\n{self.calls}answer: %json "
                                               f"{json.dumps(schema)}\n")


def prepare_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping] | None = None,
                 tool_choice: str | Mapping | None = None, parallel_tool_calls: bool = True,
                 chat_template_kwargs: Mapping[str, Any] | None = None, add_generation_prompt: bool = True,
                 continue_final_message: bool = False, allow_special_tokens: bool = False,
                 limit: int | None = None) -> ChatSetup:
    """The ``ChatSetup`` of one conversation. Errors are ``ArgumentError`` s whose ``param`` names the field; a
    rendered conversation past ``limit`` tokens is a ``ModelError`` (``Tokenizer.encode_chat``)."""
    for name, value in (("messages", messages), ("tools", tools)):
        if nesting_depth(value) > MAX_TEMPLATE_DEPTH:
            raise field_error(name, f"{name} nests deeper than {MAX_TEMPLATE_DEPTH} levels of lists and dicts")
    tools = check_tools(tools)
    choice = check_tool_choice(tool_choice, tools)
    kwargs = dict(chat_template_kwargs or {})
    # the names encode_chat / apply_chat_template take themselves ("self" included): a template variable of that
    # name would collide with them (a TypeError), so it is the client's 400
    reserved = {"messages", "tools", "add_generation_prompt", "continue_final_message", "allow_special_tokens",
                "limit", "self"} & set(kwargs)
    if reserved:
        raise field_error("chat_template_kwargs", f"chat_template_kwargs: {sorted(reserved)[0]!r} is set by the "
                                                  "request itself; pass it as its own field")
    for name, value in kwargs.items():
        if nesting_depth(value) > MAX_TEMPLATE_DEPTH:
            raise field_error("chat_template_kwargs", f"chat_template_kwargs[{name!r}] nests deeper than "
                                                      f"{MAX_TEMPLATE_DEPTH} levels of lists and dicts")
    if continue_final_message and add_generation_prompt:
        raise field_error("continue_final_message", "continue_final_message: the final message can be continued "
                                                    "only with add_generation_prompt false")
    source = tokenizer.chat_template or ""
    native = bool(_USES_TOOLS.search(source))
    fmt = tool_format(source) if native else "hermes"  # dtorch's own rendering teaches <tool_call> blocks
    msgs = check_messages(messages)
    if continue_final_message and msgs[-1]["role"] != "assistant":
        raise field_error("continue_final_message", "continue_final_message: the last message must be the "
                                                    f"assistant's, not {msgs[-1]['role']!r}")
    if tools and native:
        kwargs["tools"] = tools
    elif tools or not native:
        msgs = default_tool_rendering(msgs, tools)
    ids = tokenizer.encode_chat(msgs, add_generation_prompt=add_generation_prompt,
                                allow_special_tokens=allow_special_tokens,
                                continue_final_message=continue_final_message, limit=limit, **kwargs)
    reasoning = THINK_OPEN in source
    tail = tokenizer.decode(ids[-8:], skip_special_tokens=False) if reasoning else ""
    names = tuple(t["function"]["name"] for t in tools)
    return ChatSetup(ids, tool_grammar(tools, choice, parallel_tool_calls, fmt), reasoning,
                     tail.rstrip().endswith(THINK_OPEN), bool(tools) and choice != "none", parallel_tool_calls,
                     names if choice != "none" else (), fmt,
                     call_rules(tools, "required", parallel_tool_calls, fmt) if tools and choice != "none" else None)


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The tools as plain dicts, each ``{"type": "function", "function": {"name", ...}}``."""
    if tools is None:
        return []
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise field_error("tools", f"tools must be a list of {{'type': 'function', 'function': {{...}}}}, got "
                                   f"{type(tools).__name__}")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(fn, Mapping):
            raise field_error("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                       f"'parameters': ...}}}}, got {t!r:.200}")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise field_error("tools", f"tools[{i}].function.name must be 1 to 64 letters, digits, _ or -, "
                                       f"got {name!r:.100}")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise field_error("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        try:
            check_finite(dict(params or {}), f"tools[{i}].function.parameters")
        except SamplingError as e:
            raise field_error("tools", str(e)) from None
        # no parameters: the function takes none (OpenAI's reading), and templates that read them find an object
        out.append({"type": "function", "function": {**fn, "parameters": NO_PARAMETERS if params is None else params}})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise field_error("tools", f"tools: function names must be unique, got {names}")
    return out


def check_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> str:
    """"none", "auto", "required" or the name of the one function to call."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise field_error("tool_choice", "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                             f"'function': {{'name': ...}}}}, got {choice!r:.200}")
        if name not in [t["function"]["name"] for t in tools]:
            raise field_error("tool_choice", f"tool_choice names the function {name!r}, which is not in tools")
        return name
    if choice not in ("none", "auto", "required"):
        raise field_error("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                                         f"got {choice!r:.100}")
    if choice == "required" and not tools:
        raise field_error("tool_choice", "tool_choice 'required' needs tools")
    return choice


def tool_grammar(tools: list[dict[str, Any]], choice: str, parallel: bool,
                 fmt: str = "hermes") -> StructuredOutputsParams | None:
    """For "required" or a named function: a Lark grammar of calls in the family's format (``fmt``) whose JSON
    follows the tools' parameter schemas (one call, or several when ``parallel``); else None."""
    if choice in ("none", "auto"):
        return None
    return StructuredOutputsParams(grammar="start: calls\n" + call_rules(tools, choice, parallel, fmt))


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as the template gets them: known roles ("developer" is "system"), an assistant's tool calls with
    their arguments as objects (what templates expect), ``content: null`` as ""."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise field_error("messages", "messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise field_error("messages", "messages must be a list of {'role': str, 'content': ...} dicts; "
                                          f"messages[{i}] is {m!r:.200}")
        role = m.get("role")
        if role not in ROLES:
            raise field_error("messages", f"messages[{i}].role: unknown role {role!r}; the roles are "
                                          f"{', '.join(ROLES)}")
        m = {k: v for k, v in m.items() if v is not None or k == "content"}
        m["role"] = "system" if role == "developer" else role
        if m.get("content") is None:
            if role != "assistant" or not m.get("tool_calls"):
                raise field_error("messages", f"messages[{i}].content is missing; only an assistant message with "
                                              "tool_calls may leave it null")
            m["content"] = ""
        if "tool_calls" in m:
            m["tool_calls"] = [_history_call(i, j, c) for j, c in enumerate(m["tool_calls"] or ())]
            if role != "assistant":
                raise field_error("messages", f"messages[{i}]: only assistant messages have tool_calls")
        out.append(m)
    return out


def _history_call(i: int, j: int, call: Any) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise field_error("messages", f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                                      "'arguments': ...}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise field_error("messages", f"{where}.function.arguments is not valid JSON ({e})") from None
        except RecursionError:
            args = None  # nested past Python's stack: past any depth below too
    if args is None or nesting_depth(args) > MAX_ARGUMENT_DEPTH:
        raise field_error("messages", f"{where}.function.arguments nests deeper than {MAX_ARGUMENT_DEPTH} levels; "
                                      "the template and the tokenizer would recurse that deep")
    return {**call, "type": "function", "function": {"name": fn["name"], "arguments": args}}


def default_tool_rendering(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that does not read ``tools``: the tools in the system message, calls as
    ``<tool_call>`` blocks in the assistant's content, tool results as a user turn of ``<tool_response>`` blocks."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [f"{CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                     "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                      + f"\n{CALL_CLOSE}" for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m["content"] else []) + blocks)
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
        elif m["role"] == "tool":
            block = f"<tool_response>\n{_text(m['content'])}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
                continue
            m = {"role": "user", "content": block, "_tool_results": True}
        out.append(m)
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        text = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{_text(out[0]['content'])}\n\n{text}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


def with_tool_grammar(params: SamplingParams, setup: ChatSetup) -> SamplingParams:
    """``params`` with the grammar a chat's tool_choice asks for ("required" or a named function), or, under "auto"
    with a JSON schema, that of a turn of calls or the answer (``ChatSetup.with_answer``)."""
    if setup.structured_outputs is not None and params.structured_outputs is not None:
        raise ArgumentError("tool_choice 'required' or a named function constrains the reply to tool calls; it "
                            "cannot be combined with structured_outputs")
    structured = setup.with_answer(params.structured_outputs)
    if structured is params.structured_outputs:
        return params
    return dataclasses.replace(params, structured_outputs=structured)


def split_reply(c: CompletionOutput, setup: ChatSetup) -> None:
    """Set a chat choice's ``text``, ``reasoning_content`` and ``tool_calls`` from its raw text."""
    parser = setup.parser()
    parser.feed(c.text, final=True)
    calls = parser.tool_calls()
    c.text = parser.content
    c.reasoning_content = parser.reasoning or None
    c.tool_calls = (calls if setup.parallel_tool_calls else calls[:1]) or None
