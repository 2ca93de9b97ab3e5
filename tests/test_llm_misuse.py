"""Issue #25's silent wrong results and leaks in the Python API, on the default model: token ids out of the vocabulary
(a negative stop id used to ban a real token through Python's negative indexing), every method of a closed LLM, and a
prompt too long for the context refused before it is encoded."""

from __future__ import annotations

import threading
import time

import pytest

import dtorch
from dtorch import DtorchError, ModelError, SamplingError, SamplingParams

VOCAB = 49152  # SmolLM2's
PARIS = 7042  # " Paris"


@pytest.fixture(scope="module")
def llm():
    llm = dtorch.LLM(threads=1, max_num_seqs=2, max_model_len=256)
    yield llm
    llm.close()


@pytest.mark.parametrize("bad", [PARIS - VOCAB, -1])
def test_a_negative_stop_token_id_is_refused(bad):
    with pytest.raises(SamplingError, match=f"stop_token_ids has token id {bad}; ids must be >= 0"):
        SamplingParams(stop_token_ids=[bad], min_tokens=1)


def test_token_ids_past_the_vocabulary_are_refused(llm):
    for field, value in (("stop_token_ids", [10**9]), ("logit_bias", {VOCAB: 1.0})):
        with pytest.raises(SamplingError, match=rf"{field} has token id \d+; ids must be in \[0, {VOCAB}\)"):
            llm.generate("The capital of France is", SamplingParams(max_tokens=2, **{field: value}))
    # the reply the bad id used to change, with a real stop id held off by min_tokens
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=1, min_tokens=1,
                                                                     stop_token_ids=[0]))
    assert out[0].outputs[0].token_ids == [PARIS]


def test_a_prompt_past_the_context_is_refused_before_it_is_encoded(llm):
    text = "word " * 200_000  # 1 MB: encoding it takes seconds on a busy 2-core machine
    t0 = time.perf_counter()
    with pytest.raises(ModelError, match=r"prompt 0 has at least \d+ tokens, but the context is 256 tokens"):
        llm.generate(text)
    with pytest.raises(ModelError, match=r"the conversation has at least \d+ tokens once rendered"):
        llm.chat([{"role": "user", "content": text}])
    assert time.perf_counter() - t0 < 1.0


def test_every_method_of_a_closed_llm_says_so_and_starts_no_thread():
    llm = dtorch.LLM(threads=1, max_num_seqs=1, max_model_len=64)
    llm.close()
    before = set(threading.enumerate())
    msgs = [{"role": "user", "content": "hi"}]
    calls = {"logits": lambda: llm.logits([1, 2, 3]), "generate": lambda: llm.generate("hi"),
             "stream": lambda: llm.stream("hi"), "chat": lambda: llm.chat(msgs),
             "chat_prompt": lambda: llm.chat_prompt(msgs), "chat_setup": lambda: llm.chat_setup(msgs),
             "embed": lambda: llm.embed("hi"),
             "capture_report": llm.capture_report}
    for name, call in calls.items():
        with pytest.raises(DtorchError, match=rf"LLM.{name}: this LLM is closed"):
            call()
    assert set(threading.enumerate()) <= before
    llm.close()  # twice is fine
