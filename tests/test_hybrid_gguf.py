"""Qwen3-Next (``qwen3next``) and Qwen3.5 text (``qwen35``) GGUF files: tiny random transformers models written the
way llama.cpp's ``convert_hf_to_gguf.py`` writes them (the test-side ``_convert`` below: its tensor changes and
metadata keys, the names from the ``gguf`` package's own tables), read back with dtorch's GGUF loader and compared
with transformers: the config field by field, every tensor the model reads (F32: equal up to the rounding of
undoing ``+ 1`` and ``-exp``; Q8_0 projections: within the quantization error), and the logits of ``dtorch.LLM``."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import dtorch
from dtorch.engine.llm import LLM
from dtorch.kernels.layouts import row_layout
from dtorch.models import open_checkpoint
from dtorch.models.config import ModelConfig
from tests.tiny_models import random_model, tiny_config

transformers = pytest.importorskip("transformers")

VOCAB = 128
# GGUF: full_attention_interval 4
COMMON = dict(vocab_size=VOCAB, layer_types=["linear_attention"] * 3 + ["full_attention"])
FAMILIES = {  # dtorch family -> (GGUF architecture, transformers config)
    "qwen3_next": ("qwen3next", lambda: tiny_config(transformers, "qwen3_next", **COMMON,
                                                    shared_expert_intermediate_size=64)),
    "qwen3_5_text": ("qwen35", lambda: tiny_config(transformers, "qwen3_5_text", **COMMON)),
}
# the 2-D / 3-D projections the Q8_0 files quantize (llama.cpp keeps norms, ssm_a, ssm_dt and the conv in F32)
_QUANTIZED = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "attn_gate", "ssm_out", "ffn_gate", "ffn_up",
              "ffn_down", "_exps", "_shexp")


def _v_heads_tiled(t: torch.Tensor, dim: int, c) -> torch.Tensor:
    """Qwen3.5's converter: value heads grouped by key head [nk, r, d] -> tiled [r, nk, d] along ``dim``."""
    nk, r = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads
    shape = list(t.shape)
    return t.unflatten(dim, (nk, r, -1)).transpose(dim, dim + 1).reshape(shape)


def _linear_attn(name: str, t: torch.Tensor, arch: str, c) -> list[tuple[str, torch.Tensor]]:
    """One ``linear_attn.*`` tensor as the converter changes it (HF names; renamed by the gguf tables after)."""
    kd = c.linear_num_key_heads * c.linear_key_head_dim
    if arch == "qwen35":  # the value heads tiled, wherever they index a dim
        if name.endswith("in_proj_qkv.weight"):
            t = torch.cat([t[:2 * kd], _v_heads_tiled(t[2 * kd:], 0, c)])
        elif name.endswith(("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
            t = _v_heads_tiled(t, 0, c)
        elif name.endswith("conv1d.weight"):
            t = torch.cat([t[:2 * kd], _v_heads_tiled(t[2 * kd:], 0, c)])
        elif name.endswith("out_proj.weight"):
            t = _v_heads_tiled(t, 1, c)
    if name.endswith("A_log"):
        return [(name, -torch.exp(t))]
    if name.endswith("dt_bias"):
        return [(name.removesuffix("dt_bias") + "dt_proj.bias", t)]
    if name.endswith("conv1d.weight"):
        return [(name, t.squeeze(1))]
    if name.endswith("in_proj_qkvz.weight"):  # per key head [q | k | v | z] -> [all q | all k | all v], [all z]
        dk, vr = c.linear_key_head_dim, c.linear_num_value_heads // c.linear_num_key_heads * c.linear_value_head_dim
        q, k, v, z = t.unflatten(0, (c.linear_num_key_heads, -1)).split([dk, dk, vr, vr], 1)
        base = name.removesuffix("in_proj_qkvz.weight")
        return [(base + "in_proj_qkv.weight", torch.cat([x.reshape(-1, t.shape[1]) for x in (q, k, v)])),
                (base + "in_proj_z.weight", z.reshape(-1, t.shape[1]))]
    return [(name, t)]


def _convert(hf, arch: str, path, quantize: bool) -> None:
    """``path``: a GGUF of ``hf`` as llama.cpp's converter writes it (``quantize``: the projections in Q8_0)."""
    c = hf.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3NEXT if arch == "qwen3next" else gguf.MODEL_ARCH.QWEN35,
                                     c.num_hidden_layers)
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in hf.state_dict().items():
        t = t.detach().float()
        if name.endswith("norm.weight") and ".linear_attn." not in name:
            t = t + 1  # the (1 + weight) norms are stored with the 1 added
        if ".linear_attn." in name:
            out += _linear_attn(name, t, arch, c)
        elif name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows first
            inter = t.shape[1] // 2
            out += [(name.replace("gate_up_proj", "gate_proj"), t[:, :inter]),
                    (name.replace("gate_up_proj", "up_proj"), t[:, inter:])]
        else:
            out.append((name, t))
    w = gguf.GGUFWriter(str(path), arch)
    out = [(n + ".weight" if ".experts." in n else n, t) for n, t in out]  # stacked experts: ffn_*_exps.weight
    for name, t in out:
        g = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert g is not None, name
        a = np.ascontiguousarray(t.numpy())
        if quantize and a.ndim >= 2 and a.shape[-1] % 32 == 0 and any(k in g for k in _QUANTIZED):
            w.add_tensor(g, gguf.quants.quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(g, a, raw_dtype=Q.F32)
    _metadata(w, c, arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _metadata(w, c, arch: str, **override) -> None:
    """The keys the converter writes for these models; ``override``: key suffix -> value (None: left out)."""
    rope = c.rope_parameters
    interval = c.layer_types.index("full_attention") + 1
    keys = {"context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
            "block_count": c.num_hidden_layers, "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
            "rope.freq_base": float(rope["rope_theta"]), "attention.layer_norm_rms_epsilon": c.rms_norm_eps,
            "attention.key_length": c.head_dim, "attention.value_length": c.head_dim, "vocab_size": c.vocab_size,
            "ssm.conv_kernel": c.linear_conv_kernel_dim, "ssm.state_size": c.linear_key_head_dim,
            "ssm.group_count": c.linear_num_key_heads, "ssm.time_step_rank": c.linear_num_value_heads,
            "ssm.inner_size": c.linear_value_head_dim * c.linear_num_value_heads,
            "full_attention_interval": interval,
            "rope.dimension_count": int(c.head_dim * rope["partial_rotary_factor"])}
    if arch == "qwen3next":
        keys |= {"expert_count": c.num_experts, "expert_used_count": c.num_experts_per_tok,
                 "expert_feed_forward_length": c.moe_intermediate_size,
                 "expert_shared_feed_forward_length": c.shared_expert_intermediate_size}
    for k, v in (keys | override).items():
        if v is None:
            continue
        if isinstance(v, float):
            w.add_float32(f"{arch}.{k}", v)
        else:
            w.add_uint32(f"{arch}.{k}", v)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _hf_tensors(hf) -> dict[str, torch.Tensor]:
    """The transformers state dict in the loaders' form (experts as stacked gate_proj / up_proj / down_proj)."""
    out = {}
    for name, t in hf.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            inter = t.shape[1] // 2
            out[name.replace("gate_up_proj", "gate_proj")] = t[:, :inter]
            out[name.replace("gate_up_proj", "up_proj")] = t[:, inter:]
        else:
            out[name] = t
    return out


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def files(request, tmp_path_factory):
    """(family, transformers model, F32 GGUF, Q8_0-projections GGUF)."""
    arch, config = FAMILIES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = random_model(transformers, config())
    f32, q8 = directory / "f32.gguf", directory / "q8_0.gguf"
    _convert(hf, arch, f32, quantize=False)
    _convert(hf, arch, q8, quantize=True)
    return request.param, hf, f32, q8


def test_config_equals_transformers(files):
    family, hf, f32, _ = files
    want = ModelConfig.from_hf(hf.config.to_dict())
    with open_checkpoint(f32) as lazy:
        got = lazy.config
    assert got.family == family and got.layer_types == want.layer_types and got.rotary_dim == 4
    for name in ModelConfig.__slots__:
        g, w = getattr(got, name), getattr(want, name)
        if name == "rms_norm_eps":  # the file holds a float32
            assert g == pytest.approx(w, rel=1e-6), name
        else:
            assert g == w, name


def test_every_tensor_is_transformers(files):
    _, hf, f32, _ = files
    want = _hf_tensors(hf)
    with open_checkpoint(f32) as lazy:
        assert set(lazy.shapes) == set(want)
        for name, shape in lazy.shapes.items():
            got = lazy.get(name)
            assert tuple(got.shape) == shape == tuple(want[name].shape), name
            if name.endswith(("A_log", "norm.weight")) and ".linear_attn.norm" not in name:
                # log(-(-exp(x))) and (w + 1) - 1 round in float32
                torch.testing.assert_close(got, want[name], rtol=1e-6, atol=2e-7, msg=name)
            else:
                assert torch.equal(got, want[name]), name


def test_slices_of_changed_tensors(files):
    family, _, f32, q8 = files
    fused = "in_proj_qkvz" if family == "qwen3_next" else "in_proj_qkv"
    for path in (f32, q8):
        with open_checkpoint(path) as lazy:
            for name, dim, runs in [(f"model.layers.0.linear_attn.{fused}.weight", 0, [(8, 40), (100, 28)]),
                                    (f"model.layers.0.linear_attn.{fused}.weight", 1, [(32, 32)]),
                                    ("model.layers.1.linear_attn.out_proj.weight", 1, [(16, 16), (48, 16)]),
                                    ("model.layers.1.linear_attn.conv1d.weight", 0, [(64, 64)]),
                                    ("model.layers.2.linear_attn.A_log", 0, [(1, 2)])]:
                full = lazy.get(name)
                want = torch.cat([full.narrow(dim, a, n) for a, n in runs], dim)
                assert torch.equal(lazy.get(name, dim, runs), want), (path.name, name, dim)


def test_q8_0_projections_are_transformers_within_the_quantization_error(files):
    family, hf, _, q8 = files
    want = _hf_tensors(hf)
    fused = "in_proj_qkvz" if family == "qwen3_next" else "in_proj_qkv"
    with open_checkpoint(q8) as lazy:
        types = lazy.metadata["tensor_types"]
        assert types[f"model.layers.0.linear_attn.{fused}.weight"] == "Q8_0"
        assert types["model.layers.0.linear_attn.A_log"] == "F32"
        for name in lazy.shapes:
            w = want[name]
            # Q8_0: a scale per 32 values, each value within half a step of max|block| / 127
            atol = float(w.abs().max()) / 127 if types[name] == "Q8_0" else 2e-7
            torch.testing.assert_close(lazy.get(name), w, rtol=1e-6, atol=atol, msg=name)
        # the reordered / joined projections are served packed too: their rows dequantize to what ``get`` gives
        from dtorch.kernels.layouts import layout_of_gguf

        name = f"model.layers.0.linear_attn.{fused}.weight"
        layout, rows = lazy.get_packed(name, 0, [(32, 64)])
        assert layout == layout_of_gguf(Q.Q8_0)
        deq = gguf.quants.dequantize(rows.numpy(), Q.Q8_0)
        assert torch.equal(torch.from_numpy(np.array(deq, dtype=np.float32)), lazy.get(name, 0, [(32, 64)]))
        # Qwen3.5's out_proj has its columns reordered: dequantized, not packed
        assert (lazy.get_packed("model.layers.0.linear_attn.out_proj.weight") is None) == (family == "qwen3_5_text")


def _prompt(n: int = 40) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def test_f32_logits_match_transformers(files):
    _, hf, f32, _ = files
    ids = _prompt()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    try:
        llm = LLM(str(f32), max_num_seqs=4)
    except dtorch.ModelError as e:
        if "not supported" in str(e):
            pytest.skip(f"the model side does not run this family yet: {e}")
        raise
    try:
        got = llm.logits(ids)
        assert got.shape == (len(ids), VOCAB)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    finally:
        llm.close()


def test_a_q8_0_file_on_two_devices_equals_one(files):
    """The Q8_0 file (projections kept packed where the file's rows allow) split over DeviceMesh.cpu(2): every
    weight and state by key heads; the same logits and greedy ids as one device."""
    family, _, _, q8 = files
    ids = _prompt(70)
    one, two = LLM(str(q8), max_num_seqs=2), LLM(str(q8), tensor_parallel_size=2, max_num_seqs=2)
    try:
        want = one.logits(ids)
        # the projections split over K sum their halves in another order, and where the prompt's rows are quantized
        # to int8 levels (every row count with AVX-512 VNNI) a last-bit difference can move a level by one in a later
        # layer: ~1e-4 of the logits' scale, where a wrong shard would be O(1)
        torch.testing.assert_close(two.logits(ids), want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))
        params = dtorch.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        got, want = (m.generate([ids[:9]], params)[0].outputs[0].token_ids for m in (two, one))
        assert got == want
        # packed and split on K by heads, except Qwen3.5's out_proj, whose columns the file reorders (dequantized);
        # the fused input projection mixes Q8_0 and F32 parts in these files, so it is dequantized too
        lay = {name: row_layout(w.layout) for name, w in two.model.weights.items()}  # (x16: layouts.row_layout)
        assert lay["layers.0.lin_out"] == ("gguf.q8_0" if family == "qwen3_next" else "strided")
        assert lay["layers.3.qkv"] == "gguf.q8_0"
    finally:
        one.close()
        two.close()


def _write_bad(tmp_path, drop: str = "", **override) -> str:
    """A qwen3next F32 file without tensor ``drop`` and with metadata ``override``."""
    hf = random_model(transformers, FAMILIES["qwen3_next"][1]())
    path = tmp_path / "bad.gguf"
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3NEXT, 4)
    w = gguf.GGUFWriter(str(path), "qwen3next")
    for name, t in hf.state_dict().items():
        t = t.detach().float()
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = t.chunk(2, 1)
            parts = [(name.replace("gate_up_proj", "gate_proj"), gate), (name.replace("gate_up_proj", "up_proj"), up)]
        else:
            parts = _linear_attn(name, t, "qwen3next", hf.config) if ".linear_attn." in name else [(name, t)]
        for n, x in parts:
            g = names.get_name(n + ".weight" if ".experts." in n else n, try_suffixes=(".weight", ".bias"))
            if g != drop:
                w.add_tensor(g, np.ascontiguousarray(x.numpy()), raw_dtype=Q.F32)
    _metadata(w, hf.config, "qwen3next", **override)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("drop, override, match", [
    ("blk.1.ssm_a", {}, "A_log"),
    ("blk.3.ffn_gate_inp_shexp.weight", {}, "shared_expert_gate"),
    ("blk.0.attn_gate.weight", {}, "blk.0.attn_gate.weight"),
    ("", {"ssm.inner_size": 62}, "qwen3next.ssm.inner_size"),
    ("", {"full_attention_interval": 0}, "qwen3next.full_attention_interval"),
    ("", {"expert_shared_feed_forward_length": None}, "qwen3next.expert_shared_feed_forward_length"),
    ("", {"rope.dimension_count": 5}, "qwen3next.rope.dimension_count"),
])
def test_bad_files_are_refused_by_name(tmp_path, drop, override, match):
    path = _write_bad(tmp_path, drop, **override)
    with pytest.raises(dtorch.ModelError, match=match.replace(".", r"\.")):
        open_checkpoint(path).close()

