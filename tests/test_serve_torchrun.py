"""``dtorch serve`` under torchrun: 2 gloo ranks on a random 2-layer Qwen3 with a chat template, tensor parallel
(``-tp 2``) and pipelined (``-pp 2``), answering the ``openai`` client. One process's ``LLM`` (tp=1) is the reference:
the greedy text, the forced tool call and the embedding (of a long input, whose step plan takes two broadcasts) are
its own. Rank 0 holds the server and the scheduler, the
banner lists both ranks with what each holds (half the heads, or one layer each).

- tp=2, with speculative decoding (the model as its own draft model): a streamed chat, a forced tool call,
  embeddings, a greedy completion, drafts accepted in /metrics; then SIGTERM on rank 0 in the middle of a stream: the
  stream finishes (the drain), every rank exits 0.
- pp=2: the same answers; then rank 1 is killed (SIGKILL) in the middle of a stream: the stream ends with an error
  event naming rank 1, /health answers 503, and rank 0 exits 2 naming rank 1 (torchrun's own monitor polls every 5 s,
  so it does not stop rank 0 before rank 0 has answered and exited by itself).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.test_tp_torchrun import ROOT, _env, _free_port

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
pytest.importorskip("fastapi")

CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
SHORT = [{"role": "user", "content": "Paris"}]  # this random model answers it with printable text
PROMPT = "It is sunny and warm today in"
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
FORCED = {"type": "function", "function": {"name": "get_weather"}}
LONG_INPUT = " ".join([PROMPT] * 100)  # 2600 tokens: a step plan past one broadcast's 4 KiB (ranks.CHUNK)
LONG = 3000  # tokens of a stream still running when rank 1 is killed (the model never ends it: ignore_eos)
DRAINED = 150  # tokens of a stream still running when rank 0 gets SIGTERM, which it then finishes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The model folder and one process's answers (tp=1): greedy chat text, greedy completion text, the forced
    call's arguments, the embedding of PROMPT."""
    import torch
    from test_serve_agents import make_tiny_chat_model

    from dtorch.engine.llm import LLM
    from dtorch.engine.sampling import SamplingParams

    torch.manual_seed(41)
    path = tmp_path_factory.mktemp("tiny-ranks")
    make_tiny_chat_model(path, positions=4096)
    llm = LLM(str(path), max_num_seqs=4)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        want = {"chat": llm.chat(SHORT, greedy)[0].outputs[0].text,
                "completion": llm.generate(PROMPT, greedy)[0].outputs[0].text,
                "call": llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=80), tools=[TOOL],
                                 tool_choice=FORCED)[0].outputs[0].tool_calls[0].arguments,
                "embedding": llm.embed(LONG_INPUT)[0].tolist()}
    finally:
        llm.close()
    return path, want


class Ranks:
    """``torchrun --nproc-per-node 2 -m dtorch serve`` with its output in a file; the banner's pids."""

    def __init__(self, tmp_path, model, *flags: str) -> None:
        self.port = _free_port()
        self.log = tmp_path / "ranks.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                 str(_free_port()), "--monitor-interval", "5", "-m", "dtorch", "serve", "--model", str(model),
                 "--served-model-name", "tiny", "--port", str(self.port), "--log-level", "warning",
                 "--max-num-seqs", "4", "--max-num-batched-tokens", "2048", "--rank-timeout", "10", *flags],
                cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0,
                                    timeout=60)
        self.pids: dict[int, int] = {}
        end = time.monotonic() + 240
        try:
            while not (m := re.findall(r"rank (\d) on \S+ \(pid (\d+), [^)]*\): (.*)", self.text())):
                assert self.proc.poll() is None and time.monotonic() < end, self.text()
                time.sleep(0.3)
        except BaseException:
            self.kill()
            raise
        self.pids = {int(r): int(p) for r, p, _ in m}
        self.holds = {int(r): h for r, _, h in m}

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def health(self) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun did not end within {timeout} s:\n{self.text()}")

    def kill(self) -> None:
        """torchrun and its ranks (each in a session of its own), whatever state they are in."""
        for pid in {*self.pids.values(), *_children(self.proc.pid)}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                if d.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _answers_like_one_process(r: Ranks, want: dict) -> None:
    c = r.client
    chunks = list(c.chat.completions.create(model="tiny", messages=SHORT, temperature=0, max_tokens=24, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert len(chunks) > 5 and chunks[-1].choices[0].finish_reason == "length"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want["chat"]
    done = c.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=24,
                                extra_body={"ignore_eos": True})
    assert done.choices[0].text == want["completion"]
    call = c.chat.completions.create(model="tiny", messages=CHAT, temperature=0, max_tokens=80, tools=[TOOL],
                                     tool_choice=FORCED).choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert call.function.arguments == want["call"]
    vector = c.embeddings.create(model="tiny", input=LONG_INPUT).data[0].embedding
    assert max(abs(a - b) for a, b in zip(vector, want["embedding"], strict=True)) < 1e-4


def _long_stream(r: Ranks, tokens: int):
    """A streamed completion of ``tokens`` tokens, its first chunk already read."""
    stream = r.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=tokens, stream=True,
                                         extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    return it


def test_tp2_serves_the_openai_client_and_sigterm_on_rank_0_drains_every_rank(tiny, tmp_path):
    model, want = tiny
    # the model drafts for itself: the draft model's steps are told to rank 1 too, and greedy answers stay the same
    spec = json.dumps({"method": "draft_model", "model": str(model), "num_speculative_tokens": 2})
    r = Ranks(tmp_path, model, "-tp", "2", "--shutdown-grace", "60", "--speculative-config", spec)
    try:
        assert r.holds[0].startswith("layers 0-1 of 2, tp shard 1 of 2") and "tp shard 2 of 2" in r.holds[1]
        _answers_like_one_process(r, want)
        with urllib.request.urlopen(f"http://127.0.0.1:{r.port}/metrics", timeout=10) as m:
            accepted = re.search(r"^dtorch:spec_decode_num_accepted_tokens_total (\S+)", m.read().decode(), re.M)
        assert float(accepted.group(1)) > 0  # a model agrees with itself
        it = _long_stream(r, DRAINED)
        os.kill(r.pids[0], signal.SIGTERM)
        rest = list(it)
        assert rest[-1].choices[0].finish_reason == "length"  # drained: the stream ran to its end
        assert r.wait(90) == 0, r.text()
        assert "Traceback" not in r.text()
    finally:
        r.kill()


def test_pp2_serves_the_openai_client_and_a_killed_rank_ends_the_stream_with_an_error(tiny, tmp_path):
    model, want = tiny
    r = Ranks(tmp_path, model, "-pp", "2")
    try:
        assert r.holds[0].startswith("layers 0-0 of 2 (stage 0 of 2)") and "layers 1-1 of 2 (stage 1" in r.holds[1]
        _answers_like_one_process(r, want)
        it = _long_stream(r, LONG)
        seen: list[tuple[float, int | None]] = []  # /health from the kill on: (seconds after it, status or None)
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                try:
                    seen.append((time.monotonic() - t0, r.health()))
                except OSError:  # rank 0 has exited (it answers 503 for ranks.LINGER_S first)
                    seen.append((time.monotonic() - t0, None))
                    return
                time.sleep(0.1)

        t0 = time.monotonic()
        os.kill(r.pids[1], signal.SIGKILL)
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        with pytest.raises(openai.APIError) as e:
            for _ in it:
                pass
        assert "lost rank 1" in str(e.value.message), e.value
        poller.join(30)
        done.set()
        first = next((t for t, status in seen if status == 503), None)
        assert first is not None, seen
        assert first < 10, seen  # a closed connection: noticed at once, not after --rank-timeout
        assert r.wait(60) != 0
        lines = [ln for ln in r.text().splitlines() if ln.startswith("dtorch: error: rank 0 of 2:")]
        assert lines and "lost rank 1" in lines[0], r.text()
    finally:
        r.kill()
