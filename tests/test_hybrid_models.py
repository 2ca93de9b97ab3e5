"""Qwen3-Next and Qwen3.5 (text) against transformers: tiny random checkpoints whose layer schedules mix gated delta
net layers with gated full attention; Qwen3-Next's sparse MoE blocks carry a shared expert and one layer is a dense
MLP (``mlp_only_layers``). On one device and on ``DeviceMesh.cpu(2)`` (every weight and state split by heads)."""

from __future__ import annotations

import shutil

import pytest
import torch

import dtorch
from dtorch.engine.llm import LLM, PREFILL_TOKENS
from dtorch.engine.sampling import SamplingParams
from dtorch.models.config import ModelConfig
from tests.tiny_models import hf_greedy, save_random, tiny_config

transformers = pytest.importorskip("transformers")

VOCAB = 128
SCHEDULE = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
FAMILIES = {
    "qwen3_next": lambda: tiny_config(transformers, "qwen3_next", vocab_size=VOCAB, layer_types=SCHEDULE,
                                      mlp_only_layers=[2]),
    "qwen3_5_text": lambda: tiny_config(transformers, "qwen3_5_text", vocab_size=VOCAB, layer_types=SCHEDULE),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request, tmp_path_factory):
    """(family, transformers model, checkpoint directory, dtorch LLM on one device)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random(transformers, FAMILIES[request.param](), path)
    llm = LLM(str(path), max_num_seqs=4)
    yield request.param, hf, str(path), llm
    llm.close()


def _prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_the_config_is_transformers(model):
    family, hf, _, llm = model
    c = llm.config
    assert c.family == family and list(c.layer_types) == SCHEDULE
    assert c.attn_output_gate and c.norm_plus_one and c.qk_norm
    assert c.rotary_dim == int(16 * hf.config.rope_parameters["partial_rotary_factor"]) < c.head_dim
    if family == "qwen3_next":
        sparse = [type(layer.mlp).__name__ == "Qwen3NextSparseMoeBlock" for layer in hf.model.layers]
        assert [c.is_sparse(i) for i in range(4)] == sparse == [True, True, False, True]
        assert c.shared_expert_intermediate_size == 48
    else:
        assert c.num_experts == 0
    # the KV cache holds the attention layers only; the state cache the linear ones, one row more than the slots
    cache = llm.cache
    assert sorted(cache.tensors) == ["conv_state.0", "conv_state.2", "k_cache.1", "k_cache.3", "ssm_state.0",
                                     "ssm_state.2", "v_cache.1", "v_cache.3"]
    assert cache.tensors["ssm_state.0"].shape == (cache.num_state_slots + 1, 4, 16, 16)
    assert cache.tensors["ssm_state.0"].dtype == torch.float32
    assert cache.tensors["conv_state.2"].shape == (cache.num_state_slots + 1, 2 * 32 + 64, 3)
    assert cache.tensors["k_cache.1"].shape == (cache.num_blocks, cache.block_size, c.num_kv_heads, c.head_dim)


@pytest.mark.parametrize("length", [150, PREFILL_TOKENS + 77])  # one step past a 64-token chunk; two steps
def test_logits_of_a_long_prompt_match_transformers(model, length):
    _, hf, _, llm = model
    ids = _prompt(length)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = llm.logits(ids)
    assert got.shape == (len(ids), VOCAB)
    _close(got, want)


def test_greedy_ids_match_transformers_alone_and_in_a_batch(model):
    _, hf, _, llm = model
    prompts = [[5, 17, 99, 3, 64, 120, 7, 8, 9], _prompt(70, seed=2)]  # different lengths, one past a chunk
    want = [hf_greedy(hf, p, 16) for p in prompts]
    assert [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts] == want
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want


def test_a_slot_reused_starts_from_zero_state(model):
    _, _, _, llm = model
    prompt = _prompt(20, seed=3)
    first = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    llm.generate([_prompt(33, seed=4), _prompt(5, seed=5)], GREEDY)  # other sequences through the same slots
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == first


def test_two_devices_equal_one(model):
    family, _, path, one = model
    ids = _prompt(100)
    prompts = [ids[:9], ids[20:43], ids[50:53]]
    llm = LLM(path, tensor_parallel_size=2, max_num_seqs=4)
    try:
        _close(llm.logits(ids), one.logits(ids))
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == \
            [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
        # each device holds one key head's share of every gated delta net tensor and state
        assert [b.tensor.shape for b in llm.model.weights["layers.0.lin_in"].blobs.values()] == [(64, 100)] * 2
        assert [b.tensor.shape for b in llm.model.weights["layers.0.lin_A_log"].blobs.values()] == [(2,)] * 2
        states = llm.cache.tensors["ssm_state.0"].blobs.values()
        assert [b.tensor.shape[1:] for b in states] == [(2, 16, 16)] * 2
    finally:
        llm.close()


def _where() -> str:
    """The innermost dtorch frame of the caller: file:function."""
    import traceback

    frames = [f for f in traceback.extract_stack()[:-2] if "/dtorch/" in f.filename]
    return f"{frames[-1].filename.rpartition('/dtorch/')[2]}:{frames[-1].name}" if frames else "?"


def test_the_decode_step_reads_no_device_values(model, monkeypatch):
    """The kernels of the hybrid layers (gated delta net, conv, gates, MoE) read no tensor on the host in a decode
    step (.tolist() / .item() / bool() / int(): on a GPU each would stall the stream).

    On cpu the MoE experts kernels read the ids on the host by choice (free there, and faster than gathering the
    experts' weights): the native one runs only on cpu, and the torch one's accelerator path, which reads nothing,
    is forced here, so these are the kernels an accelerator would run. (The cpu attention and KV cache kernels of
    the torch backend read their sequence lengths; the GPU backend's are another issue's.)"""
    import dtorch.kernels.torch.moe as moe
    from dtorch.models.bucket import bucket_for
    from dtorch.models.executor import StepPlan

    _, _, path, _ = model
    monkeypatch.setattr(moe, "_experts_host", moe._experts_gathered)
    with dtorch.dispatcher.disabled("native"):
        llm = LLM(path, max_num_seqs=2)
        try:
            blocks = llm.engine.blocks.allocate(1)
            llm.cache.reset_state(0)
            llm.executor.step(StepPlan([3, 4, 5], [3], [0], [blocks], [0]))
            bucket = bucket_for(1, 1)
            assert bucket.decode
            feeds = llm.executor.feeds(StepPlan([6], [1], [3], [blocks], [0]), bucket)
            runner = llm.executor.runner(bucket)
            reads = []
            for name in ("tolist", "item", "__bool__", "__int__", "__index__"):
                real = getattr(torch.Tensor, name)
                monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _n=name, **k:
                                    reads.append((_n, _where())) or _real(self, *a, **k))
            runner.run(feeds)
            monkeypatch.undo()
            ops = {node.op for node in runner.graph.operators}
            assert {"llm.gated_delta_net", "llm.causal_conv1d_update", "llm.gdn_gates"} <= ops
            hybrid = ("gated_delta_net.py", "causal_conv1d.py", "gdn_gates.py", "moe.py")
            assert [r for r in reads if r[1].split(":")[0].endswith(hybrid)] == []
        finally:
            monkeypatch.undo()
            llm.close()


def _copy_without(path, tmp_path, drop: str | None = None, config: dict | None = None):
    import json

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    if drop is not None:
        tensors = load_file(tmp_path / "model.safetensors")
        del tensors[drop]
        save_file(tensors, tmp_path / "model.safetensors")
    if config is not None:
        c = json.loads((tmp_path / "config.json").read_text()) | config
        (tmp_path / "config.json").write_text(json.dumps(c))
    return str(tmp_path)


def test_bad_checkpoints_are_named(model, tmp_path):
    family, _, path, _ = model
    gone = ("model.layers.2.linear_attn.in_proj_ba.weight" if family == "qwen3_next"
            else "model.layers.2.linear_attn.in_proj_a.weight")
    with pytest.raises(dtorch.ModelError, match=f"missing tensor '{gone}'"):
        LLM(_copy_without(path, tmp_path / "a", drop=gone))
    with pytest.raises(dtorch.ModelError, match="missing tensor 'model.layers.0.linear_attn.A_log'"):
        LLM(_copy_without(path, tmp_path / "b", drop="model.layers.0.linear_attn.A_log"))
    with pytest.raises(dtorch.ModelError, match=r"layer_types has 3 entries, expected one per layer \(num_layers=4\)"):
        LLM(_copy_without(path, tmp_path / "c", config={"layer_types": SCHEDULE[:3]}))
    with pytest.raises(dtorch.ModelError, match="layer_types holds \\['sliding_attention'\\]"):
        LLM(_copy_without(path, tmp_path / "d", config={"layer_types": SCHEDULE[:3] + ["sliding_attention"]}))


def test_bad_hybrid_configs_are_clear_errors():
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                head_dim=16, linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=8, partial_rotary_factor=0.25)
    ModelConfig("qwen3_5_text", layer_types=("linear_attention", "full_attention"), **base)
    with pytest.raises(dtorch.ModelError, match="linear_attention layers need a family of"):
        ModelConfig("qwen3", layer_types=("linear_attention", "full_attention"), **base)
    with pytest.raises(dtorch.ModelError, match="linear_num_value_heads \\(5\\) must be a multiple"):
        ModelConfig("qwen3_5_text", layer_types=("linear_attention",) * 2, **(base | {"linear_num_value_heads": 5}))
    with pytest.raises(dtorch.ModelError, match="linear_key_head_dim must be a positive int"):
        ModelConfig("qwen3_5_text", layer_types=("linear_attention",) * 2, **(base | {"linear_key_head_dim": 0}))
    with pytest.raises(dtorch.ModelError, match="partial_rotary_factor must be a number in"):
        ModelConfig("qwen3_5_text", **(base | {"partial_rotary_factor": 1.5}))


def _char_tokenizer(path) -> None:
    """A character-level tokenizer.json over ids 3..VOCAB-1 (0..2: pad, bos, eos), for the CLI."""
    from tokenizers import Tokenizer, decoders, models

    chars = " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,?!'"
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {ch: 3 + i for i, ch in enumerate(chars)}
    vocab |= {f"<x{i}>": i for i in range(len(vocab), VOCAB)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))
    tok.decoder = decoders.Fuse()
    tok.save(str(path / "tokenizer.json"))


def test_the_generate_command_runs_the_model(model, tmp_path):
    import dataclasses
    import subprocess
    import sys

    _, _, path, _ = model
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    _char_tokenizer(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "dtorch", "generate", "--model", str(tmp_path), "--raw",
                           "--max-tokens", "12", "--ignore-eos", "What is the capital of France?"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    llm = LLM(str(tmp_path))
    try:
        want = llm.generate(["What is the capital of France?"], dataclasses.replace(GREEDY, max_tokens=12))[0]
    finally:
        llm.close()
    assert len(want.outputs[0].token_ids) == 12 and proc.stdout.strip() == want.outputs[0].text.strip()
    assert "decode" in proc.stderr and "tok/s" in proc.stderr


def test_bf16_projections_run_either_way(model):
    """bf16 weights are stored as W [N, K] for matmul.linear when the native one-row kernel is its provider, else
    as Wt [K, N] for matmul.mm: both ways give the same logits and greedy ids, within bf16 rounding."""
    family, _, path, _ = model
    ids = _prompt(40)
    native = "native" not in dtorch.dispatcher.unavailable("cpu")
    with dtorch.dispatcher.disabled("native"):
        mm = LLM(path, dtype=torch.bfloat16)
    linear = LLM(path, dtype=torch.bfloat16)
    try:
        assert not mm.model.linear_weights and "(W [N, K])" not in mm.model.linear_provider()
        assert bool(linear.model.linear_weights) == native
        if native:
            assert "layers.0.lin_in" in linear.model.linear_weights
            assert ("layers.0.router" in linear.model.linear_weights) == (family == "qwen3_next")
        want = mm.logits(ids)
        torch.testing.assert_close(linear.logits(ids), want, rtol=2 ** -6, atol=2 ** -6 * float(want.abs().max()))
    finally:
        mm.close()
        linear.close()
