"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF): dtorch against transformers reading the same file,
and the text side of the LLM API (chat, text prompts, stop strings, streaming) on a real tokenizer."""

from __future__ import annotations

import pytest
import torch

from dtorch.engine.llm import LLM
from dtorch.engine.sampling import SamplingParams
from dtorch.models.default import default_model_path
from tests.tiny_models import transformers_from_gguf

transformers = pytest.importorskip("transformers")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    # the float path (weights dequantized at load) is what transformers computes; the weights-as-stored path is
    # tested against this one in test_quantized_model.py
    llm = LLM(max_num_seqs=4, dequantize=True)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def hf():
    """transformers' model with the weights its own GGUF reader dequantizes."""
    return transformers_from_gguf(default_model_path())


def test_greedy_32_tokens_from_a_chat_prompt_match_transformers(llm, hf):
    ids = llm.chat_prompt(CHAT)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))[0]
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
    assert out.outputs[0].token_ids == ref


def test_chat_answers_and_stops_at_eos(llm):
    out = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=48))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids[-1] in llm.eos_token_ids
    assert "<|im_end|>" not in out.outputs[0].text


def test_text_prompt_and_streaming_agree(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = llm.generate("The capital of France is", params)[0]
    assert out.prompt == "The capital of France is" and len(out.outputs[0].token_ids) == 12
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    assert "".join(llm.stream("The capital of France is", params)) == out.outputs[0].text


def test_stop_string_ends_the_text(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = llm.generate("The capital of France is", params)[0].outputs[0].text
    stop = full.strip().split()[1]  # a word in the middle of the greedy answer
    pieces: list[str] = []
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
    out = llm.generate("The capital of France is", params, on_text=lambda i, s: pieces.append(s))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == full[:full.index(stop)]
    assert "".join(pieces) == out.outputs[0].text


def test_seeded_sampling_reproducible_on_text(llm):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)
    a = llm.chat(CHAT, params)[0].outputs[0]
    b = llm.chat(CHAT, params)[0].outputs[0]
    assert a.token_ids == b.token_ids and a.text == b.text
