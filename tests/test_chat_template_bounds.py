"""Chat templates from model files are untrusted code: each bomb ends within seconds and bounded memory with a
ModelError naming the template's file and the bound; real templates render exactly as jinja2's sandbox does."""

# ruff: noqa: E501 (the real templates below are quoted as their models ship them, long lines and all)
from __future__ import annotations

import os
import time
import tracemalloc

import gguf
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dtorch import ArgumentError, ModelError
from dtorch.models import Tokenizer, chat_template, default_model_path
from dtorch.models.loaders.gguf import read_metadata

CHAT = [{"role": "user", "content": "Hi"}]

BOMBS = {
    "nested ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "time limit"),
    "nested lists": ("{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
                     "time limit"),
    "huge power": ("{{ (10 ** (10 ** 8)) % 7 }}", "bits"),
    "squaring": ("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
                 "bits"),
    "lipsum": ("{{ lipsum(n=100000) }}", "lipsum"),
    "repetition": ("{{ 'x' * 10**10 }}", "over the bound"),
    "list repetition": ("{{ ([1] * 10**10)|length }}", "over the bound"),
    "doubling": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                 "over the bound"),
    "doubling with +": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                        "{% endfor %}", "over the bound"),
    "many copies": ("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
                    "{% set ns.l = ns.l + ['x' * 1000000 ~ i] %}{% endfor %}", "in all"),
    "center": ("{{ 'x'|center(10**9) }}", "over the bound"),
    "ljust method": ("{{ 'x'.ljust(10**9) }}", "over the bound"),
    "percent width": ("{{ '%01000000000d' % 1 }}", "format width"),
    "percent star": ("{{ '%*d' % (10**9, 1) }}", "over the bound"),
    "format width": ("{{ '{:>1000000000}'.format(1) }}", "format width"),
    "format nested width": ("{{ '{:{}}'.format(1, 10**9) }}", "over the bound"),
    "replace": ("{{ ('x' * 1000000).replace('x', 'y' * 1000) }}", "over the bound"),
    "replace filter": ("{{ ('x' * 1000000)|replace('x', 'y' * 1000) }}", "over the bound"),
    "join": ("{{ (['x' * 1000000] * 1000)|join }}", "over the bound"),
    "join method": ("{{ ''.join(['x' * 1000000] * 1000) }}", "over the bound"),
    "indent": ("{{ ('\n' * 100000)|indent('x' * 100000) }}", "over the bound"),
    "output": ("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", "output passed"),
    "macro fan-out": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
                      "time limit"),
    "recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "Recursion"),
}


@pytest.fixture(scope="module")
def meta() -> dict:
    return read_metadata(gguf.GGUFReader(str(default_model_path())), default_model_path())


@pytest.fixture(scope="module")
def backend(meta):
    return Tokenizer.from_gguf(meta, source="default").backend


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(chat_template, "TIME_LIMIT_S", 1.0)


@pytest.mark.parametrize("name", BOMBS)
def test_template_bombs_end_in_seconds_and_bounded_memory(meta, fast, name):
    source, bound = BOMBS[name]
    tok = Tokenizer.from_gguf(meta, chat_template=source, source="evil.gguf")
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ModelError, match=r"evil.gguf \(tokenizer.chat_template\): the chat template") as e:
            tok.apply_chat_template(CHAT)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert bound in str(e.value)
    assert time.perf_counter() - t0 < 10
    assert peak < 300 << 20, f"{name}: {peak >> 20} MiB"


def test_time_limit_at_its_default(meta):
    tok = Tokenizer.from_gguf(meta, chat_template=BOMBS["nested ranges"][0], source="evil.gguf")
    t0 = time.perf_counter()
    with pytest.raises(ModelError, match=f"time limit of {chat_template.TIME_LIMIT_S} s"):
        tok.apply_chat_template(CHAT)
    assert time.perf_counter() - t0 < chat_template.TIME_LIMIT_S + 5


def test_the_error_names_tokenizer_config(tmp_path, backend):
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_hf(tmp_path / "tokenizer.json", {"chat_template": "{{ 'x' * 10**10 }}"})
    with pytest.raises(ModelError, match=r"tokenizer_config.json: the chat template went past a bound: '\*'"):
        tok.apply_chat_template(CHAT)
    named = Tokenizer.from_hf(tmp_path / "tokenizer.json", {}, chat_template="{{ 'x' * 10**10 }}",
                              template_source=str(tmp_path / "chat_template.jinja"))
    with pytest.raises(ModelError, match="chat_template.jinja: the chat template went past"):
        named.apply_chat_template(CHAT)


def test_template_errors_are_model_errors(backend):
    for source, what in (("{{ 1 // 0 }}", "ZeroDivisionError"), ("{{ 1 + 'a' }}", "TypeError"),
                         ("{{ range(10**6) }}", "OverflowError"), ("{% for %}", "does not compile")):
        tok = Tokenizer(backend, bos_token_id=None, eos_token_ids=(), chat_template=source, source="t.gguf")
        with pytest.raises(ModelError, match=f"t.gguf: the chat template .*{what}"):
            tok.apply_chat_template(CHAT)
    raising = Tokenizer(backend, bos_token_id=None, eos_token_ids=(), source="t.gguf",
                        chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(ArgumentError, match="rejected the messages: no system role"):
        raising.apply_chat_template(CHAT)


def test_large_conversations_stay_within_the_bounds(backend):
    """The bounds grow with the messages: a conversation of a few million characters renders."""
    tok = Tokenizer(backend, bos_token_id=None, eos_token_ids=(), chat_template=QWEN25, source="q")
    big = [{"role": "user", "content": "word " * 1_000_000}] * 4
    assert len(tok.apply_chat_template(big)) > 20_000_000


# --- real templates render exactly as jinja2's sandbox renders them ------------------------------------------------

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
          "+ message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 "
          "== 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt "
          "%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

QWEN3_PART = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role == "assistant" and '</think>' in content %}
        {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' ~ content }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + content ~ '<|im_end|>\\n' }}
    {%- endif %}
    {%- if loop.last %}{{ '%d messages, %s' % (loop.length, ns.last_query_index) }}{{ '{:>4}'.format(loop.index0) }}{% endif %}
{%- endfor %}
{{- messages|map(attribute='role')|join(', ')|center(40)|replace('user', 'USER') }}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "  Hello  "}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}, {"role": "user", "content": "×3 🦙?"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "20C"}],
]


@pytest.mark.parametrize("source", [LLAMA3, QWEN25, QWEN3_PART], ids=["llama3", "qwen2.5", "qwen3-like"])
def test_real_templates_render_as_before(backend, source):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = chat_template._tojson
    plain = env.from_string(source)
    tok = Tokenizer(backend, bos_token_id=None, eos_token_ids=(), chat_template=source, source="real")
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"city": {"type": "string"}}}}]
    for messages in CONVERSATIONS:
        for gen in (True, False):
            for extra in ({}, {"tools": tools}):
                want = plain.render(messages=messages, add_generation_prompt=gen, bos_token="", eos_token="", **extra)
                assert tok.apply_chat_template(messages, gen, **extra) == want


# --- template files ----------------------------------------------------------------------------------------------

def test_template_files_that_are_not_utf8_text(tmp_path):
    bad = tmp_path / "chat_template.jinja"
    bad.write_bytes(b"{{ messages }}\xff\xfe")
    with pytest.raises(ModelError, match=f"{bad}: the chat template is not UTF-8 text"):
        chat_template.read_template(bad)
    folder = tmp_path / "dir.jinja"
    folder.mkdir()
    with pytest.raises(ModelError, match=f"{folder}: a chat template must be a regular file"):
        chat_template.read_template(folder)
    fifo = tmp_path / "fifo.jinja"
    os.mkfifo(fifo)
    with pytest.raises(ModelError, match=f"{fifo}: a chat template must be a regular file"):
        chat_template.read_template(fifo)
    with pytest.raises(ModelError, match="cannot read the chat template"):
        chat_template.read_template(tmp_path / "missing.jinja")
    good = tmp_path / "good.jinja"
    good.write_text("{{ messages[0]['content'] }} ✓", encoding="utf-8")
    assert chat_template.read_template(good) == "{{ messages[0]['content'] }} ✓"
