"""The model against transformers: tiny random Llama, Qwen2 and Qwen3 checkpoints written to a temporary directory."""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch.engine.llm import LLM
from dtorch.engine.sampling import SamplingParams
from tests.tiny_models import families, hf_greedy, save_random

transformers = pytest.importorskip("transformers")

FAMILIES = families(transformers, heads=4, kv_heads=2, vocab=128, qwen3_head_dim=32)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    """(transformers model, dtorch LLM) of the same random weights."""
    hf = save_random(transformers, FAMILIES[request.param](), path := tmp_path_factory.mktemp(request.param))
    return hf, LLM(str(path), max_num_seqs=4)


def test_logits_match_transformers(pair):
    hf, llm = pair
    ids = torch.randint(3, 128, (23,)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    got = llm.logits(ids)
    assert got.shape == (23, 128) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_greedy_20_tokens_match_transformers(pair):
    hf, llm = pair
    ids = torch.randint(3, 128, (9,)).tolist()
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, 20)
    assert out.outputs[0].finish_reason == "length"


def test_batch_of_different_lengths_equals_each_alone(pair):
    _, llm = pair
    prompts = [torch.randint(3, 128, (n,)).tolist() for n in (5, 17, 1, 11)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


def test_sequences_leave_the_batch_when_done(pair):
    _, llm = pair
    prompts = [torch.randint(3, 128, (n,)).tolist() for n in (4, 7, 6)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 10, 6)]
    outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 10, 6]
    alone = [llm.generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params, strict=True)]
    assert [o.outputs[0].token_ids for o in outs] == alone


def test_more_prompts_than_slots(pair):
    _, llm = pair  # max_num_seqs=4: the fifth and sixth prompts wait for a free slot
    prompts = [torch.randint(3, 128, (n,)).tolist() for n in (3, 4, 5, 6, 7, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(prompts, params)
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == alone


def test_seeded_sampling_reproducible(pair):
    _, llm = pair
    params = SamplingParams(temperature=1.0, top_k=20, seed=123, max_tokens=15, ignore_eos=True)
    a = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    b = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    assert a == b and len(a) == 15


def test_eos_stops_unless_ignored(pair):
    _, llm = pair
    ids = [5, 9, 11]
    first = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1))[0].outputs[0].token_ids[0]
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[first]))[0]
    assert out.outputs[0].token_ids == [first] and out.outputs[0].finish_reason == "stop"


def test_bfloat16_close_to_float32(pair, tmp_path):
    hf, llm = pair
    ids = torch.randint(3, 128, (12,)).tolist()
    bf = LLM(llm.source, dtype=torch.bfloat16)
    got, want = bf.logits(ids), llm.logits(ids)
    assert got.dtype == torch.float32
    assert (got - want).abs().max() < 0.1 * want.abs().max()


def test_bad_inputs(pair):
    _, llm = pair
    with pytest.raises(dtorch.ModelError, match="context"):
        llm.generate([[3] * 128])
    with pytest.raises(dtorch.ArgumentError, match="token id"):
        llm.generate([[3, 999]])
    with pytest.raises(dtorch.ArgumentError, match="empty"):
        llm.generate([[]])
    with pytest.raises(dtorch.ModelError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"])
    with pytest.raises(dtorch.ArgumentError, match="SamplingParams"):
        llm.generate([[3, 4], [5]], [SamplingParams()])


def test_kv_cache_and_weights_are_tagged_memory(pair):
    from dtorch.core.memory import MemoryKind, memory

    _, llm = pair
    llm.generate([[4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    cache = llm.cache
    pieces = [b.tensor for t in cache.tensors.values() for b in t.blobs.values()]
    assert pieces and all(memory.kind_of(t) is MemoryKind.KV_CACHE for t in pieces)
    assert memory.live_bytes(MemoryKind.KV_CACHE) >= cache.nbytes
    weights = [b.tensor for t in llm.model.weights.values() for b in t.blobs.values()]
    assert all(memory.kind_of(t) is MemoryKind.PERSISTENT for t in weights)
