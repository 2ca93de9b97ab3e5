"""Tensor parallelism in one process against transformers: tiny random Llama (GQA), Qwen2 (q/k/v biases) and Qwen3
(q/k norms) on ``DeviceMesh.cpu(n)``, n = 1, 2, 3, 4; one model definition, the graph splits it.

8 query heads over 4 KV heads: n = 2 and 4 split the heads evenly, n = 3 in whole KV groups (2 + 1 + 1 KV
heads with their query heads), n = 5 exceeds the KV heads and is refused."""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch.engine.llm import LLM
from dtorch.engine.sampling import SamplingParams
from tests.tiny_models import families, save_random

transformers = pytest.importorskip("transformers")

FAMILIES = families(transformers, heads=8, kv_heads=4, vocab=130, qwen3_head_dim=16)
PROMPTS = [[5, 17, 99, 3, 64, 120, 7], [42], [9] * 12 + [11, 12], [77, 78, 79]]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(transformers model, checkpoint directory, greedy ids of PROMPTS at tp=1)."""
    hf = save_random(transformers, FAMILIES[request.param](), path := tmp_path_factory.mktemp(request.param))
    llm = LLM(str(path), max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    llm.close()
    return hf, str(path), greedy


@pytest.mark.parametrize("n", [2, 3, 4])
def test_logits_and_greedy_ids_match(family, n):
    hf, path, greedy = family
    llm = LLM(path, tensor_parallel_size=n, max_num_seqs=4)
    try:
        assert llm.tensor_parallel_size == n and llm.mesh.size == n
        ids = PROMPTS[0] + PROMPTS[2]
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        got = llm.logits(ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        assert llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids == greedy[0]  # one prompt
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == greedy  # a batch of different lengths
        # each device holds its share of the weights: the sharded ones split, norms replicated
        per_device = [llm.model.weight_bytes(i) for i in llm.mesh.ids]
        assert max(per_device) < 0.75 * llm.model.weight_bytes() / n * 2
    finally:
        llm.close()


def test_the_graph_splits_heads_and_inserts_the_all_reduces(family):
    _, path, _ = family
    llm = LLM(path, tensor_parallel_size=2, max_num_seqs=2)
    try:
        llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        runner = next(iter(llm.executor.runners.values()))
        ops = [node.op for node in runner.graph.operators]
        layers = llm.config.num_layers
        # o and down of every layer, and the embedding: all-reduced; the vocabulary-parallel logits: gathered
        assert ops.count("all_reduce") == 2 * layers + 1 and ops.count("all_gather") == 1
        streams = {k.operator.op: k.stream.type.value for k in runner.kernels}
        # each all-reduce's result is the next kernel's input: nothing to overlap, so on a CPU the collectives run on
        # the compute streams (no hand-off to a communicate thread and back)
        assert streams["all_reduce"] == "compute" and streams["matmul.mm"] == "compute"
        attn = next(n for n in runner.graph.operators if n.op == "llm.flash_attention_with_kvcache")
        assert attn.outputs[0].local_shapes[0][1] == 4  # 8 query heads: 4 per device
    finally:
        llm.close()


def test_bad_sizes_are_clear_errors(family):
    _, path, _ = family
    with pytest.raises(dtorch.ModelError, match="tensor_parallel_size 5 exceeds the model's 4 KV heads"):
        LLM(path, tensor_parallel_size=5)
    with pytest.raises(dtorch.ArgumentError, match="tensor_parallel_size must be an int >= 1"):
        LLM(path, tensor_parallel_size=0)
