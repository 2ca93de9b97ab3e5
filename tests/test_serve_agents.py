"""What agents and extraction pipelines ask of ``dtorch serve`` (issue #22), through the official ``openai`` client
against real server processes: structured outputs checked with ``jsonschema``, tool calls (required, named, auto;
streamed deltas joined equal the whole reply), a replayed tool history, reasoning split from content, logit_bias,
unknown fields refused, vLLM's tokenize/detokenize, and embeddings against transformers' hidden states.

Two servers per module: the default model (SmolLM2-135M, a real tokenizer of 49k tokens) and a tiny random Qwen3 with
a Qwen3-style template (tools and ``<think>`` blocks) on a small byte-level BPE tokenizer made here. A random model
writes no tool call or think block by itself, so the auto and reasoning tests make it write one through a regex
constraint, which the parser then reads like any other reply.
"""

from __future__ import annotations

import json
import re

import pytest
from test_serve import _get, _post, _start_server, _stop

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 20},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 20}, "utc": {"type": "boolean"}},
                                          "required": ["city", "utc"], "additionalProperties": False}}},
]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def default():
    proc, port = _start_server()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        yield client, client.models.list().data[0].id, port
    finally:
        _stop(proc)


# -- structured outputs -------------------------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "member": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "height_m", "member", "role", "address", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("temperature, n", [(0.0, 1), (1.0, 2)])
def test_json_schema_answers_validate(default, temperature, n):
    client, model, _ = default
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=150,
        temperature=temperature, seed=7, n=n,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert len(r.choices) == n
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), PERSON)


def test_json_object_and_a_schema_that_does_not_compile(default):
    client, model, _ = default
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A JSON object, please."}],
                                       max_tokens=60, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=WEATHER, max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})
    assert e.value.body["param"] == "response_format" and "strin" in e.value.body["message"]


def test_choice_and_regex_hold_over_twenty_seeds(default):
    client, model, _ = default
    choices, pattern = ["yes", "no", "maybe"], r"[0-9]{3}-[A-Z]{2}"
    for seed in (0, 10):  # choice i of n uses seed + i: seeds 0..19
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is Paris in France?"}],
                                           max_tokens=8, temperature=1.0, seed=seed, n=10,
                                           extra_body={"structured_outputs": {"choice": choices}})
        assert all(c.message.content in choices for c in r.choices), [c.message.content for c in r.choices]
        r = client.completions.create(model=model, prompt="A product code:", max_tokens=12, temperature=1.0,
                                      seed=seed, n=10, extra_body={"structured_outputs": {"regex": pattern}})
        assert all(re.fullmatch(pattern, c.text) for c in r.choices), [c.text for c in r.choices]


# -- tool calls ---------------------------------------------------------------------------------------------------

def _joined(chunks) -> tuple[str, list[tuple[str, str, str]], str]:
    """The content, (id, name, arguments) per call and the finish reason of streamed chat chunks."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        for c in ch.choices:
            d = c.delta
            content += d.content or ""
            for t in d.tool_calls or ():
                call = calls.setdefault(t.index, ["", "", ""])
                if t.id:
                    assert not call[0], "the id comes once"
                    call[0], call[1] = t.id, t.function.name
                else:
                    assert call[0], "the id and name come before the arguments"
                call[2] += t.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [tuple(c) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_tool_calls_streamed_and_not(default, choice):
    client, model, _ = default
    kw = dict(model=model, messages=WEATHER, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=80,
              parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls and not msg.content
    call = msg.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    content, calls, finish = _joined(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and not content
    assert [(name, args) for _, name, args in calls] == [(c.function.name, c.function.arguments)
                                                        for c in msg.tool_calls]


def test_a_replayed_tool_history_gets_an_answer(default):
    client, model, _ = default
    history = WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees, sunny"}]
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, temperature=0, max_tokens=12)
    assert r.choices[0].message.content or r.choices[0].message.tool_calls


# -- nothing dropped ----------------------------------------------------------------------------------------------

def test_logit_bias_changes_the_greedy_token(default):
    client, model, port = default
    kw = dict(model=model, prompt="The capital of France is", max_tokens=1, temperature=0, logprobs=5)
    top = client.completions.create(**kw).choices[0].logprobs
    first = top.tokens[0]

    def token_id(text: str) -> int | None:
        ids = _post(port, "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})[1]["tokens"]
        return ids[0] if len(ids) == 1 else None

    other = next(t for t in top.top_logprobs[0] if t != first and token_id(t) is not None)
    banned = client.completions.create(**kw, logit_bias={str(token_id(first)): -100}).choices[0].logprobs.tokens[0]
    assert banned != first
    forced = client.completions.create(**kw, logit_bias={str(token_id(other)): 100}).choices[0].logprobs.tokens[0]
    assert forced == other


def test_unknown_fields_and_roles_are_refused(default):
    client, model, port = default
    status, r = _post(port, "/v1/chat/completions", {"model": model, "messages": WEATHER, "max_token": 3})
    assert status == 400 and r["error"]["param"] == "max_token"
    assert r["error"]["message"] == "Unrecognized request argument supplied: max_token"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "hi"}], max_tokens=2)
    assert e.value.body["param"] == "messages" and "wizard" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=WEATHER, tools=TOOLS, max_tokens=2,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"


def test_echo_tokenize_detokenize_and_the_model_card(default):
    client, model, port = default
    assert client.models.retrieve(model).id == model
    assert _get(port, "/v1/models/nope")[0] == 404
    status, t = _post(port, "/tokenize", {"model": model, "prompt": "Hello world", "return_token_strs": True})
    assert status == 200 and t["count"] == len(t["tokens"]) == len(t["token_strs"]) and t["max_model_len"] > 0
    assert _post(port, "/detokenize", {"model": model, "tokens": t["tokens"]})[1] == {"prompt": "Hello world"}
    status, chat = _post(port, "/tokenize", {"model": model, "messages": WEATHER})
    assert status == 200 and chat["count"] > t["count"]
    plain = client.completions.create(model=model, prompt="Hello world", max_tokens=3, temperature=0, logprobs=1)
    echoed = client.completions.create(model=model, prompt="Hello world", max_tokens=3, temperature=0, logprobs=1,
                                       echo=True)
    c = echoed.choices[0]
    assert c.text == "Hello world" + plain.choices[0].text
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == t["count"] + 3
    assert c.logprobs.token_logprobs[t["count"]:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert all(v <= 0 for v in c.logprobs.token_logprobs[1:])
    # max_tokens 0 scores the prompt, as OpenAI's: the echo and its logprobs, nothing generated, streamed or not
    scored = client.completions.create(model=model, prompt="Hello world", max_tokens=0, logprobs=1, echo=True)
    s = scored.choices[0]
    assert s.text == "Hello world" and s.finish_reason == "length"
    assert s.logprobs.tokens == c.logprobs.tokens[:t["count"]]
    assert s.logprobs.token_logprobs == pytest.approx(c.logprobs.token_logprobs[:t["count"]], abs=1e-4)
    assert scored.usage.prompt_tokens == t["count"] and scored.usage.completion_tokens == 0
    chunks = list(client.completions.create(model=model, prompt="Hello world", max_tokens=0, echo=True, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "Hello world"
    assert chunks[-1].usage.completion_tokens == 0
    assert client.completions.create(model=model, prompt="Hello world", max_tokens=0).choices[0].text == ""
    r = client.chat.completions.create(
        model=model, temperature=0, max_tokens=4,
        messages=WEATHER + [{"role": "assistant", "content": "The weather in Paris is"}],
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "echo": True})
    assert r.choices[0].message.content.startswith("The weather in Paris is")


# -- a tiny Qwen3 with a tool- and thinking-aware template --------------------------------------------------------

TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

Call a function with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}
{%- endif %}"""


def make_tiny_chat_model(path, extra_tokens=(), positions=1024):
    """A random 2-layer Qwen3 in ``path`` with a byte-level BPE tokenizer trained here and TEMPLATE (and
    ``extra_tokens`` added to its vocabulary); returns the transformers model."""
    import transformers
    from tiny_models import families, save_random
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ['{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
              "What is the weather in Paris? It is sunny and warm today in the city.", TEMPLATE] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        special_tokens=["<|im_start|>", "<|im_end|>"]))
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                    *extra_tokens])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": TEMPLATE}))
    vocab = -(-tok.get_vocab_size() // 64) * 64  # a padded embedding, as real models have
    config = families(transformers, 4, 2, vocab, 16, max_position_embeddings=positions, bos_token_id=None,
                      eos_token_id=eos)["qwen3"]()
    return save_random(transformers, config, path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    hf = make_tiny_chat_model(path)
    proc, port = _start_server("--model", str(path), "--served-model-name", "tiny", "--max-num-batched-tokens", "256")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        yield client, hf, path, port
    finally:
        _stop(proc)


CALL = (r'Checking\.<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
        r'"unit": "celsius"\}\}\n</tool_call>')


def test_auto_tool_calls_are_parsed_from_hermes_tags_streamed_and_not(tiny):
    client = tiny[0]
    kw = dict(model="tiny", messages=WEATHER, tools=TOOLS, temperature=0, max_tokens=200,
              extra_body={"structured_outputs": {"regex": CALL}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Checking."
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    assert json.loads(msg.tool_calls[0].function.arguments)["unit"] == "celsius"
    content, calls, finish = _joined(client.chat.completions.create(**kw, stream=True))
    assert (content, finish) == ("Checking.", "tool_calls")
    assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    # the template got the tools: the prompt is longer with them
    with_tools = _post(tiny[3], "/tokenize", {"messages": WEATHER, "tools": TOOLS})[1]["count"]
    assert with_tools > _post(tiny[3], "/tokenize", {"messages": WEATHER})[1]["count"] + 50


THINK = r"<think>[a-z ]{1,12}</think>\n\n[a-z ]{1,8}"


def test_reasoning_is_split_streamed_and_not(tiny):
    client, port = tiny[0], tiny[3]
    kw = dict(model="tiny", messages=WEATHER, temperature=0, max_tokens=100,
              extra_body={"structured_outputs": {"regex": THINK}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and msg.content and "<think>" not in msg.content + reasoning and "</think>" not in msg.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks
                       if c.choices)
    assert streamed == reasoning
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    # enable_thinking: false reaches the template, which closes the think block in the prompt
    on = _post(port, "/tokenize", {"messages": WEATHER, "return_token_strs": True})[1]
    off = _post(port, "/tokenize", {"messages": WEATHER, "chat_template_kwargs": {"enable_thinking": False},
                                    "return_token_strs": True})[1]
    assert "</think>" in off["token_strs"] and "</think>" not in on["token_strs"]


def test_embeddings_equal_transformers_hidden_states(tiny):
    import torch

    client, hf = tiny[0], tiny[1]
    texts = ["What is the weather in Paris?", "sunny"]
    got = client.embeddings.create(model="tiny", input=texts)  # the client asks for base64
    as_floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    ids = [_post(tiny[3], "/tokenize", {"prompt": t})[1]["tokens"] for t in texts]
    assert got.usage.prompt_tokens == sum(map(len, ids))
    for i, t in enumerate(ids):
        with torch.no_grad():
            h = hf.model(torch.tensor([t])).last_hidden_state[0]  # [T, H]
        want = torch.nn.functional.normalize(h[-1], dim=0)
        assert torch.allclose(torch.tensor(got.data[i].embedding), want, atol=1e-4)
        assert torch.allclose(torch.tensor(as_floats.data[i].embedding), want, atol=1e-4)


def test_llm_embed_mean_and_chat_tools_from_python(tiny):
    import torch

    import dtorch

    hf, path = tiny[1], tiny[2]
    llm = dtorch.LLM(str(path), max_num_seqs=4, max_num_batched_tokens=16)  # the long text in chunks
    try:
        texts = ["What is the weather in Paris? " * 6, "sunny today"]
        got = llm.embed(texts, pooling="mean")
        for i, text in enumerate(texts):
            with torch.no_grad():
                h = hf.model(torch.tensor([llm.tokenizer.encode(text)])).last_hidden_state[0]
            assert torch.allclose(got[i], torch.nn.functional.normalize(h.mean(0), dim=0), atol=1e-4)
        out = llm.chat(WEATHER, dtorch.SamplingParams(temperature=0, max_tokens=300), tools=TOOLS,
                       tool_choice="required", parallel_tool_calls=False)[0].outputs[0]
        assert out.text == "" and len(out.tool_calls) == 1 and out.finish_reason == "stop"
        call = out.tool_calls[0]
        jsonschema.validate(json.loads(call.arguments),
                            next(t for t in TOOLS if t["function"]["name"] == call.name)["function"]["parameters"])
        so = dtorch.StructuredOutputsParams(regex=THINK)
        out = llm.chat(WEATHER, dtorch.SamplingParams(temperature=0, max_tokens=100,
                                                     structured_outputs=so))[0].outputs[0]
        assert out.reasoning_content and out.text and "<think>" not in out.text
    finally:
        llm.close()
