"""Issue #25: ``dtorch serve`` before it faces a network, and what it tells its operator.

Part 1 runs the app over test_serve's fake engine with an API key, CORS, a small body limit and a short throughput
interval: the key (401 as OpenAI's, checked with the openai client), /health and /metrics open, CORS preflights, 413
for declared and chunked bodies, 431 for a 1 MB header, the findings of the hostile run (a surrogate model name,
``max_tokens: true``, ``temperature: NaN``, a negative stop id, ``HEAD /health``), the per-request and throughput log
lines. Part 2 starts one real ``python -m dtorch serve --port 0 --api-key ...`` on the default model: its banner names
the port it got; a 5 MB prompt is refused while a stream beside it keeps flowing; logprobs carry each token's bytes.
"""

from __future__ import annotations

import http.client
import io
import json
import logging
import re
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from test_serve import ENV, START_TIMEOUT, FakeLLM, FakeLoop, _chat, _free_port, _get, _wait

openai = pytest.importorskip("openai")

KEY = "test-key-25"
ORIGIN = "http://app.example"
MAX_BODY = 4096


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def guarded():
    import uvicorn

    from dtorch.serve import build_app
    from dtorch.serve.guard import H11Protocol

    lines = _Lines()
    log = logging.getLogger("dtorch.serve")
    log.addHandler(lines)
    level, log.level = log.level, logging.INFO
    llm, port = FakeLLM(), _free_port()
    loop = FakeLoop(llm.engine)
    loop.start()
    app = build_app(llm, "fake", engine_loop=loop, api_key=KEY, allowed_origins=[ORIGIN], max_body_bytes=MAX_BODY,
                    log_interval=0.2)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=H11Protocol))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait(lambda: server.started, 20, "the fake server to start")
    yield SimpleNamespace(port=port, engine=llm.engine, lines=lines.lines)
    server.should_exit = True
    thread.join(10)
    log.removeHandler(lines)
    log.level = level
    _wait(lambda: not [t for t in threading.enumerate() if t.name.startswith("dtorch-tokenize")], 5,
          "the worker pool's threads to end")


def _request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
             ) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body, headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def _authorized(**headers) -> dict:
    return {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **headers}


def test_the_api_key_is_asked_for_everywhere_but_health_and_metrics(guarded):
    port, body = guarded.port, json.dumps(_chat(max_tokens=2)).encode()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, h, raw = _request(port, "POST", "/v1/chat/completions", body, headers)
        err = json.loads(raw)["error"]
        assert status == 401 and err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        assert h["www-authenticate"] == "Bearer"
    for path in ("/v1/models", "/tokenize", "/openapi.json"):
        assert _request(port, "GET", path)[0] == 401
    assert _request(port, "POST", "/v1/chat/completions", body, _authorized())[0] == 200
    for method in ("GET", "HEAD"):
        assert _request(port, method, "/health")[0] == 200
    assert _request(port, "GET", "/metrics")[0] == 200
    wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    right = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    assert right.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=2).choices[0].message.content == "aa"


def test_cors_preflights_and_answers_name_the_allowed_origin(guarded):
    ask = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    status, h, _ = _request(guarded.port, "OPTIONS", "/v1/chat/completions", headers=ask)
    assert status == 200 and h["access-control-allow-origin"] == ORIGIN
    assert "POST" in h["access-control-allow-methods"] and "authorization" in h["access-control-allow-headers"]
    status, h, _ = _request(guarded.port, "OPTIONS", "/v1/chat/completions", headers=ask | {"Origin": "http://evil"})
    assert status == 400 and "access-control-allow-origin" not in h
    for headers in ({"Origin": ORIGIN}, _authorized(Origin=ORIGIN)):  # a 401 is readable by the page too
        status, h, _ = _request(guarded.port, "GET", "/v1/models", headers=headers)
        assert h["access-control-allow-origin"] == ORIGIN and status in (200, 401)


def test_a_body_past_the_limit_is_413_declared_or_chunked(guarded):
    big = json.dumps(_chat("x" * MAX_BODY)).encode()
    status, _, raw = _request(guarded.port, "POST", "/v1/chat/completions", big, _authorized())
    err = json.loads(raw)["error"]
    assert status == 413 and err["code"] == "request_too_large" and f"at most {MAX_BODY}" in err["message"]
    chunks = (big[i:i + 1000] for i in range(0, len(big), 1000))
    conn = http.client.HTTPConnection("127.0.0.1", guarded.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", chunks, _authorized(), encode_chunked=True)
    assert conn.getresponse().status == 413
    conn.close()
    small = json.dumps(_chat(max_tokens=1)).encode()
    conn = http.client.HTTPConnection("127.0.0.1", guarded.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", iter([small[:10], small[10:]]), _authorized(), encode_chunked=True)
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["choices"][0]["message"]["content"] == "a"
    conn.close()


def test_a_one_megabyte_header_is_431(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=20) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")  # sent whole
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < _length(reply):
            chunk = s.recv(65536)
            assert chunk, reply
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ")
    assert json.loads(body)["error"]["code"] == "request_header_too_large"
    assert _request(guarded.port, "GET", "/health")[0] == 200


def _length(reply: bytes) -> int:
    m = re.search(rb"content-length: (\d+)", reply, re.IGNORECASE)
    return int(m.group(1)) if m else 1 << 30


@pytest.mark.parametrize("body, status, param, words", [
    ({"model": "\ud800", "messages": [{"role": "user", "content": "hi"}]}, 404, "model", "does not exist"),
    (_chat(max_tokens=True), 400, "max_tokens", "valid integer"),
    (_chat(max_tokens=2.5), 400, "max_tokens", "valid integer"),
    (_chat(n=True), 400, "n", "valid integer"),
    (_chat(stop_token_ids=[-42110], min_tokens=1), 400, "stop_token_ids", "greater than or equal to 0"),
    (_chat(repetition_penalty=1e-300), 400, "repetition_penalty", "greater than or equal to 0.0001"),  # #43
    ({"model": "fake", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", "unknown role"),
])
def test_hostile_fields_are_refused_naming_them(guarded, body, status, param, words):
    code, r = _post_authorized(guarded.port, json.dumps(body).encode())
    assert code == status and r["error"]["param"] == param and words in r["error"]["message"], r


def test_nan_is_not_a_range_error(guarded):
    code, r = _post_authorized(guarded.port, b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], '
                                             b'"temperature": NaN}')
    assert code == 400 and r["error"]["message"] == "temperature: Input should be a finite number"


def _post_authorized(port: int, body: bytes) -> tuple[int, dict]:
    status, _, raw = _request(port, "POST", "/v1/chat/completions", body, _authorized())
    return status, json.loads(raw)


def test_each_request_logs_a_line_and_a_busy_engine_a_throughput_line(guarded):
    code, r = _post_authorized(guarded.port, json.dumps(_chat(max_tokens=3, n=2)).encode())
    assert code == 200
    _wait(lambda: any(line.startswith(r["id"]) for line in guarded.lines), 5, "the request's log line")
    line = next(line for line in guarded.lines if line.startswith(r["id"]))
    assert re.fullmatch(rf"{r['id']}: prompt 9 tokens, completion 6 tokens, first token \d+\.\d+ s, "
                        r"(\d+\.\d|-) tok/s, \d+\.\d+ s, finish length x2", line), line
    conn = http.client.HTTPConnection("127.0.0.1", guarded.port, timeout=10)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "forever", "stream": True}).encode(), _authorized())
    assert conn.getresponse().status == 200
    _wait(lambda: any(line.startswith("throughput: ") for line in guarded.lines), 5, "a throughput line")
    conn.close()  # the hang-up aborts it: its line says so
    _wait(lambda: any(line.endswith("finish abort") for line in guarded.lines), 5, "the aborted stream's line")
    busy = next(line for line in guarded.lines if line.startswith("throughput: "))
    assert re.fullmatch(r"throughput: prompt \d+\.\d tok/s, generation \d+\.\d tok/s; \d+ requests running, 0 waiting; "
                        r"KV cache \d+\.\d% used", busy), busy


def test_the_warmup_bar_shows_on_a_terminal_only(monkeypatch):
    from dtorch.serve.cli import warmup_bar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        assert list(warmup_bar([1, 2, 3])) == [1, 2, 3]
        assert ("warming up:" in stream.getvalue() and "/3 [" in stream.getvalue()) == shown, stream.getvalue()
        assert shown or stream.getvalue() == ""


# -- part 2: a real server on the default model ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def real():
    # one thread: on cores other tests keep busy, a team of OpenMP threads waits for the busiest one at every kernel
    proc = subprocess.Popen([sys.executable, "-m", "dtorch", "serve", "--host", "127.0.0.1", "--port", "0",
                             "--api-key", KEY, "--threads", "1", "--max-num-seqs", "4",
                             "--max-num-batched-tokens", "64", "--max-model-len", "2048", "--log-stats-interval", "0"],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        found = []

        def listening() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the server exited with {proc.returncode}:\n{''.join(out)}")
            found[:] = [m for line in out for m in re.findall(r"^dtorch serve: \S+ on http://127.0.0.1:(\d+)/v1$",
                                                              line.rstrip("\n"))]
            return bool(found)

        _wait(listening, START_TIMEOUT, "the server's banner")
        port = int(found[0])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
        yield SimpleNamespace(port=port, out=out, client=client, model=client.models.list().data[0].id)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_the_banner_names_the_real_port_the_model_its_memory_and_threads(real):
    assert real.port != 0 and _get(real.port, "/health")[0] == 200  # the port it printed is the one it serves
    text = "".join(real.out)
    banner = text[text.index("dtorch serve: "):]
    for words in ("loaded SmolLM2-135M-Instruct.Q4_1.gguf (llama, 30 layers, ", "(gguf.q4_1 x",
                  "context 2048, 1 thread", "KV cache ", "MiB reserved for ", "at most 4 sequences a step"):
        assert words in banner, banner
    assert "\r" not in text and "it/s" not in text  # no progress bar when stderr is not a terminal


def test_logprobs_bytes_join_to_the_reply(real):
    r = real.client.chat.completions.create(model=real.model, max_tokens=12, temperature=0, logprobs=True,
                                            top_logprobs=2,
                                            messages=[{"role": "user", "content": "Repeat exactly: 🎉🎉"}])
    text, content = r.choices[0].message.content, r.choices[0].logprobs.content
    joined = b"".join(bytes(t.bytes) for t in content)  # the end-of-turn token is not the reply's (issue #40)
    assert joined == text.encode() and "🎉" in text
    partial = [t for t in content if bytes(t.bytes) and not _utf8(bytes(t.bytes))]
    assert partial and all(t.token == bytes(t.bytes).decode("utf-8", "backslashreplace") for t in partial)
    assert all(bytes(x.bytes).decode("utf-8", "backslashreplace") == x.token for t in content for x in t.top_logprobs)


def test_a_prompt_past_the_context_is_named_as_the_client_sent_it(real):
    for prompt, name in (([1] * 2048, "prompt"), (["hi", [1] * 3000], r"prompt\[1\]")):
        with pytest.raises(openai.BadRequestError) as e:
            real.client.completions.create(model=real.model, prompt=prompt, max_tokens=1)
        message = e.value.body["message"]
        assert re.fullmatch(r"This model's maximum context length is 2048 tokens\. However, your prompt resulted in "
                            r"\d+ tokens\. Please reduce the length of the prompt\. "
                            rf"\({name} has \d+ tokens, but the context is 2048 tokens \(max_model_len\) and at least "
                            r"one new token must fit\)", message), message
        assert e.value.body["param"] == "prompt" and e.value.code == "context_length_exceeded"


def _utf8(b: bytes) -> bool:
    """Whether ``b`` is UTF-8 text on its own."""
    return b.decode("utf-8", "replace").encode() == b


def test_a_five_megabyte_prompt_does_not_stall_a_live_stream(real):
    c, gaps, done = real.client, [], threading.Event()

    def stream() -> None:
        s = c.completions.create(model=real.model, prompt="Once upon a time", max_tokens=1500, temperature=0,
                                 stream=True, extra_body={"ignore_eos": True})
        last = time.monotonic()
        for _ in s:
            now = time.monotonic()
            gaps.append((last, now))
            last = now
            if done.is_set():
                break
        s.close()

    t = threading.Thread(target=stream)
    t.start()
    _wait(lambda: len(gaps) >= 3, 60, "the stream's first chunks")
    start = time.monotonic()
    text = "word " * 1_000_000  # 5 MB
    for call in (lambda: c.completions.create(model=real.model, prompt=text, max_tokens=4),
                 lambda: c.chat.completions.create(model=real.model, messages=[{"role": "user", "content": text}],
                                                   max_tokens=4)):
        with pytest.raises(openai.BadRequestError, match=r"at least \d+ tokens"):
            call()
    end = time.monotonic()
    time.sleep(0.3)
    done.set()
    t.join(60)
    during = [b - a for a, b in gaps if b > start and a < end]
    assert during and max(during) < 1.0, f"a gap of {max(during):.2f} s while the 5 MB prompts were refused"


def test_a_lost_ranks_error_is_queued_before_the_deltas_the_engine_sends_after():
    """``Server.lose`` on the engine's thread, then the engine's "abort" delta for the same request (as a failed step
    does): the request's queue gets the error first, so its stream ends with the error, not as if finished. With
    the error one loop iteration late (``call_later(0)``) the delta came first."""
    import asyncio

    from dtorch.serve.server import Server

    async def main():
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        server = SimpleNamespace(loop=loop, waiting={queue}, lost=None, lost_error=lambda: RuntimeError("lost rank 1"))
        server._end_waiting = lambda *args: Server._end_waiting(server, *args)

        # the order a failed step gives on the engine's thread: the server told, then the engine's deltas; both here
        # before the loop runs again (the case a busy machine makes: the loop wakes to find both posted)
        Server.lose(server, "lost rank 1")
        loop.call_soon_threadsafe(queue.put_nowait, "abort delta")
        first = await asyncio.wait_for(queue.get(), 5)
        second = await asyncio.wait_for(queue.get(), 5)
        return first, second

    first, second = asyncio.run(main())
    assert isinstance(first, RuntimeError) and "lost rank 1" in str(first), (first, second)
    assert second == "abort delta"
