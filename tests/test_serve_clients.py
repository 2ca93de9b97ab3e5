"""Issue #40: the libraries agents are built with, unchanged, against a live ``dtorch serve``: the ``openai`` SDK
(``parse`` with Pydantic, ``pydantic_function_tool``, the streaming helper), ``instructor``, ``langchain-openai``,
``litellm``, ``openai-agents`` and ``pydantic-ai`` (the ``dtorch[clients]`` extra; each library's tests skip without
it). The clients' own parsing and validation are the reference: a reply they cannot read fails here.

One server for the module, on a random 2-layer Qwen3 with a Hermes-style template, 4096 positions and Qwen's FIM tokens
in its vocabulary. A random model has no manners, so the tests never rely on them: replies are shaped by what the
protocol itself constrains (schemas, forced tool choices), by a ``structured_outputs`` regex standing in for a model
that writes a given call, or by a ``logit_bias`` that takes a branch of a grammar (``<`` tokens banned: the answer
rather than a call). Everything listens on 127.0.0.1; the libraries' telemetry is off.
"""

from __future__ import annotations

import enum
import json
import os
from types import SimpleNamespace
from typing import Annotated

import pytest
from test_serve import _start_server, _stop

# no client phones home: litellm's model cost map from its package, no traces from the agents SDK or LangSmith
for _key, _value in (("LITELLM_LOCAL_MODEL_COST_MAP", "True"), ("OPENAI_AGENTS_DISABLE_TRACING", "1"),
                     ("LANGSMITH_TRACING", "false"), ("LANGCHAIN_TRACING_V2", "false")):
    os.environ.setdefault(_key, _value)

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("llguidance")
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>")
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


class Unit(enum.StrEnum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


WORD = r"^[a-z]{1,6}$"  # a few tokens, whatever the model


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=WORD)


class Weather(BaseModel):
    """The weather in a city: a nested model and an Enum, so its JSON schema has ``$defs`` and ``$ref`` s."""

    model_config = ConfigDict(extra="forbid")
    city: City
    unit: Unit
    days: int = Field(ge=1, le=7)


class Forecast(BaseModel):
    """A forecast."""

    model_config = ConfigDict(extra="forbid")
    sky: str = Field(pattern=WORD)
    degrees: int = Field(ge=-50, le=50)


GET_TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}  # no parameters
CALL_JSON = r'\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}'


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    import torch
    from test_serve_agents import make_tiny_chat_model
    from tokenizers import Tokenizer

    torch.manual_seed(40)
    path = tmp_path_factory.mktemp("tiny-clients")
    make_tiny_chat_model(path, FIM, positions=4096)
    proc, port = _start_server("--model", str(path), "--served-model-name", "tiny", "--max-num-batched-tokens", "256")
    try:
        url = f"http://127.0.0.1:{port}/v1"
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
        hidden = json.loads((path / "config.json").read_text())["hidden_size"]
        yield SimpleNamespace(url=url, port=port, client=client, tok=tok, hidden=hidden, path=path)
    finally:
        _stop(proc)


def _bias(live, prefix: str, value: int) -> dict[str, int]:
    """A logit_bias of ``value`` on every token whose text starts with ``prefix``."""
    return {str(i): value for i in range(live.tok.get_vocab_size()) if live.tok.decode([i]).startswith(prefix)}


def _streamed(chunks) -> tuple[str, list[tuple[str, str]], str | None]:
    """The content, (name, arguments) per call and the finish reason of streamed chat chunks."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        for c in ch.choices:
            content += c.delta.content or ""
            for t in c.delta.tool_calls or ():
                call = calls.setdefault(t.index, ["", ""])
                call[0] += t.function.name or ""
                call[1] += t.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [tuple(c) for _, c in sorted(calls.items())], finish


# -- the ten findings, through the openai SDK ----------------------------------------------------------------------

def test_pydantic_schemas_with_defs_parse_as_response_format_and_as_forced_tools(live):
    """#1: ``$defs`` / ``$ref`` resolve in a forced tool's schema (and in response_format), streamed and not."""
    c = live.client
    r = c.chat.completions.parse(model="tiny", messages=WEATHER, response_format=Weather, max_tokens=200,
                                 temperature=0)
    assert isinstance(r.choices[0].message.parsed, Weather)
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    assert "$defs" in tool["function"]["parameters"]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw = dict(model="tiny", messages=WEATHER, tools=[tool], tool_choice=choice, max_tokens=200, temperature=0,
                  parallel_tool_calls=False)
        r = c.chat.completions.parse(**kw)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and isinstance(call.function.parsed_arguments, Weather)
        with c.chat.completions.stream(**kw) as s:
            final = s.get_final_completion()
        assert final.choices[0].message.tool_calls[0].function.parsed_arguments == call.function.parsed_arguments


def test_response_format_with_tools(live):
    """#2: under a forced choice the call comes now, despite response_format (openai-agents sends both); under auto
    the grammar is a call or the answer, and either branch can be taken."""
    c, rf = live.client, {"type": "json_schema", "json_schema": {"name": "forecast", "strict": True,
                                                                 "schema": Forecast.model_json_schema()}}
    tool = openai.pydantic_function_tool(City, name="get_weather")
    r = c.chat.completions.create(model="tiny", messages=WEATHER, tools=[tool], tool_choice="required",
                                  response_format=rf, max_tokens=120, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    City.model_validate_json(r.choices[0].message.tool_calls[0].function.arguments)
    kw = dict(model="tiny", messages=WEATHER, tools=[tool], response_format=rf, max_tokens=120, temperature=0)
    answer = c.chat.completions.create(**kw, logit_bias=_bias(live, "<", -100))
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
    Forecast.model_validate_json(answer.choices[0].message.content)
    call = c.chat.completions.create(**kw, logit_bias=_bias(live, "<tool_call>", 100), parallel_tool_calls=False)
    assert call.choices[0].finish_reason == "tool_calls" and call.choices[0].message.content is None
    City.model_validate_json(call.choices[0].message.tool_calls[0].function.arguments)


@pytest.mark.parametrize("written, is_call", [
    (CALL_JSON, True),  # Qwen2.5-Coder's bare call
    (r"```json\n" + CALL_JSON + r"\n```", True),  # ... in a json fence
    (r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome)"\}\}', True),  # Llama 3's key
    (r'\{"name": "get_forecast", "arguments": \{"city": "Paris"\}\}', False),  # no such tool: content
])
def test_a_bare_call_of_a_declared_tool_is_a_call_streamed_and_not(live, written, is_call):
    """#3: a reply that is only a call of a declared tool, bare or fenced, is that call (``auto``)."""
    tool = openai.pydantic_function_tool(City, name="get_weather")
    kw = dict(model="tiny", messages=WEATHER, tools=[tool], max_tokens=80, temperature=0,
              extra_body={"structured_outputs": {"regex": written}})
    r = live.client.chat.completions.create(**kw)
    msg, finish = r.choices[0].message, r.choices[0].finish_reason
    content, calls, streamed_finish = _streamed(live.client.chat.completions.create(**kw, stream=True))
    if is_call:
        assert finish == streamed_finish == "tool_calls" and msg.content is None and not content
        assert [(t.function.name, json.loads(t.function.arguments)["city"] in ("Paris", "Rome"))
                for t in msg.tool_calls] == [("get_weather", True)]
        assert calls == [(t.function.name, t.function.arguments) for t in msg.tool_calls]
    else:
        assert finish == streamed_finish == "stop" and not msg.tool_calls and not calls
        assert msg.content == content and json.loads(content)["name"] == "get_forecast"


def test_chat_logprobs_are_the_tokens_of_the_content(live):
    """#4: no logprob for the end-of-turn token nor for a stop string's tokens: joined, they are the content."""
    eos = {str(live.tok.token_to_id("<|im_end|>")): 100}
    for extra, stop in (({"structured_outputs": {"regex": "Paris is sunny( today)?"}, "logit_bias": eos}, None),
                        ({"structured_outputs": {"regex": "Paris is sunny today"}}, ["sunny"])):
        kw = dict(model="tiny", messages=WEATHER, max_tokens=40, temperature=0, logprobs=True, top_logprobs=2,
                  stop=stop, extra_body=extra)
        r = live.client.chat.completions.create(**kw)
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content == ("Paris is " if stop else
                                                                             "Paris is sunny")
        tokens = choice.logprobs.content
        assert b"".join(bytes(t.bytes) for t in tokens) == choice.message.content.encode()
        assert r.usage.completion_tokens > len(tokens)  # the tokens left out were generated
        streamed = [t for ch in live.client.chat.completions.create(**kw, stream=True) for c in ch.choices
                    if c.logprobs for t in c.logprobs.content]
        assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in tokens]


def test_context_overflow_is_openais_context_length_exceeded(live):
    """#5: code ``context_length_exceeded`` and OpenAI's words, for a prompt and for max_tokens past the context."""
    for kw in (dict(messages=[{"role": "user", "content": "word " * 5000}], max_tokens=5),
               dict(messages=WEATHER, max_tokens=4090)):
        with pytest.raises(openai.BadRequestError) as e:
            live.client.chat.completions.create(model="tiny", **kw)
        assert e.value.code == "context_length_exceeded" and e.value.type == "invalid_request_error"
        assert e.value.body["message"].startswith("This model's maximum context length is 4096 tokens. However, ")


def test_suffix_fills_in_the_middle_with_the_vocabularys_fim_tokens(live):
    """#6: ``suffix`` is Qwen's FIM prompt built from the vocabulary, and the FIM pad token ends the middle."""
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))"
    pre, suf, mid, pad = (live.tok.token_to_id(t) for t in FIM)
    ids = [pre, *live.tok.encode(prefix, add_special_tokens=False).ids, suf,
           *live.tok.encode(suffix, add_special_tokens=False).ids, mid]
    kw = dict(model="tiny", max_tokens=6, temperature=0, logprobs=1)
    filled = live.client.completions.create(prompt=prefix, suffix=suffix, **kw)
    by_hand = live.client.completions.create(prompt=ids, **kw)
    assert filled.usage.prompt_tokens == len(ids) and filled.choices[0].text == by_hand.choices[0].text
    assert filled.choices[0].logprobs.token_logprobs == pytest.approx(by_hand.choices[0].logprobs.token_logprobs,
                                                                      abs=1e-5)
    padded = live.client.completions.create(prompt=prefix, suffix=suffix, **kw, logit_bias={str(pad): 100})
    assert padded.choices[0].finish_reason == "stop" and padded.usage.completion_tokens == 1


def test_a_function_without_parameters_is_called_with_none(live):
    """#7: no ``parameters`` means an empty closed object: even a model that would rather not close it calls with
    ``{}``."""
    r = live.client.chat.completions.create(model="tiny", messages=WEATHER, tools=[GET_TIME], tool_choice="required",
                                            max_tokens=40, temperature=0, parallel_tool_calls=False,
                                            logit_bias=_bias(live, "}", -100))
    call = r.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {})


def test_a_forced_call_cut_by_max_tokens_leaks_no_text(live):
    """#8: the call as far as it came, finish_reason "length", and no ``<tool_call>`` text in the content."""
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    for max_tokens in (2, 12):  # cut in the tag, cut in the arguments
        kw = dict(model="tiny", messages=WEATHER, tools=[tool], tool_choice="required", max_tokens=max_tokens,
                  temperature=0)
        r = live.client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None
        content, calls, finish = _streamed(live.client.chat.completions.create(**kw, stream=True))
        assert finish == "length" and content == ""
        assert calls == [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls or ()]


def test_openai_fields_that_change_nothing_are_accepted_and_those_that_would_are_refused(live):
    """#9: accepted and ignored (the same greedy answer); refused naming the field."""
    c, kw = live.client, dict(model="tiny", messages=WEATHER, max_tokens=6, temperature=0)
    plain = c.chat.completions.create(**kw).choices[0].message.content
    noop = c.chat.completions.create(**kw, service_tier="auto", prompt_cache_key="k", safety_identifier="s",
                                     store=True, metadata={"a": "b"}, user="u", verbosity="low", audio=None,
                                     modalities=["text"])
    assert noop.choices[0].message.content == plain
    text = c.completions.create(model="tiny", prompt="Hi", max_tokens=2, user="u", extra_body={"store": False})
    assert text.choices[0].finish_reason
    for field, value, words in (("prediction", {"type": "content", "content": "x"}, "Predicted Outputs"),
                                ("web_search_options", {}, "web search"),
                                ("modalities", ["text", "audio"], "text only"),
                                ("audio", {"voice": "alloy", "format": "wav"}, "audio output")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**kw, extra_body={field: value})
        assert e.value.body["param"] == field and words in e.value.body["message"]


def test_an_unknown_model_is_openais_model_not_found(live):
    """#10."""
    with pytest.raises(openai.NotFoundError) as e:
        live.client.chat.completions.create(model="gpt-4o", messages=WEATHER, max_tokens=2)
    assert (e.value.type, e.value.code, e.value.body["param"]) == ("invalid_request_error", "model_not_found", "model")


# -- the openai SDK: a round trip, echo, embeddings -----------------------------------------------------------------

def test_openai_tool_round_trip_echo_and_embeddings(live):
    c = live.client
    tool = openai.pydantic_function_tool(City, name="get_weather")
    first = c.chat.completions.create(model="tiny", messages=WEATHER, tools=[tool], tool_choice="required",
                                      max_tokens=80, temperature=0, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = [*WEATHER, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 22 degrees"}]
    answer = c.chat.completions.parse(model="tiny", messages=history, tools=[tool], response_format=Forecast,
                                      max_tokens=80, temperature=0, logit_bias=_bias(live, "<", -100))
    assert isinstance(answer.choices[0].message.parsed, Forecast)
    echoed = c.completions.create(model="tiny", prompt="The weather", max_tokens=3, temperature=0, echo=True,
                                  logprobs=1)
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith("The weather") and lp.token_logprobs[0] is None
    assert "".join(lp.tokens) == echoed.choices[0].text and all(v <= 0 for v in lp.token_logprobs[1:])
    vectors = c.embeddings.create(model="tiny", input=["sunny", "rain"]).data
    assert [len(v.embedding) for v in vectors] == [live.hidden] * 2
    assert all(abs(sum(x * x for x in v.embedding) - 1) < 1e-4 for v in vectors)


# -- the libraries --------------------------------------------------------------------------------------------------

def test_instructor_tools_and_json_schema_modes_and_create_iterable(live):
    instructor = pytest.importorskip("instructor")
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(live.client, mode=mode)
        got = client.chat.completions.create(model="tiny", messages=WEATHER, response_model=Weather, max_tokens=200,
                                             temperature=0, max_retries=0)
        assert isinstance(got, Weather)
    # a list of models: a tool whose schema is all $defs; banning "]" keeps the list going
    client = instructor.from_openai(live.client, mode=instructor.Mode.TOOLS)
    items = list(client.chat.completions.create_iterable(
        model="tiny", messages=WEATHER, response_model=City, max_tokens=80, temperature=0, max_retries=0,
        logit_bias=_bias(live, "]", -100) | _bias(live, "}", -100)))
    assert items and all(isinstance(i, City) for i in items)


def test_langchain_bind_tools_and_with_structured_output(live):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Annotated[str, Field(pattern=WORD)]) -> str:
        """The weather in a city."""
        return "sunny"

    llm = lc.ChatOpenAI(base_url=live.url, api_key="x", model="tiny", temperature=0, max_tokens=120, max_retries=0)
    named = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    assert [c["name"] for c in named.tool_calls] == ["get_weather"] and isinstance(named.tool_calls[0]["args"]["city"],
                                                                                   str)
    hermes = rf"<tool_call>\n{CALL_JSON}\n</tool_call>"
    auto = llm.bind_tools([get_weather], extra_body={"structured_outputs": {"regex": hermes}}).invoke("Weather?")
    assert [c["name"] for c in auto.tool_calls] == ["get_weather"] and auto.content == ""
    streamed = None
    for chunk in llm.bind_tools([get_weather], extra_body={"structured_outputs": {"regex": CALL_JSON}}).stream("W?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["name"] for c in streamed.tool_calls] == ["get_weather"]
    for method in ("json_schema", "function_calling"):
        assert isinstance(llm.with_structured_output(Forecast, method=method).invoke("Weather?"), Forecast)


def test_litellm_tools_response_format_and_context_window(live):
    litellm = pytest.importorskip("litellm")
    litellm.telemetry = False
    kw = dict(model="openai/tiny", api_base=live.url, api_key="x", temperature=0, max_tokens=120, num_retries=0)
    tool = openai.pydantic_function_tool(City, name="get_weather")
    r = litellm.completion(messages=WEATHER, tools=[tool], tool_choice="required", **kw)
    City.model_validate_json(r.choices[0].message.tool_calls[0].function.arguments)
    r = litellm.completion(messages=WEATHER, response_format=Forecast, **kw)
    Forecast.model_validate_json(r.choices[0].message.content)
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(messages=[{"role": "user", "content": "word " * 5000}], **kw)


def test_openai_agents_one_tool_agent_with_output_type(live):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(pattern=WORD)]) -> str:
        """The weather in a city."""
        cities.append(city)
        return "sunny, 22 degrees"

    client = openai.AsyncOpenAI(base_url=live.url, api_key="x", max_retries=0, timeout=120)
    # the first turn must call (tool_choice required, which the SDK resets after the call); banning "<" tokens then
    # takes the answer's branch of the second turn's grammar
    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=120,
                                    extra_body={"logit_bias": _bias(live, "<", -100)})
    agent = agents.Agent(name="weather", instructions="Give the forecast.", tools=[get_weather], output_type=Forecast,
                         model=agents.OpenAIChatCompletionsModel(model="tiny", openai_client=client),
                         model_settings=settings)
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert isinstance(result.final_output, Forecast) and len(cities) == 1


def test_pydantic_ai_tool_output_and_native_output(live):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput, ToolOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = openai.AsyncOpenAI(base_url=live.url, api_key="x", max_retries=0, timeout=120)
    model = OpenAIChatModel("tiny", provider=OpenAIProvider(openai_client=client))
    for output in (ToolOutput(Forecast), NativeOutput(Forecast)):
        agent = Agent(model, output_type=output, model_settings={"temperature": 0, "max_tokens": 120})
        assert isinstance(agent.run_sync("What is the weather in Paris?").output, Forecast)


# -- each family's tool-call format, picked from its template (in process) ------------------------------------------

TOOLS_HEADER = """{%- if tools %}<|im_start|>system
{{ header }}
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{{ tag }}{{ m.tool_calls | map(attribute='function') | list | tojson }}{% else %}{{ m.content }}
{%- endif %}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
FAMILIES = {  # the markers of Llama 3.1's and Mistral Nemo's templates, around the tiny model's own tokens
    "llama3": ('Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
               'value}.', "<|python_tag|>", r'<\|python_tag\|>\{"name": "get_weather", "parameters": \{"name": '
                                             r'"paris"\}\}'),
    "mistral": ("Call a function with [TOOL_CALLS].", "[TOOL_CALLS]",
                r'\[TOOL_CALLS\]get_weather\[ARGS\]\{"name": "paris"\}'),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_familys_calls_are_written_and_read_in_its_format(live, tmp_path, family):
    """#3 end to end: the template picks the format; a forced call is written in it (llama3: a bare object with
    ``parameters``; mistral: a JSON list, its tag being a special token), and its tagged form is read under auto."""
    import shutil

    import dtorch

    header, tag, written = FAMILIES[family]
    model = tmp_path / family
    shutil.copytree(live.path, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    template = TOOLS_HEADER.replace("{{ header }}", header).replace("{{ tag }}", tag)
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    tool = openai.pydantic_function_tool(City, name="get_weather")
    llm = dtorch.LLM(str(model), max_num_seqs=2)
    try:
        params = dtorch.SamplingParams(temperature=0, max_tokens=60)
        out = llm.chat(WEATHER, params, tools=[tool], tool_choice="required", parallel_tool_calls=False)[0].outputs[0]
        raw = llm.tokenizer.decode(out.token_ids)
        assert raw.startswith('{"name": "get_weather", "parameters": ' if family == "llama3" else
                              '[{"name": "get_weather", "arguments": '), raw
        assert out.text == "" and [c.name for c in out.tool_calls] == ["get_weather"]
        City.model_validate_json(out.tool_calls[0].arguments)
        regex = dtorch.StructuredOutputsParams(regex=written)
        out = llm.chat(WEATHER, dtorch.SamplingParams(temperature=0, max_tokens=60, structured_outputs=regex),
                       tools=[tool])[0].outputs[0]
        assert out.text == "" and [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather",
                                                                                      '{"name": "paris"}')]
        # a schema for the answer under auto: the reply is a call in the family's format or the answer, read apart
        answer = dtorch.StructuredOutputsParams(json=Forecast.model_json_schema())
        for seed in range(3):
            p = dtorch.SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs=answer)
            out = llm.chat(WEATHER, p, tools=[tool], parallel_tool_calls=False)[0].outputs[0]
            assert out.finish_reason == "stop"
            if out.tool_calls:
                assert out.text == "" and [c.name for c in out.tool_calls] == ["get_weather"]
                City.model_validate_json(out.tool_calls[0].arguments)
            else:
                Forecast.model_validate_json(out.text)
    finally:
        llm.close()
