"""``dtorch serve``: the OpenAI-compatible HTTP server.

Part 1 drives the app over a fake engine that keeps the engine's contract (add_request / abort / stats, deltas
through a sink on another thread), served by uvicorn on a thread: the HTTP layer's faults (503, 400, 500, abort on
hang-up). Part 2 starts real ``python -m dtorch serve`` processes on the default model and drives them with the
official ``openai`` client. Everything listens on 127.0.0.1 only; every wait is bounded.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from dtorch.core.errors import ArgumentError, EngineBusy, ModelError
from dtorch.engine.request import Delta, TokenLogprob


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def _post(port: int, path: str, body, timeout: float = 30) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        return r.status, json.loads(raw) if raw else {}
    finally:
        conn.close()


def _get(port: int, path: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


# -- part 1: a fake engine ---------------------------------------------------------------------------------------

class FakeTokenizer:
    """One token per character: id = ord(c)."""

    chat_template = "fake"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def id_to_token(self, token_id: int) -> str:
        return chr(token_id)

    def token_to_id(self, token: str) -> int | None:
        return ord(token) if len(token) == 1 else None

    def token_bytes(self, token_id: int) -> bytes:
        return chr(token_id).encode()

    def min_tokens(self, text: str) -> int:
        return len(text)


class FakeEngine:
    """Each step gives every unfinished choice one token "a" (+ its index); a prompt with "forever" in it never
    ends by itself. ``busy`` / ``fail``: add_request raises EngineBusy / RuntimeError."""

    MAX_LEN = 64
    speculator = None  # no speculative decoding

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.busy = self.fail = False
        self.generated = 0

    def add_request(self, request_id, prompt_token_ids, params, sink) -> None:
        if self.fail:
            raise RuntimeError("the fake engine broke")
        if self.busy:
            raise EngineBusy("the engine's queue is full (0 requests waiting); try again later")
        ids = list(prompt_token_ids)
        if not ids or any(not isinstance(t, int) or t < 0 for t in ids):
            raise ArgumentError(f"{request_id}: the prompt has a bad token id")
        if len(ids) >= self.MAX_LEN:
            raise ModelError(f"{request_id}: the prompt has {len(ids)} tokens, but the context is {self.MAX_LEN}")
        with self.lock:
            self.active[request_id] = dict(params=params, sink=sink, prompt=len(ids), done=[None] * params.n,
                                           count=[0] * params.n, abort=False,
                                           endless="forever" in "".join(chr(t) for t in ids))

    def check_prompt(self, ids, what: str) -> list[int]:
        ids = list(ids)
        if not ids or any(not isinstance(t, int) or t < 0 for t in ids):
            raise ArgumentError(f"{what} has a bad token id")
        self.check_length(len(ids), what)
        return ids

    def check_length(self, tokens: int, what: str, at_least: bool = False) -> None:
        if tokens >= self.MAX_LEN:
            raise ModelError(f"{what} has {tokens} tokens, but the context is {self.MAX_LEN}")

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.aborted.append(request_id)
            if request_id in self.active:
                self.active[request_id]["abort"] = True

    def step(self) -> None:
        with self.lock:
            items = list(self.active.items())
        for rid, r in items:
            p = r["params"]
            for i in range(p.n):
                if r["done"][i]:
                    continue
                if r["abort"]:
                    r["done"][i] = "abort"
                    r["sink"](Delta(rid, i, (), "", None if p.logprobs is None else (), "abort", r["prompt"],
                                    r["count"][i]))
                    continue
                t = ord("a") + i
                r["count"][i] += 1
                self.generated += 1
                if not r["endless"] and r["count"][i] >= (p.max_tokens or 8):
                    r["done"][i] = "length"
                top = ((t, -0.25), (t + 1, -2.0))[:p.logprobs or 0]
                lps = None if p.logprobs is None else (TokenLogprob(t, -0.25, top),)
                r["sink"](Delta(rid, i, (t,), chr(t), lps, r["done"][i], r["prompt"], r["count"][i]))
            if all(r["done"]):
                with self.lock:
                    self.active.pop(rid, None)

    def stats(self):
        with self.lock:
            running = len(self.active)
        return SimpleNamespace(running=running, waiting=0, kv_usage=running / 10, prompt_tokens=0,
                               generation_tokens=self.generated, preemptions=0)


class FakeLoop:
    """EngineLoop's contract over the fake engine: a thread stepping it every few ms."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine, self.stopped = engine, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            self.engine.step()
            time.sleep(0.005)

    def stop(self, grace: float) -> None:
        self.stopped.set()
        self.thread.join(5)


class FakeLLM:
    source, max_len = "fake.gguf", FakeEngine.MAX_LEN

    def __init__(self) -> None:
        self.tokenizer, self.engine = FakeTokenizer(), FakeEngine()

    def chat_setup(self, messages, **options):
        from dtorch.engine.chat_format import ChatSetup

        if any(m["role"] not in ("system", "user", "assistant") for m in messages):
            raise ArgumentError("apply_chat_template: the model's template rejected the messages: bad role")
        return ChatSetup(self.tokenizer.encode("".join(f"{m['role']}: {m.get('content', '')}\n" for m in messages)))


@pytest.fixture(scope="module")
def fake():
    import uvicorn

    from dtorch.serve import build_app

    llm = FakeLLM()
    port = _free_port()
    loop = FakeLoop(llm.engine)  # the caller runs the loop it passes; the app stops it at shutdown
    loop.start()
    server = uvicorn.Server(uvicorn.Config(build_app(llm, "fake", engine_loop=loop),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait(lambda: server.started, 20, "the fake server to start")
    yield SimpleNamespace(port=port, engine=llm.engine)
    server.should_exit = True
    thread.join(10)


def _chat(content: str = "hi", **kw) -> dict:
    return {"model": "fake", "messages": [{"role": "user", "content": content}], **kw}


def test_fake_chat_and_completion_shapes(fake):
    status, r = _post(fake.port, "/v1/chat/completions", _chat(max_tokens=3, n=2, logprobs=True, top_logprobs=1))
    assert status == 200, r
    assert [c["message"]["content"] for c in r["choices"]] == ["aaa", "bbb"]
    assert [c["finish_reason"] for c in r["choices"]] == ["length", "length"]
    assert r["usage"]["completion_tokens"] == 6 and r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + 6
    assert r["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == [{"token": "a", "logprob": -0.25,
                                                                          "bytes": [97]}]
    # two prompts x n=2: choice index = prompt * n + i
    status, r = _post(fake.port, "/v1/completions", {"prompt": ["x", [65, 66]], "n": 2, "max_tokens": 2,
                                                     "logprobs": 2})
    assert status == 200, r
    assert [c["text"] for c in r["choices"]] == ["aa", "bb", "aa", "bb"]
    assert r["usage"]["prompt_tokens"] == 3
    lp = r["choices"][1]["logprobs"]
    assert lp["tokens"] == ["b", "b"] and lp["text_offset"] == [0, 1] and lp["top_logprobs"][0] == {"b": -0.25,
                                                                                                      "c": -2.0}


def test_fake_busy_engine_is_503(fake):
    fake.engine.busy = True
    try:
        status, r = _post(fake.port, "/v1/chat/completions", _chat())
    finally:
        fake.engine.busy = False
    assert status == 503 and "queue is full" in r["error"]["message"]


@pytest.mark.parametrize("body, param", [
    (_chat(temperature=-1), "temperature"),
    (_chat(max_tokens=0), "max_tokens"),
    (_chat(n=0), "n"),
    (_chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    (_chat(top_logprobs=2), "top_logprobs"),  # without logprobs: true
    ({"model": "fake"}, "messages"),
    ({"model": "fake", "messages": [{"content": "no role"}]}, "messages"),
    (_chat(stop=["a", ""]), "stop"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "unknown_field": 1}, "unknown_field"),
    (_chat(max_token=3), "max_token"),
    (_chat(stream_options={"include_usage": True}), "stream_options"),  # without stream: true
    (_chat(logit_bias={"a": 1}), "logit_bias"),
    ({"model": "fake", "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
])
def test_fake_bad_request_is_400_naming_the_field(fake, body, param):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    status, r = _post(fake.port, path, body)
    assert status == 400, r
    assert r["error"]["type"] == "invalid_request_error" and r["error"]["param"] == param, r
    assert set(r["error"]) == {"message", "type", "param", "code"}


def test_fake_engine_and_tokenizer_errors_are_400(fake):
    # the template rejects a role (ArgumentError), the prompt is too long (ModelError), a token id is bad
    status, r = _post(fake.port, "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x",
                                                                        "tool_call_id": "c"}]})
    assert status == 400 and r["error"]["param"] == "messages" and "bad role" in r["error"]["message"]
    status, r = _post(fake.port, "/v1/completions", {"prompt": "x" * 100})
    assert status == 400 and r["error"]["param"] == "prompt" and "context" in r["error"]["message"]
    status, r = _post(fake.port, "/v1/completions", {"prompt": [1, -3]})
    assert status == 400 and r["error"]["param"] == "prompt"
    # a prompt that fits, but not with the tokens max_tokens asks for
    status, r = _post(fake.port, "/v1/completions", {"prompt": [1] * 10, "max_tokens": FakeEngine.MAX_LEN - 9})
    assert status == 400 and r["error"]["param"] == "max_tokens" and "context" in r["error"]["message"]
    # a value only SamplingParams rejects (infinity passes pydantic's > 0) names its field too
    status, r = _post(fake.port, "/v1/completions", b'{"prompt": "x", "repetition_penalty": Infinity}')
    assert status == 400 and r["error"]["param"] == "repetition_penalty", r
    status, r = _post(fake.port, "/v1/completions", b'{"prompt": ')
    assert status == 400 and r["error"]["type"] == "invalid_request_error"


def test_fake_unknown_model_is_404_and_a_crash_is_500(fake):
    status, r = _post(fake.port, "/v1/chat/completions", {**_chat(), "model": "gpt-4"})
    assert status == 404 and r["error"]["code"] == "model_not_found" and r["error"]["param"] == "model"
    fake.engine.fail = True
    try:
        status, r = _post(fake.port, "/v1/chat/completions", _chat())
    finally:
        fake.engine.fail = False
    assert status == 500 and r["error"]["type"] == "InternalServerError"
    assert "the fake engine broke" not in r["error"]["message"]  # issue #43: the exception's text goes to the log
    assert _post(fake.port, "/v1/chat/completions", _chat(max_tokens=1))[0] == 200  # still serving


def _open_stream(port: int, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    return conn, r


def _events(r: http.client.HTTPResponse, count: int | None = None) -> list:
    out = []
    while count is None or len(out) < count:
        line = r.readline()
        assert line, "the stream ended without [DONE]"
        if line.startswith(b"data: "):
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            out.append(json.loads(data))
    return out


def test_fake_stream_shapes(fake):
    conn, r = _open_stream(fake.port, "/v1/chat/completions",
                           _chat(max_tokens=2, stream=True, stream_options={"include_usage": True}))
    events = _events(r)
    conn.close()
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == "aa"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2


def test_fake_hang_up_aborts_the_stream(fake):
    conn, r = _open_stream(fake.port, "/v1/completions", {"prompt": "forever", "stream": True})
    events = _events(r, 3)
    rid = events[0]["id"]
    conn.close()
    _wait(lambda: f"{rid}-0" in fake.engine.aborted and not fake.engine.active, 10, "the stream's abort")


def test_fake_hang_up_aborts_a_non_streamed_request(fake):
    body = json.dumps({"prompt": "forever"}).encode()
    with socket.create_connection(("127.0.0.1", fake.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        _wait(lambda: fake.engine.active, 5, "the request to start")
    _wait(lambda: not fake.engine.active, 10, "the non-streamed request's abort")
    assert any(a.startswith("cmpl-") for a in fake.engine.aborted)


def test_fake_metrics_models_health(fake):
    status, text = _get(fake.port, "/metrics")
    assert status == 200
    for name in ("dtorch:num_requests_running", "dtorch:num_requests_waiting", "dtorch:kv_cache_usage_perc",
                 "dtorch:prompt_tokens_total", "dtorch:generation_tokens_total",
                 "dtorch:generation_tokens_per_second", "dtorch:time_to_first_token_seconds_count"):
        _metric(text, name)
    assert 'dtorch:request_success_total{finished_reason="length"}' in text
    assert _get(fake.port, "/health")[0] == 200
    models = json.loads(_get(fake.port, "/v1/models")[1])
    assert models["object"] == "list" and models["data"][0]["id"] == "fake"


# -- part 2: real servers on the default model, driven by the openai client --------------------------------------

START_TIMEOUT = 180  # loading the model on a busy 2-core machine
# batch invariant: a request's greedy tokens are then the same alone and beside others (the tests compare them); off,
# a batch of decodes may round activations to 8 bits (tests/test_quantized_model.py covers both)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DTORCH_BATCH_INVARIANT": "1"}


def _start_server(*args: str) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    # the output goes to a file, not a pipe: nobody reads a pipe while the server runs, and a full one (64 KB of log)
    # would freeze the server's event loop
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "dtorch", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning", *args], env=ENV, stdout=log, stderr=subprocess.STDOUT, text=True)

    def up() -> bool:
        if proc.poll() is not None:
            log.seek(0)  # the server has exited: its output is whole
            raise AssertionError(f"the server exited with {proc.returncode}:\n{log.read()[-20000:]}")
        try:
            return _get(port, "/health", timeout=2)[0] == 200
        except OSError:
            return False

    try:
        _wait(up, START_TIMEOUT, "the server's /health")
    except BaseException:
        _stop(proc)
        raise
    finally:
        log.close()  # the child writes through its own descriptor
    return proc, port


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


@pytest.fixture(scope="module")
def served():
    proc, port = _start_server()
    try:
        yield SimpleNamespace(port=port, proc=proc)
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def client(served):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_served_name(client, model):
    assert model == "SmolLM2-135M-Instruct.Q4_1"


def test_chat_streamed_equals_non_streamed_with_the_same_usage(client, model):
    full = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason in ("stop", "length")
    u = full.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens

    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == choice.message.content
    assert with_choices[-1].choices[0].finish_reason == choice.finish_reason
    su = chunks[-1].usage
    assert chunks[-1].choices == [] and (su.prompt_tokens, su.completion_tokens, su.total_tokens) == (
        u.prompt_tokens, u.completion_tokens, u.total_tokens)
    assert su.prompt_tokens_details.cached_tokens > 0  # the same prompt again: its prefix came from the cache


def test_completions_streamed_equals_non_streamed(client, model):
    full = client.completions.create(model=model, prompt="The sky is", max_tokens=8, temperature=0)
    assert full.object == "text_completion" and full.choices[0].text and full.usage.completion_tokens <= 8
    chunks = list(client.completions.create(model=model, prompt="The sky is", max_tokens=8, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    # token ids and several prompts: one choice each, in order
    ids = [504, 6051, 314]
    several = client.completions.create(model=model, prompt=[ids, "The sky is"], max_tokens=8, temperature=0)
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[1].text == full.choices[0].text
    assert several.usage.prompt_tokens == len(ids) + full.usage.prompt_tokens


def test_sixteen_concurrent_requests_match_their_answers_alone(client, model):
    prompts = [f"Count from {i} to {i + 3}:" for i in range(4)]
    alone = {p: client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in prompts}
    jobs = [prompts[i % 4] for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda p: client.completions.create(model=model, prompt=p, max_tokens=8,
                                                                temperature=0).choices[0].text, jobs))
    assert got == [alone[p] for p in jobs]


def test_a_client_hanging_up_mid_stream_frees_its_request(client, model, served):
    # long enough (unless aborted) that the hang-up comes first: the abort ends it within a step or two
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1000, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()

    def idle() -> bool:
        text = _get(served.port, "/metrics")[1]
        return _metric(text, "dtorch:num_requests_running") == 0 and _metric(text, "dtorch:num_requests_waiting") == 0

    _wait(idle, 20, "running requests to drop to 0")
    text = _get(served.port, "/metrics")[1]
    assert _metric(text, 'dtorch:request_success_total{finished_reason="abort"}') >= 1
    assert _metric(text, "dtorch:kv_cache_usage_perc") < 1
    again = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, temperature=0)
    assert again.choices[0].message.content


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1), "temperature"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"),
    (dict(logprobs=True, top_logprobs=50), "top_logprobs"),
    (dict(top_p=0), "top_p"),
])
def test_bad_requests_are_400_naming_the_field(client, model, kwargs, param):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=QUESTION, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert e.value.body["type"] == "invalid_request_error"


def test_missing_messages_is_400_and_unknown_model_404(client, model, served):
    import openai

    status, r = _post(served.port, "/v1/chat/completions", {"model": model})
    assert status == 400 and r["error"]["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=QUESTION, max_tokens=2)
    assert e.value.code == "model_not_found"


def test_logprobs_are_consistent(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4  # greedy
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
    c = client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(d) == 2 for d in lp.top_logprobs)


def test_n_choices_stop_and_seed(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, n=2, temperature=0.8, seed=3,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 12  # one total over both choices
    again = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, n=2, temperature=0.8,
                                           seed=3, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    full = client.completions.create(model=model, prompt="The sky is", max_tokens=8, temperature=0).choices[0].text
    word = full.split()[1]
    cut = client.completions.create(model=model, prompt="The sky is", max_tokens=8, temperature=0, stop=[word])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[:full.index(word)]


def test_zz_server_still_serves(client, model, served):
    assert served.proc.poll() is None
    assert _get(served.port, "/health")[0] == 200
    assert client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2).choices[0].finish_reason


def test_sigterm_finishes_in_flight_requests_aborts_the_rest_and_exits_0():
    openai = pytest.importorskip("openai")
    # room for 4 tokens on a loaded 2-core machine (16 in 8 s failed under load 5-6); the long stream still cannot
    # finish within it
    grace = 12
    proc, port = _start_server("--shutdown-grace", str(grace))
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)

        def stream(max_tokens: int):
            return c.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="Once upon a time",
                                        max_tokens=max_tokens, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})

        short, long = stream(4), stream(8000)  # the long one cannot finish within the grace period
        heads = [next(iter(short)), next(iter(long))]
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert list(short)[-1].choices[0].finish_reason == "length"  # in flight: finished
        assert list(long)[-1].choices[0].finish_reason == "abort"  # aborted at the end of the grace period
        assert proc.wait(grace + 10) == 0
        assert time.monotonic() - start < grace + 10 and heads[0].choices
    finally:
        _stop(proc)
