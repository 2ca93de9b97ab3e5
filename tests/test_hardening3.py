"""Issue #43 (hardening, round 3): a request's bad numbers are its own 400 and a failure while sampling ends only
its own request; the kernel registry checks its ABI at the call; the server's own paths and exception text never
reach clients; the inputs that answered 500 are 400s naming the field."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch

import dtorch
from dtorch.engine.llm import LLM
from dtorch.engine.sampling import SamplingParams, sample_step
from tests.test_engine import FAMILIES, greedy, rand_ids
from tests.test_serve import FakeLLM, FakeLoop
from tests.tiny_models import hf_greedy, save_random

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, checkpoint directory) of a tiny random Qwen3."""
    path = tmp_path_factory.mktemp("qwen3")
    return save_random(transformers, FAMILIES["qwen3"](), path), str(path)


# --- item 2: bad sampling numbers -----------------------------------------------------------------------------------

@pytest.mark.parametrize("penalty", [1e-300, 1e-40, 1e-5, 1e5, 1e300])
def test_repetition_penalties_past_float32_are_refused(penalty):
    with pytest.raises(dtorch.SamplingError, match="repetition_penalty must be in"):
        SamplingParams(repetition_penalty=penalty)


@pytest.mark.parametrize("temperature", [3.5e38, 1e300])
def test_a_temperature_past_float32s_range_is_refused(temperature):
    """float32 holds it as inf: a banned token's -inf / inf is NaN, and the sampler failed on it."""
    with pytest.raises(dtorch.SamplingError, match=r"temperature must be in \[0, 3.403e\+38\]"):
        SamplingParams(temperature=temperature)
    p = SamplingParams(temperature=3.4e38, seed=0, min_tokens=2)  # the largest is uniform over what is allowed
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)) * 5
    drawn = {sample_step(logits, [p], [p.generator(i)], [()], [()], banned=[[3, 4]])[0][0] for i in range(200)}
    assert 3 not in drawn and 4 not in drawn and len(drawn) > 30


def test_a_top_p_under_float32s_range_keeps_the_most_likely_token():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) * 5
    for top_p in (1e-300, 1e-45):
        p = SamplingParams(temperature=1.0, top_p=top_p, seed=0)
        tokens, _ = sample_step(logits, [p] * 2, [p.generator()] * 2, [()] * 2, [()] * 2)
        assert tokens == logits.argmax(-1).tolist()  # the top-p set of a tiny p is the argmax alone


def test_a_row_whose_sampling_fails_ends_alone(tiny):
    hf, path = tiny
    llm = LLM(path)
    try:
        e, good, bad = llm.engine, [], []
        poisoned = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=1)
        object.__setattr__(poisoned, "repetition_penalty", 1e-300)  # past the checks: the sampler meets NaN
        prompt = rand_ids(8, 12)
        e.add_request("bad", rand_ids(8, 13), poisoned, bad.append)
        e.add_request("good", prompt, greedy(12), lambda d: good.extend(d.token_ids))
        e.run_until(lambda: not e.has_unfinished(), timeout=60)
        assert good == hf_greedy(hf, prompt, 12)  # the batch went on without it
        assert bad[-1].finish_reason == "abort" and not any(d.token_ids for d in bad)
        assert e.stats().kv_blocks_used == 0
        again = []  # and the engine is whole afterwards
        e.add_request("again", prompt, greedy(12), lambda d: again.extend(d.token_ids))
        e.run_until(lambda: not e.has_unfinished(), timeout=60)
        assert again == good
    finally:
        llm.close()



@pytest.mark.parametrize("speculative", [False, True])
def test_a_row_whose_token_cannot_be_taken_ends_alone(tiny, monkeypatch, speculative):
    """A failure after sampling (its text, its grammar's state: here its delta) ends that request alone."""
    from dtorch.engine.engine import Engine
    from dtorch.engine.speculative import Adaptive

    emit = Engine._emit

    def failing(self, s, tokens, text, logprobs):
        if s.request_id == "bad" and tokens and len(s.output_ids) > 1:
            raise RuntimeError("the fault of one request")
        emit(self, s, tokens, text, logprobs)

    monkeypatch.setattr(Engine, "_emit", failing)
    monkeypatch.setattr(Adaptive, "want", lambda self, k_max, cost: k_max)
    hf, path = tiny
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 2} if speculative else None
    llm = LLM(path, speculative_config=spec)
    try:
        e, good, bad = llm.engine, [], []
        prompt = rand_ids(8, 12)
        e.add_request("bad", rand_ids(8, 13), greedy(12), bad.append)
        e.add_request("good", prompt, greedy(12), lambda d: good.extend(d.token_ids))
        e.run_until(lambda: not e.has_unfinished(), timeout=60)
        assert good == hf_greedy(hf, prompt, 12)
        assert bad[-1].finish_reason == "abort" and e.stats().kv_blocks_used == 0
    finally:
        llm.close()


def test_a_row_whose_verification_fails_ends_alone(tiny, monkeypatch):
    """Speculative decoding (the model drafting for itself, drafts every step): a row whose draft or verification
    fails (its repetition penalty turned NaN-making after its first token) ends alone; the batch goes on."""
    from dtorch.engine.speculative import Adaptive

    monkeypatch.setattr(Adaptive, "want", lambda self, k_max, cost: k_max)  # always draft
    hf, path = tiny
    llm = LLM(path, speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    try:
        e, good, bad = llm.engine, [], []
        poisoned = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=1)

        def poison(d):  # from its second token on, past the checks: the sampler meets NaN
            bad.append(d)
            object.__setattr__(poisoned, "repetition_penalty", 1e-300)

        prompt = rand_ids(8, 12)
        e.add_request("bad", [1, 2, 3] * 4, poisoned, poison)
        e.add_request("good", prompt, greedy(12), lambda d: good.extend(d.token_ids))
        e.run_until(lambda: not e.has_unfinished(), timeout=60)
        assert llm.engine.speculator.drafted > 0
        assert good == hf_greedy(hf, prompt, 12)  # the batch went on without it
        assert bad[-1].finish_reason == "abort" and sum(len(d.token_ids) for d in bad) < 20
        assert e.stats().kv_blocks_used == 0
    finally:
        llm.close()


# --- item 13: the kernel registry's ABI -----------------------------------------------------------------------------

EXP = dtorch.KernelKey("unary.exp", "cpu", torch.float32)


def _resizes(ctx, inputs, outputs):
    outputs[0].resize_(2, 2).fill_(1.0)


def _returns(ctx, inputs, outputs):
    return torch.exp(inputs[0])


def _writes_its_input(ctx, inputs, outputs):
    torch.exp(inputs[0], out=outputs[0])
    inputs[0].zero_()


@contextlib.contextmanager
def _plugged(fn):
    dtorch.dispatcher.register(EXP, fn, provider="user")
    try:
        yield
    finally:
        dtorch.dispatcher.unregister(EXP, "user")


@pytest.mark.parametrize("fn, words", [(_resizes, r"changed output 0 from \[8\] torch.float32 to \[2, 2\]"),
                                       (_returns, "returned a Tensor")])
def test_a_kernel_that_breaks_the_abi_is_named_at_the_call(fn, words):
    x = torch.randn(8)
    with _plugged(fn):
        with pytest.raises(dtorch.KernelFailure, match=f"unary.exp: kernel user:.*{fn.__name__}.* {words}"):
            dtorch.ops.exp(x)  # the functional path: a candidate's first call checks it
        with pytest.raises(dtorch.KernelFailure, match=words):  # a prepared kernel: its first call after binding
            dtorch.dispatch.PreparedKernel(dtorch.dispatcher, EXP)(None, (x,), (torch.empty(8),))
        with dtorch.verify(), pytest.raises(dtorch.KernelFailure, match=words):
            dtorch.ops.exp(x)
    torch.testing.assert_close(dtorch.ops.exp(x), torch.exp(x))  # the built-in kernels keep the ABI


def test_a_kernel_that_returns_is_caught_on_every_call_not_only_its_first():
    calls = []

    def sometimes(ctx, inputs, outputs):
        torch.exp(inputs[0], out=outputs[0])
        calls.append(1)
        return outputs[0] if len(calls) == 1 else outputs[0].clone()  # its output itself keeps the ABI

    with _plugged(sometimes):
        dtorch.ops.exp(torch.randn(4))
        with pytest.raises(dtorch.KernelFailure, match="returned a Tensor"):
            dtorch.ops.exp(torch.randn(4))


def test_verify_finds_a_kernel_that_writes_into_its_input():
    x = torch.randn(8)
    with _plugged(_writes_its_input), dtorch.verify(), pytest.raises(dtorch.KernelFailure,
                                                                       match="wrote into input 0 "):
        dtorch.ops.exp(x)
    y = torch.randn(8)  # an in-place call (the output is the input) is no such write
    want = torch.exp(y)
    with dtorch.verify():
        dtorch.ops.exp_out(y, out=y)
    torch.testing.assert_close(y, want)


@pytest.mark.parametrize("priority", [math.nan, math.inf, -math.inf, 1.5, "7"])
def test_a_priority_that_is_not_a_whole_number_is_a_registration_error(priority):
    with pytest.raises(dtorch.RegistrationError, match="priority must be a whole number"):
        dtorch.dispatcher.register(EXP, _resizes, provider="user", priority=priority)
    with pytest.raises(dtorch.RegistrationError, match="priority must be a whole number"):
        dtorch.dispatch.KernelSet().add("unary.exp", _resizes, [torch.float32], priority=priority)
    assert all(c.provider != "user" for c in dtorch.dispatcher.candidates(EXP))


# --- item 10: the server's own paths never reach clients; item 11: a 500 carries no exception text -----------------

SECRET = "/srv/secret-models/qwen-7b"


class _PathLLM(FakeLLM):
    """test_serve's fake model, loaded from SECRET: a chat renders a template that passes its bound (turn "bound")
    or finds no template (turn "none"); "boom" fails inside the server."""

    source = f"{SECRET}/model.gguf"

    def __init__(self) -> None:
        super().__init__()
        self.tokenizer.source = f"{SECRET}/tokenizer.json"
        self.tokenizer.template_source = f"{SECRET}/chat_template.jinja"

    def chat_setup(self, messages, **options):
        from dtorch.models import chat_template

        text = messages[-1]["content"]
        if text == "none":
            raise dtorch.ModelError(f"{self.tokenizer.source}: the model has no chat template; pass a raw prompt")
        if text == "bound":
            loops = "{% for i in range(99999) %}{% for j in range(99999) %}xxxxxxxx{% endfor %}{% endfor %}"
            chat_template.render(loops, self.tokenizer.template_source, {})
        raise RuntimeError(f"boom in {SECRET}/internal.py, line 3")


@pytest.fixture(scope="module")
def secret_client():
    from fastapi.testclient import TestClient

    from dtorch.serve import build_app

    llm = _PathLLM()
    loop = FakeLoop(llm.engine)  # the caller starts the loop it passes; the app stops it
    loop.start()
    with TestClient(build_app(llm, "qwen", engine_loop=loop, log_interval=0),
                    raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("turn, status, words", [("none", 400, "qwen: the model has no chat template"),
                                                 ("bound", 400, "qwen: the chat template went past a bound"),
                                                 ("boom", 500, "its log has the details")])
def test_errors_name_the_model_never_the_servers_files(secret_client, turn, status, words):
    r = secret_client.post("/v1/chat/completions", json={"model": "qwen",
                                                         "messages": [{"role": "user", "content": turn}]})
    assert r.status_code == status and words in r.json()["error"]["message"], r.text
    assert "secret" not in r.text and "boom" not in r.text and "RuntimeError" not in r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}  # OpenAI's shape


# --- item 11: 400s naming the field where a 500 was ---

@pytest.mark.parametrize("key", ["²", "1" + "0" * 4999, "١٢", "１２", "01", "-1", " 1", "1.0"])
def test_a_logit_bias_key_that_is_not_plain_decimal_is_a_400(secret_client, key):
    r = secret_client.post("/v1/completions", json={"model": "qwen", "prompt": "hi", "logit_bias": {key: 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert "plain decimal" in r.json()["error"]["message"] and len(r.text) < 1000


@pytest.mark.parametrize("name", ["limit", "allow_special_tokens", "continue_final_message", "self"])
def test_chat_template_kwargs_may_not_take_the_renderers_own_names(name):
    from dtorch.engine.chat_format import prepare_chat

    with pytest.raises(dtorch.ArgumentError, match=f"chat_template_kwargs: '{name}' is set by the request") as e:
        prepare_chat(None, [{"role": "user", "content": "hi"}], chat_template_kwargs={name: 1})
    assert e.value.param == "chat_template_kwargs"


@pytest.mark.parametrize("field, value", [("chat_template_kwargs", {"x": "["}), ("tools", "["), ("messages", "[")])
def test_template_inputs_nested_past_the_bound_are_a_400(field, value):
    """A chat_template_kwargs value 900 lists deep recursed past Python's stack in the template's escaping: a 500
    whose 200 KB traceback filled the log."""
    from dtorch.engine.chat_format import MAX_TEMPLATE_DEPTH, prepare_chat

    def deep(n: int):
        return json.loads("[" * n + "]" * n)

    kw = {"messages": [{"role": "user", "content": "hi"}]}
    for n in (MAX_TEMPLATE_DEPTH + 1, 900):
        if field == "chat_template_kwargs":
            kw[field] = {"x": deep(n)}
        elif field == "tools":
            kw[field] = [{"type": "function", "function": {"name": "f", "x": deep(n)}}]
        else:
            kw[field] = [{"role": "user", "content": "hi", "x": deep(n)}]
        with pytest.raises(dtorch.ArgumentError, match=f"nests deeper than {MAX_TEMPLATE_DEPTH} levels") as e:
            prepare_chat(None, **kw)
        assert e.value.param == field


def test_a_schema_nested_past_the_bound_is_a_sampling_error():
    """A structured_outputs.json text nested 100,000 deep was a RecursionError (a 500), a dict 5000 deep too."""
    from dtorch.engine.grammar_bounds import MAX_SCHEMA_DEPTH
    from dtorch.engine.structured import StructuredOutputsParams as S

    deep_dict: dict = {"type": "integer"}
    for _ in range(5000):
        deep_dict = {"type": "array", "items": deep_dict}
    for schema in ("[" * 100_000 + "]" * 100_000, deep_dict, json.loads("[" * 300 + "]" * 300)):
        with pytest.raises(dtorch.SamplingError, match=f"json nests deeper than {MAX_SCHEMA_DEPTH} levels"):
            S(json=schema)
    assert S(json={"type": "array", "items": {"type": "array", "items": {}}}).key  # a shallow one passes


def test_a_logged_traceback_keeps_its_innermost_frames_only():
    """A request that fails deep in a recursion logs a few KB (serve's formatter), the exception line included."""
    import io
    import logging

    from dtorch.serve.logs import MAX_LOGGED_TRACEBACK, BriefFormatter

    def down(n: int) -> list:  # two frames a level, as the escaping of a deep template input (no line repeats)
        return [down(n + 1) for _ in (1,)]

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(BriefFormatter("%(message)s"))
    log = logging.getLogger("dtorch.test.brief")
    log.addHandler(handler)
    log.propagate = False
    try:
        try:
            down(0)
        except RecursionError as exc:
            log.error("request failed", exc_info=exc)
    finally:
        log.removeHandler(handler)
    text = out.getvalue()
    assert len(text) < MAX_LOGGED_TRACEBACK + 100 and 0 < text.count(", in down") <= 40
    assert text.startswith("request failed") and "RecursionError: maximum recursion depth exceeded" in text


def test_boolean_schemas_and_lone_surrogates_are_sampling_errors():
    from dtorch.engine.structured import StructuredOutputsParams as S

    assert S(json=True).json == {}  # every value matches true: the schema {}
    assert "json_schema" in S(json=True).grammar_text()
    for kw, words in [(dict(json=False), "the schema false"), (dict(regex="a\ud800"), "regex has a lone surrogate"),
                      (dict(choice=["x", "\udfff"]), "choice has a lone surrogate"),
                      (dict(grammar="start: \"\ud800\""), "grammar has a lone surrogate")]:
        with pytest.raises(dtorch.SamplingError, match=words):
            S(**kw)


# --- item 12: a schema no value matches ---

@pytest.fixture(scope="module")
def grammars():
    """The default model's grammar compiler (llguidance over its tokenizer)."""
    pytest.importorskip("llguidance")
    llm = LLM(max_num_seqs=1, max_model_len=64, kv_cache_memory_bytes=8 << 20)
    yield llm.engine.grammars
    llm.close()


@pytest.mark.parametrize("schema", [{"$ref": "#"}, {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                                    "$ref": "#/$defs/a"}])
def test_a_schema_that_refers_only_to_itself_is_refused(grammars, schema):
    from dtorch.engine.structured import StructuredOutputsParams as S

    with pytest.raises(dtorch.SamplingError, match="no JSON value matches the schema"):
        grammars.matcher(S(json=schema, strict=True))
    assert grammars.matcher(S(json={"type": "object", "properties": {"a": {"type": "integer"}}}))  # a real one


@pytest.mark.parametrize("schema", [{"type": "number", "minimum": -1e30, "maximum": 1e30},
                                    {"type": "integer", "minimum": -1e30, "maximum": 1e30},
                                    {"type": "string", "maxLength": 1e30}])
def test_schema_bounds_past_any_value_are_sampling_errors(grammars, schema):
    from dtorch.engine.structured import StructuredOutputsParams as S

    with pytest.raises(dtorch.SamplingError, match="the grammar does not compile"):  # the server's 400 (compile)
        grammars.matcher(S(json=schema))

@pytest.mark.parametrize("levels", [70, 100_000])
def test_deeply_nested_tool_call_arguments_in_a_history_are_a_400(levels):
    from dtorch.engine.chat_format import MAX_ARGUMENT_DEPTH, check_messages

    def history(args: str) -> list[dict]:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
        return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]

    with pytest.raises(dtorch.ArgumentError, match=f"arguments nests deeper than {MAX_ARGUMENT_DEPTH}") as e:
        check_messages(history("[" * levels + "]" * levels))
    assert e.value.param == "messages"
    shallow = '{"a": ' * 10 + "1" + "}" * 10
    assert check_messages(history(shallow))[1]["tool_calls"][0]["function"]["arguments"] == json.loads(shallow)
