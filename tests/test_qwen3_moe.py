"""Qwen3-MoE against transformers: tiny random ``Qwen3MoeForCausalLM`` checkpoints (4 layers mixing dense MLPs and
sparse MoE blocks of 8 experts, top-2) on one device and on ``DeviceMesh.cpu(n)``: n = 2 splits the experts
(expert parallel), n = 3 does not divide them and splits each expert's matrices (tensor parallel)."""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch.engine.llm import LLM, PREFILL_TOKENS
from dtorch.engine.sampling import SamplingParams
from dtorch.models.config import ModelConfig
from dtorch.models.layout import Layout
from tests.tiny_models import hf_greedy, save_random, tiny_config

transformers = pytest.importorskip("transformers")

VOCAB = 128
# schedule name -> config fields: which layers are sparse, and whether the top-k weights are renormalized
SCHEDULES = {
    "every_second_normalized": dict(decoder_sparse_step=2, norm_topk_prob=True),  # layers 1, 3 sparse
    "mlp_only_layer_2": dict(decoder_sparse_step=1, mlp_only_layers=[2], norm_topk_prob=False),  # 0, 1, 3 sparse
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _config(schedule: str):
    return tiny_config(transformers, "qwen3_moe", vocab_size=VOCAB, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4, max_position_embeddings=1024, **SCHEDULES[schedule])


@pytest.fixture(scope="module", params=sorted(SCHEDULES))
def model(request, tmp_path_factory):
    """(transformers model, checkpoint directory, dtorch LLM on one device)."""
    hf = save_random(transformers, _config(request.param), path := tmp_path_factory.mktemp(request.param))
    llm = LLM(str(path), max_num_seqs=4)
    yield hf, str(path), llm
    llm.close()


def _long_prompt() -> list[int]:
    return torch.randint(3, VOCAB, (PREFILL_TOKENS + 88,), generator=torch.Generator().manual_seed(1)).tolist()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_the_schedule_is_transformers(model):
    hf, _, llm = model
    sparse = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert [llm.config.is_sparse(i) for i in range(4)] == sparse
    assert any(sparse) and not all(sparse)  # dense and sparse layers mixed
    assert llm.config.family == "qwen3_moe" and llm.config.qk_norm and llm.config.num_experts == 8


def test_logits_of_a_prompt_longer_than_a_chunk_match_transformers(model):
    hf, _, llm = model
    ids = _long_prompt()  # two prefill steps
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = llm.logits(ids)
    assert got.shape == (len(ids), VOCAB)
    _close(got, want)


def test_greedy_ids_match_transformers_alone_and_in_a_batch(model):
    hf, _, llm = model
    prompts = [[5, 17, 99, 3, 64, 120, 7, 8, 9], [42] * 11 + list(range(10, 22))]
    want = [hf_greedy(hf, p, 16) for p in prompts]
    assert llm.generate([prompts[0]], GREEDY)[0].outputs[0].token_ids == want[0]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want


@pytest.mark.parametrize("n, expert_parallel", [(2, True), (3, False)])
def test_a_mesh_equals_one_device(model, n, expert_parallel):
    _, path, one = model
    ids = _long_prompt()[:100]
    prompts = [ids[:9], ids[20:43], ids[50:53]]
    llm = LLM(path, tensor_parallel_size=n, max_num_seqs=4)
    try:
        assert llm.model.layout.expert_parallel is expert_parallel
        _close(llm.logits(ids), one.logits(ids))
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == \
            [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
        sparse = next(i for i in range(4) if llm.config.is_sparse(i))
        shapes = [b.tensor.shape for b in llm.model.weights[f"layers.{sparse}.experts_gate_up"].blobs.values()]
        if expert_parallel:  # whole experts: 4 of the 8 on each device
            assert shapes == [(4, 64, 64)] * 2
        else:  # every expert, a third of its 32 features of gate and of up: 11 + 11, 11 + 11, 10 + 10
            assert shapes == [(8, 22, 64), (8, 22, 64), (8, 20, 64)]
    finally:
        llm.close()


def test_the_graph_all_reduces_the_experts_partial_sums(model):
    _, path, _ = model
    llm = LLM(path, tensor_parallel_size=2, max_num_seqs=2)
    try:
        llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        runner = next(iter(llm.executor.runners.values()))
        ops = [node.op for node in runner.graph.operators]
        sparse = sum(llm.config.is_sparse(i) for i in range(4))
        assert ops.count("llm.moe_experts") == sparse and ops.count("llm.moe_router") == sparse
        # o and the MLP (dense or experts) of every layer, and the embedding: all-reduced; the logits gathered; no
        # weight moves (the experts run where they are placed)
        assert ops.count("all_reduce") == 2 * 4 + 1 and ops.count("all_gather") == 1
    finally:
        llm.close()


def test_a_missing_expert_tensor_is_named(model, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    _, path, _ = model
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    gone = "model.layers.3.mlp.experts.5.up_proj.weight"
    del tensors[gone]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(dtorch.ModelError, match=f"missing tensor '{gone}'"):
        LLM(str(tmp_path))


def test_bad_moe_configs_are_clear_errors():
    base = ModelConfig.preset("tiny-qwen3", family="qwen3_moe", num_kv_heads=4, num_experts=6,
                              num_experts_per_tok=2, moe_intermediate_size=2)
    with pytest.raises(dtorch.ModelError, match="num_experts_per_tok must be in 1..num_experts=6"):
        ModelConfig.preset("tiny-qwen3", family="qwen3_moe", num_experts=6, num_experts_per_tok=7,
                           moe_intermediate_size=2)
    with pytest.raises(dtorch.ModelError, match="num_experts=6 needs a family of"):
        ModelConfig.preset("tiny-qwen3", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=2)
    with pytest.raises(dtorch.ModelError, match="mlp_only_layers must be layer indices"):
        ModelConfig.preset("tiny-qwen3", family="qwen3_moe", mlp_only_layers=(2,))
    assert Layout(base, 2).expert_parallel and Layout(base, 3).expert_parallel and not Layout(base, 1).expert_parallel
    with pytest.raises(dtorch.ModelError, match="tensor_parallel_size 4 neither divides the model's 6 experts"):
        Layout(base, 4)
