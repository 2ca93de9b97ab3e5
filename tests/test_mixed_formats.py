"""GGUF files that mix formats per tensor, as llama.cpp's Q4_K_M does (attn_v Q6_K beside Q4_K q/k; q/k Q5_0 and v
Q8_0 on 576-wide models): a fused projection whose parts differ in format runs as parts, each kept as stored, on one
device and tensor parallel, with the logits of the same file dequantized at load."""

from __future__ import annotations

import gguf
import pytest
import torch

import dtorch
from dtorch import Shard
from dtorch.engine.llm import LLM
from dtorch.kernels.layouts import row_layout
from dtorch.models.tiny import write_gguf
from tests.tiny_models import families, save_random

transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

FAMILIES = families(transformers, heads=4, kv_heads=2, vocab=128, qwen3_head_dim=16, intermediate_size=128)
IDS = [5, 17, 99, 3, 64, 120, 7, 42, 9, 11, 12, 77]


def mixed(name: str) -> Q:
    """q/k one format and v another; gate and up differ (layer 0's up stays F32: a float part beside a packed one)."""
    if name == "blk.0.ffn_up.weight":
        return Q.F32
    for part, qtype in (("attn_q.", Q.Q4_0), ("attn_k.", Q.Q4_0), ("attn_v.", Q.Q8_0), ("attn_output.", Q.Q4_1),
                        ("ffn_gate.", Q.Q8_0), ("ffn_up.", Q.Q4_1), ("ffn_down.", Q.Q4_0), ("token_embd.", Q.Q8_0),
                        ("output.", Q.Q4_1)):
        if part in name:
            return qtype
    raise AssertionError(name)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def mixed_file(request, tmp_path_factory):
    """(family, path of a GGUF mixing formats per tensor, logits of IDS from the same file dequantized at load)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random(transformers, FAMILIES[request.param](), path)
    write_gguf(hf, path / "mixed.gguf", qtype=mixed)
    floats = LLM(str(path / "mixed.gguf"), dequantize=True, max_num_seqs=2)
    try:
        want = floats.logits(IDS)
    finally:
        floats.close()
    return request.param, str(path / "mixed.gguf"), want


def test_every_projection_stays_in_its_format(mixed_file):
    family, path, want = mixed_file
    llm = LLM(path, max_num_seqs=2)
    try:
        w, c = llm.model.weights, llm.config
        qk, kv = c.q_size + c.kv_size, c.kv_size
        assert llm.model.parts["layers.0.qkv"] == ("layers.0.qkv[0]", "layers.0.qkv[1]")
        assert "layers.0.qkv" not in w
        assert (w["layers.0.qkv[0]"].layout, w["layers.0.qkv[0]"].shape) == ("gguf.q4_0", (qk, c.hidden_size))
        # (a Q8_0 projection may be kept with 16 rows interleaved on AVX-512 VNNI: layouts.row_layout)
        v = w["layers.0.qkv[1]"]
        assert (row_layout(v.layout), v.shape) == ("gguf.q8_0", (kv, c.hidden_size))
        assert [row_layout(w[p].layout) for p in llm.model.parts["layers.1.gate_up"]] == ["gguf.q8_0", "gguf.q4_1"]
        assert [row_layout(w[p].layout) for p in llm.model.parts["layers.0.gate_up"]] == ["gguf.q8_0", "strided"]
        assert w["layers.0.o"].layout == "gguf.q4_1" and w["layers.0.down"].layout == "gguf.q4_0"
        floats = {name for name, t in w.items() if t.layout == "strided" and len(t.shape) == 2}
        assert floats == {"layers.0.gate_up[1]"}, "a weight stored quantized was dequantized"
        with dtorch.dispatcher.disabled("native"):  # the reference kernels: the same products up to rounding
            torch.testing.assert_close(llm.logits(IDS), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        got = llm.logits(IDS)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
        out = llm.generate([IDS], dtorch.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.close()


def test_parts_under_tensor_parallelism(mixed_file):
    family, path, want = mixed_file
    llm = LLM(path, tensor_parallel_size=2, max_num_seqs=2)
    try:
        w, c = llm.model.weights, llm.config
        g, d = c.num_heads // c.num_kv_heads, c.head_dim
        assert w["layers.0.qkv[0]"].placement == Shard(0, (c.q_size, c.kv_size), (g * d, d))  # [q_r | k_r] each
        assert w["layers.0.qkv[1]"].placement == Shard(0, None, d)
        assert w["layers.1.gate_up[1]"].placement == Shard(0)
        assert {row_layout(w[p].layout) for p in llm.model.parts["layers.1.gate_up"]} == {"gguf.q8_0", "gguf.q4_1"}
        with dtorch.dispatcher.disabled("native"):
            torch.testing.assert_close(llm.logits(IDS), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    finally:
        llm.close()


# -- a format that still dequantizes says so, once, at load ---------------------------------------------------------

def _no_layout() -> Q:
    """A GGUF type the kernels do not keep (its d an fp16 scale in the first 2 bytes of each 256-weight block)."""
    from dtorch.kernels.layouts import layout_of_gguf

    return next(q for q in (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ3_XXS, Q.IQ2_S) if layout_of_gguf(q) is None)


@pytest.fixture(scope="module")
def widened_file(tmp_path_factory):
    """A tiny Llama GGUF whose ffn_up matrices are in a format no kernel keeps (random blocks, valid scales)."""
    import numpy as np

    qtype, quantize = _no_layout(), gguf.quants.quantize
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)

    def fake(a, kind):  # gguf-py cannot quantize to it: random blocks with a small fp16 scale
        if kind != qtype:
            return quantize(a, kind)
        raw = rng.integers(0, 256, size=(a.shape[0], a.shape[1] // block, size), dtype=np.uint8)
        raw[..., :2] = np.full(raw.shape[:2] + (1,), 0.01, np.float16).view(np.uint8)
        return raw.reshape(a.shape[0], -1)

    path = tmp_path_factory.mktemp("widened")
    config = families(transformers, heads=4, kv_heads=2, vocab=128, qwen3_head_dim=16, hidden_size=256)["llama"]()
    hf = save_random(transformers, config, path)
    gguf.quants.quantize = fake
    try:
        write_gguf(hf, path / "w.gguf", qtype=lambda name: qtype if ".ffn_up." in name else Q.Q8_0)
    finally:
        gguf.quants.quantize = quantize
    return qtype, str(path / "w.gguf"), config


def test_a_format_that_dequantizes_says_so_once_at_load(widened_file, caplog):
    qtype, path, config = widened_file
    with caplog.at_level("WARNING", logger="dtorch.models"):
        llm = LLM(path, max_num_seqs=2)
    llm.close()
    said = [r.getMessage() for r in caplog.records if r.name == "dtorch.models"]
    assert len(said) == 1, said
    rows, k, layers = config.intermediate_size, config.hidden_size, config.num_hidden_layers
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    as_float, stored = layers * rows * k * 4 / 2**20, layers * rows * k // block * size / 2**20
    assert f"{qtype.name}: {layers} tensors (blk.0.ffn_up.weight, blk.1.ffn_up.weight)" in said[0]
    assert f"{as_float:.1f} MiB instead of {stored:.1f} MiB as stored" in said[0] and "float32" in said[0]


def test_nothing_to_say_when_every_weight_is_kept_or_dequantizing_was_asked_for(widened_file, mixed_file, caplog):
    _, widened, _ = widened_file
    with caplog.at_level("WARNING", logger="dtorch.models"):
        LLM(mixed_file[1], max_num_seqs=2).close()
        LLM(widened, dequantize=True, max_num_seqs=2).close()
    assert not [r for r in caplog.records if r.name == "dtorch.models"]
