"""16-bit weights stay 16-bit (layouts "f16" and "bf16") in a model computing in float32: the reference kernels
against torch, and F16 / BF16 GGUF files loaded on one device and tensor parallel against the same file widened at
load."""

from __future__ import annotations

import copy

import gguf
import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Shard
from dtorch.core.device import Device
from dtorch.dispatch import KernelKey
from dtorch.dispatch.context import KernelContext, KernelParams
from dtorch.engine.llm import LLM
from dtorch.kernels.half import HALF_LAYOUTS, half_layout
from dtorch.models.tiny import write_gguf
from tests.tiny_models import families, save_random

transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType
IDS = [5, 17, 99, 3, 64, 120, 7, 42, 9, 11, 12, 77]


def _kernel(op: str, dtype: torch.dtype, layout: str):
    return dtorch.dispatcher.explain(KernelKey(op, "cpu", dtype, layout)).winner.fn


@pytest.mark.parametrize("layout", sorted(HALF_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("panel", [None, 3 * 64 * 4], ids=["one-panel", "panels-of-3-rows"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_linear_reads_the_16_bit_weight(layout, dtype, panel, bias, monkeypatch):
    from dtorch.kernels.torch import half

    if panel is not None:
        monkeypatch.setattr(half, "PANEL_BYTES", panel)
    w = torch.randn(10, 64).to(HALF_LAYOUTS[layout])
    x = torch.randn(2, 5, 64, dtype=dtype)
    b = torch.randn(10, dtype=dtype) if bias else None
    out = torch.empty(2, 5, 10, dtype=dtype)
    _kernel("matmul.linear", dtype, layout)(KernelContext(Device("cpu")), (x, w, b), (out,))
    # x @ w.to(x.dtype).T: exact in float64 from the values the kernel multiplies, then rounded once to x's dtype
    want = F.linear(x.double(), w.to(dtype).double(), None if b is None else b.double())
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    torch.testing.assert_close(out.double(), want, rtol=rtol, atol=atol * float(want.abs().max()))


@pytest.mark.parametrize("layout", sorted(HALF_LAYOUTS))
@pytest.mark.parametrize("start", [None, 4], ids=["whole", "vocab-piece"])
def test_embedding_converts_only_the_rows_it_reads(layout, start):
    w = torch.randn(8, 16).to(HALF_LAYOUTS[layout])
    ids = torch.tensor([[3, 0], [7, 5]])
    out = torch.empty(2, 2, 16)
    params = KernelParams() if start is None else KernelParams(vocab_start=start)
    _kernel("llm.embedding", torch.float32, layout)(KernelContext(Device("cpu"), params=params), (w, ids), (out,))
    if start is None:
        want = w.float()[ids]
    else:  # rows 4..11 of the vocabulary: ids below 4 read zeros here (another device holds them)
        local = (ids - start).clamp(min=0)
        want = torch.where((ids >= start)[..., None], w.float()[local], torch.zeros(()))
    assert torch.equal(out, want)


def test_half_layout_names():
    assert half_layout(torch.float16) == "f16" and half_layout(torch.bfloat16) == "bf16"
    assert half_layout(torch.float32) is None


# -- F16 / BF16 GGUF files ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["F16", "BF16"])
def half_file(request, tmp_path_factory):
    """(GGUF type name, a tiny Llama GGUF whose matrices are all that type, logits of IDS from it widened at load)."""
    path = tmp_path_factory.mktemp(request.param)
    config = families(transformers, heads=4, kv_heads=2, vocab=128, qwen3_head_dim=16)["llama"]()
    hf = save_random(transformers, config, path)
    write_gguf(hf, path / "half.gguf", qtype=lambda name: Q[request.param])
    floats = LLM(str(path / "half.gguf"), dequantize=True, max_num_seqs=2)
    try:
        want, float_bytes = floats.logits(IDS), floats.model.weight_bytes()
    finally:
        floats.close()
    return request.param, str(path / "half.gguf"), want, float_bytes


def test_a_16_bit_file_stays_16_bit(half_file):
    kind, path, want, float_bytes = half_file
    llm = LLM(path, max_num_seqs=2)
    try:
        layout = kind.lower()
        matrices = {n: t for n, t in llm.model.weights.items() if len(t.shape) == 2}
        assert {t.layout for t in matrices.values()} == {layout}, "a 16-bit weight was widened"
        assert all(t.dtype == torch.float32 for t in matrices.values())  # the activations' dtype: the kernels' key
        assert matrices["embed"].local(0).dtype == HALF_LAYOUTS[layout]
        assert llm.model.weight_bytes() < 0.55 * float_bytes
        torch.testing.assert_close(llm.logits(IDS), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        out = llm.generate([IDS], dtorch.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.close()


def test_16_bit_weights_under_tensor_parallelism(half_file):
    kind, path, want, _ = half_file
    llm = LLM(path, tensor_parallel_size=2, max_num_seqs=2)
    try:
        o = llm.model.weights["layers.0.o"]
        assert o.layout == kind.lower() and isinstance(o.placement, Shard) and o.placement.dim == 1  # K split
        torch.testing.assert_close(llm.logits(IDS), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    finally:
        llm.close()


def test_a_model_computing_in_the_weights_dtype_reads_them_as_plain_tensors(half_file):
    kind, path, _, _ = half_file
    llm = LLM(path, dtype=HALF_LAYOUTS[kind.lower()], max_num_seqs=2)
    try:
        assert {t.layout for t in llm.model.weights.values()} == {"strided"}
    finally:
        llm.close()


# -- Hugging Face checkpoints stored in 16 bits ----------------------------------------------------------------------

@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_16_bit_hugging_face_checkpoint_stays_16_bit(tmp_path, stored, n):
    config = families(transformers, heads=4, kv_heads=2, vocab=128, qwen3_head_dim=16)["qwen3"]()
    hf = save_random(transformers, config, tmp_path / "f32")
    with torch.no_grad():  # the values the file holds, computed in float32 (the RoPE buffers stay float32)
        for p in hf.parameters():
            p.copy_(p.to(stored))
    copy.deepcopy(hf).to(stored).save_pretrained(tmp_path / "half")
    llm = LLM(str(tmp_path / "half"), tensor_parallel_size=n, max_num_seqs=2)
    try:
        matrices = {name: t for name, t in llm.model.weights.items() if len(t.shape) == 2}
        assert {t.layout for t in matrices.values()} == {half_layout(stored)}
        with torch.no_grad():
            want = hf(torch.tensor([IDS])).logits[0]
        torch.testing.assert_close(llm.logits(IDS), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    finally:
        llm.close()
