"""Qwen3-MoE GGUF files (llama.cpp's ``qwen3moe``): the tiny transformers checkpoints of ``test_qwen3_moe`` written
the way ``convert_hf_to_gguf.py`` writes them (router ``ffn_gate_inp``, experts stacked in ``ffn_{gate,up,down}_exps``,
``expert_*`` metadata; a layer without a router is a dense MLP), loaded with ``dtorch.LLM`` on 1 and 2 devices and
compared with the Hugging Face directory / transformers: F32 within 1e-4 relative; Q8_0 experts against
transformers run on the dequantized expert weights."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from dtorch.engine.llm import LLM
from dtorch.models import load_checkpoint, open_checkpoint
from tests.test_qwen3_moe import SCHEDULES, VOCAB, _close, _config, _long_prompt
from tests.tiny_models import save_random

transformers = pytest.importorskip("transformers")

_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _write(hf, directory, path, expert_type: Q) -> dict[str, torch.Tensor]:
    """``path``: a qwen3moe GGUF of the checkpoint in ``directory``; returns the experts as the file holds them
    (dequantized), by stacked HF name."""
    from safetensors.torch import load_file

    c = hf.config
    sd = load_file(directory / "model.safetensors")
    tensors: dict[str, tuple[np.ndarray, Q]] = {}
    stacked: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, t in sd.items():
        a = np.ascontiguousarray(t.float().numpy())
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            g = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
                 "lm_head.weight": "output"}[name] + ".weight"
            tensors[g] = (a, Q.F32)
            continue
        _, _, i, rest = name.split(".", 3)
        if rest.startswith("mlp.experts."):  # mlp.experts.{e}.{proj}.weight
            _, _, e, proj, _ = rest.split(".")
            stacked.setdefault(f"blk.{i}.{_EXPERTS[proj]}.weight", []).append((int(e), a))
            continue
        base, kind = rest.rsplit(".", 1)
        tensors[f"blk.{i}.{_NAMES[base]}.{kind}"] = (a, Q.F32)
    held = {}
    for g, parts in stacked.items():
        a = np.ascontiguousarray(np.stack([x for _, x in sorted(parts, key=lambda p: p[0])]))  # [E, rows, cols]
        data = a if expert_type == Q.F32 else gguf.quants.quantize(a, expert_type)
        tensors[g] = (data, expert_type)
        _, i, kind, _ = g.split(".")
        proj = next(p for p, k in _EXPERTS.items() if k == kind)
        held[f"model.layers.{i}.mlp.experts.{proj}"] = torch.from_numpy(
            np.array(gguf.quants.dequantize(data, expert_type), dtype=np.float32).reshape(a.shape))

    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_vocab_size(c.vocab_size)
    if not c.norm_topk_prob:  # llama.cpp's converter writes nothing (its qwen3moe graph always renormalizes)
        w.add_expert_weights_norm(False)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.fixture(scope="module", params=sorted(SCHEDULES))
def checkpoint(request, tmp_path_factory):
    """(transformers model, HF directory, F32 GGUF, Q8_0-experts GGUF, the Q8_0 file's dequantized experts)."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_random(transformers, _config(request.param), directory)
    f32, q8 = directory / "f32.gguf", directory / "q8_0.gguf"
    _write(hf, directory, f32, Q.F32)
    held = _write(hf, directory, q8, Q.Q8_0)
    return hf, directory, f32, q8, held


def test_config_and_tensors_equal_the_hf_directory(checkpoint):
    hf, directory, f32, _, _ = checkpoint
    want, got = load_checkpoint(directory), load_checkpoint(f32)
    g, c = got.config, want.config
    # the same sparse layers, found by their routers (llama.cpp has no decoder_sparse_step: the dense layers are
    # mlp_only_layers); norm_topk_prob as the file says; the eps a float32 of the file
    assert [g.is_sparse(i) for i in range(4)] == [c.is_sparse(i) for i in range(4)]
    assert g.family == "qwen3_moe" and g.mlp_only_layers and g.decoder_sparse_step == 1
    assert g.rms_norm_eps == pytest.approx(c.rms_norm_eps, rel=1e-6)
    assert replace(g, decoder_sparse_step=c.decoder_sparse_step, mlp_only_layers=c.mlp_only_layers,
                   rms_norm_eps=c.rms_norm_eps) == c
    assert set(got.tensors) == set(want.tensors)
    for name, t in got.tensors.items():
        assert torch.equal(t, want.tensors[name]), name


def test_expert_slices_read_only_those_experts(checkpoint):
    _, _, _, q8, held = checkpoint
    with open_checkpoint(q8) as lazy:
        name = next(n for n in lazy.shapes if n.endswith("mlp.experts.down_proj"))
        full = held[name]
        assert lazy.shapes[name] == tuple(full.shape) and lazy.metadata["tensor_types"][name] == "Q8_0"
        for dim, runs in [(0, [(4, 4)]), (0, [(0, 2), (6, 2)]), (1, [(21, 22)]), (2, [(0, 32)]), (None, [])]:
            want = full if dim is None else torch.cat([full.narrow(dim, a, n) for a, n in runs], dim)
            torch.testing.assert_close(lazy.get(name, dim, runs), want, rtol=0, atol=0)


@pytest.mark.parametrize("n", [1, 2])
def test_f32_logits_match_the_hf_directory(checkpoint, n):
    hf, _, f32, _, _ = checkpoint
    ids = _long_prompt()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    llm = LLM(str(f32), tensor_parallel_size=n, max_num_seqs=4)
    try:
        assert llm.config.num_experts == 8 and (n == 1 or llm.model.layout.expert_parallel)
        got = llm.logits(ids)
        assert got.shape == (len(ids), VOCAB)
        _close(got, want)
    finally:
        llm.close()


@pytest.mark.parametrize("n", [1, 2])
def test_q8_0_experts_match_transformers_on_the_dequantized_weights(checkpoint, n):
    hf, _, _, q8, held = checkpoint
    ref = transformers.AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32).eval()
    ref.load_state_dict(hf.state_dict())
    with torch.no_grad():  # the experts as the file holds them, whatever form transformers keeps them in
        for name, t in held.items():
            _, _, i, _, _, proj = name.split(".")
            experts = ref.model.layers[int(i)].mlp.experts
            if hasattr(experts, "gate_up_proj"):  # transformers 5: fused [E, 2I, H] and [E, H, I]
                if proj == "down_proj":
                    experts.down_proj.copy_(t)
                else:
                    inter = t.shape[1]
                    experts.gate_up_proj[:, (0 if proj == "gate_proj" else inter):][:, :inter].copy_(t)
            else:
                for e in range(t.shape[0]):
                    getattr(experts[e], proj).weight.copy_(t[e])
    ids = _long_prompt()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
        assert not torch.equal(want, hf(torch.tensor([ids])).logits[0])  # the quantization shows
    llm = LLM(str(q8), tensor_parallel_size=n, max_num_seqs=4)
    try:
        _close(llm.logits(ids), want)
    finally:
        llm.close()
