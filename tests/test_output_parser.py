"""The pieces behind issue #22 that need no model: the streaming split of a reply (reasoning, content, tool calls),
the sampler's grammar mask and logit_bias, the chat format's checks, and structured outputs without llguidance."""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch

from dtorch.core.errors import ArgumentError, DtorchError, SamplingError
from dtorch.engine.chat_format import check_messages, default_tool_rendering, tool_grammar
from dtorch.engine.output_parser import OutputParser
from dtorch.engine.sampling import SamplingParams, sample_step
from dtorch.engine.structured import Grammars, StructuredOutputsParams, unpack_bits


def _split(text: str, sizes, **kw) -> tuple:
    """Feed ``text`` in pieces of ``sizes()`` characters; (reasoning, content, [(name, args)], no half tag seen)."""
    p, at, deltas = OutputParser(**kw), 0, []
    while at < len(text):
        n = sizes()
        deltas.append(p.feed(text[at:at + n]))
        at += n
    deltas.append(p.feed("", final=True))
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.tool_calls:
            call = calls.setdefault(c.index, ["", ""])
            if c.name is not None:
                assert not call[0] and c.id.startswith("call_")
                call[0] = c.name
            else:
                assert call[0], "arguments before the name"
            call[1] += c.arguments
    content = "".join(d.content for d in deltas)
    assert [(c.name, c.arguments) for c in p.tool_calls()] == [tuple(c) for _, c in sorted(calls.items())]
    return "".join(d.reasoning for d in deltas), content, [tuple(c) for _, c in sorted(calls.items())]


CASES = [
    ("<think>\nlet me see</think>\n\nThe answer is 4.", dict(reasoning=True),
     ("\nlet me see", "The answer is 4.", [])),
    ("a < b and <tool is no tag <thin", dict(reasoning=True, tools=True), ("", "a < b and <tool is no tag <thin", [])),
    ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", "q": "a\\"}"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n', dict(tools=True),
     ("", "Checking.", [("get_weather", '{"city": "Pa}ris", "q": "a\\"}"}'), ("f", "{}")])),
    ('<tool_call>{"arguments": {"x": 1}, "name": "late"}</tool_call>', dict(tools=True),
     ("", "", [("late", '{"x": 1}')])),
    ("<tool_call>not json</tool_call> after", dict(tools=True), ("", "<tool_call>not json</tool_call> after", [])),
    ('<tool_call>{"name": "cut", "arguments": {"x": 1', dict(tools=True), ("", "", [("cut", '{"x": 1')])),
    ('thought</think>\n\nok<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     dict(reasoning=True, thinking=True, tools=True), ("thought", "ok", [("f", "[1]")])),
    ("<tool_call>x</tool_call>", dict(tools=False), ("", "<tool_call>x</tool_call>", [])),
]


# issue #40: each family's format (picked from its template), bare calls of declared tools, forced calls cut short
NAMES = ("get_weather", "get_time")
CASES += [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', dict(tools=NAMES),  # Qwen2.5-Coder
     ("", "", [("get_weather", '{"city": "Paris"}')])),
    ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n', dict(tools=NAMES),
     ("", "", [("get_weather", '{"city": "Paris"}')])),
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
     dict(tools=NAMES), ("", "", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])),
    ('{"name": "get_forecast", "arguments": {"city": "Paris"}}', dict(tools=NAMES),  # not a declared tool
     ("", '{"name": "get_forecast", "arguments": {"city": "Paris"}}', [])),
    ('{"name": "get_weather", "arguments": {}} and more', dict(tools=NAMES),
     ("", '{"name": "get_weather", "arguments": {}} and more', [])),
    ('Sure: {"name": "get_weather", "arguments": {}}', dict(tools=NAMES),
     ("", 'Sure: {"name": "get_weather", "arguments": {}}', [])),
    ('```python\nprint(1)\n```', dict(tools=NAMES), ("", "```python\nprint(1)\n```", [])),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', dict(tools=NAMES, fmt="llama3"),
     ("", "", [("get_weather", '{"city": "Paris"}')])),
    ('{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}',
     dict(tools=NAMES, fmt="llama3"), ("", "", [("get_time", "{}"), ("get_weather", '{"city": "Rome"}')])),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', dict(tools=NAMES, fmt="mistral"),
     ("", "", [("get_weather", '{"city": "Paris"}')])),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', dict(tools=NAMES, fmt="mistral"),
     ("", "", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])),
    ('get_weather{"city": "Paris"}', dict(tools=NAMES, fmt="mistral"),  # the tags are special tokens, left out
     ("", "", [("get_weather", '{"city": "Paris"}')])),
    ("get ready [to go]", dict(tools=NAMES, fmt="mistral"), ("", "get ready [to go]", [])),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"ci', dict(tools=NAMES, forced=True),
     ("", "", [("get_weather", '{"ci')])),
    ("<tool_call>\n", dict(tools=NAMES, forced=True), ("", "", [])),  # cut in the tag: nothing, no text
    ('[{"name": "get_weather", "arguments": {"city": "Pa', dict(tools=NAMES, fmt="mistral", forced=True),
     ("", "", [("get_weather", '{"city": "Pa')])),
]


@pytest.mark.parametrize("text, kw, want", CASES)
def test_the_split_is_the_same_whole_or_in_any_pieces(text, kw, want):
    assert _split(text, lambda: 10 ** 9, **kw) == want
    for seed in range(30):
        assert _split(text, lambda r=random.Random(seed): r.randint(1, 5), **kw) == want


def test_the_format_is_picked_from_the_template():
    from dtorch.engine.tool_formats import tool_format

    # the markers each family's template teaches (Qwen2.5 / Hermes, Llama 3.1, Mistral Nemo), and no tool support
    assert tool_format("{% for tool in tools %}...{% endfor %}<tool_call>\n{...}\n</tool_call>") == "hermes"
    assert tool_format('Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                       "its value}.{% if m.tool_calls %}<|python_tag|>{% endif %}") == "llama3"
    assert tool_format("{% if message.tool_calls %}[TOOL_CALLS][{% for c in message.tool_calls %}") == "mistral"
    assert tool_format(None) == tool_format("{{ messages }}") == "hermes"


def test_a_bare_call_is_held_only_while_it_may_be_one():
    p = OutputParser(tools=NAMES)
    assert p.feed('{"na').content == "" and p.feed('me": "get_w').content == ""  # may be a call: held
    assert p.feed('eird"').content == '{"name": "get_weird"'  # no such tool: content at once
    p = OutputParser(tools=NAMES)
    assert p.feed("Hello").content == "Hello" and p.feed(' {"name": "get_time"').content == ' {"name": "get_time"'


def test_no_half_tag_reaches_the_content():
    p = OutputParser(reasoning=True, tools=True)
    seen = "".join(p.feed(c).content for c in "Hi <tool_call")
    assert seen == "Hi "  # "<tool_call" might still become a tag: held back
    assert p.feed(">").content == "" and p.feed('{"name": "f"').tool_calls[0].name == "f"


def test_the_mask_allows_only_its_tokens_and_unconstrained_rows_are_untouched():
    logits = torch.randn(3, 70)
    words = torch.zeros(1, 3, dtype=torch.int32)
    words[0, 1] = 1 << 5  # token 37 only
    masks = unpack_bits(words, 70)
    assert masks.shape == (1, 70) and masks[0].nonzero().flatten().tolist() == [37]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0)]
    gens = [None, params[1].generator(), None]
    refused = unpack_bits(words, 70, refused=True)
    assert torch.equal(refused, ~masks)
    tokens, _ = sample_step(logits, params, gens, [()] * 3, [()] * 3, allowed=([1], refused))
    assert tokens[1] == 37 and tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    # a ban (min_tokens) that would leave the row nothing yields to the grammar
    tokens, _ = sample_step(logits, params, gens, [()] * 3, [()] * 3, banned=[(), [37], ()], allowed=([1], refused))
    assert tokens[1] == 37


def test_logit_bias_is_applied_and_checked():
    logits = torch.zeros(1, 10)
    logits[0, 3] = 5.0
    assert sample_step(logits, [SamplingParams(temperature=0, logit_bias={7: 100})], [None], [()], [()])[0] == [7]
    assert sample_step(logits, [SamplingParams(temperature=0, logit_bias={3: -100})], [None], [()], [()])[0] != [3]
    for bad in ({1: 101}, {-1: 1}, {"1": 1}, [1]):
        with pytest.raises(SamplingError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_structured_outputs_params_are_checked():
    with pytest.raises(SamplingError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(SamplingError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(SamplingError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(SamplingError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(SamplingError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json": {}})
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {}}})
    assert a.key == StructuredOutputsParams(json='{"properties": {"a": {}}, "type": "object"}').key


def test_without_llguidance_structured_outputs_say_what_to_install(monkeypatch):
    for name in [m for m in sys.modules if m == "llguidance" or m.startswith("llguidance.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance raises ImportError
    with pytest.raises(DtorchError, match=r"llguidance.*pip install 'dtorch\[serve\]'"):
        Grammars(object(), 10, [1]).compile(StructuredOutputsParams(regex="a"))


def test_history_checks_and_the_default_tool_rendering():
    msgs = check_messages([
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "warm"}])
    assert msgs[0]["role"] == "system" and msgs[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    tools = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
    out = default_tool_rendering(msgs, tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(tools[0]) in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "w", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>"
    for bad, what in (([{"role": "wizard", "content": "x"}], "unknown role 'wizard'"),
                      ([{"role": "user", "content": None}], "content is missing"),
                      ([{"role": "assistant", "content": None, "tool_calls": [
                          {"function": {"name": "w", "arguments": "{nope"}}]}], "not valid JSON")):
        with pytest.raises(ArgumentError, match=what) as e:
            check_messages(bad)
        assert e.value.param == "messages"
    grammar = tool_grammar(tools, "w", parallel=True).grammar
    assert grammar.startswith("start: calls\ncalls: call\ncall: ") and '"const": "w"' in grammar
    open_params = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}},
                   "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "w", "parameters": open_params}}]
    schema = json.loads(tool_grammar(tools, "required", False).grammar.split("%json ", 1)[1].rsplit(' "', 1)[0])
    args = schema["properties"]["arguments"]
    assert args["additionalProperties"] is False and args["properties"]["a"]["additionalProperties"] is False
