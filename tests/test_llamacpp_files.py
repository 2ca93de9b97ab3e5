"""GGUF files made by llama.cpp's own quantizer (``tests/data/llamacpp/``, made by ``bench/llamacpp_fixtures.py``;
llama.cpp is not needed here): dtorch keeps every quantized weight in its own format, with no float copy (issue
#21), and its logits agree with transformers run on the same file dequantized by gguf-py.

``qwen3-256-*``: every row a multiple of 256, so the K-quant presets write K-quants and mix them (Q4_K_M: Q4_K with
Q6_K on attn_v, ffn_down and the tied embedding). ``llama-576-*``: rows of 576 (SmolLM2's width) and 64, so llama.cpp
falls back to Q5_0 / Q5_1 / Q8_0 / IQ4_NL, as it does for every tensor of SmolLM2 and Qwen2.5-0.5B.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import gguf
import pytest
import torch
from test_quantized_model import _stepwise_logits

import dtorch
from dtorch.engine.llm import LLM
from dtorch.kernels.layouts import row_layout
from tests.tiny_models import transformers_from_gguf

DATA = Path(__file__).parent / "data" / "llamacpp"
FLOAT_TYPES = ("F32", "F16", "BF16")
# what llama.cpp 0.3.36 wrote into each file (tensor type -> count, gguf-py's reading): the formats each file exercises
TYPES = {
    "qwen3-256-Q4_K_M": {"F32": 5, "Q4_K": 5, "Q6_K": 3},
    "qwen3-256-Q5_K_M": {"F32": 5, "Q5_K": 5, "Q6_K": 3},
    "qwen3-256-Q6_K": {"F32": 5, "Q6_K": 8},
    "qwen3-256-Q8_0": {"F32": 5, "Q8_0": 8},
    "qwen3-256-Q2_K": {"F32": 5, "Q2_K": 4, "Q3_K": 2, "Q4_K": 1, "Q6_K": 1},
    "qwen3-256-Q3_K_M": {"F32": 5, "Q3_K": 4, "Q4_K": 2, "Q5_K": 1, "Q6_K": 1},
    "qwen3-256-IQ4_XS": {"F32": 5, "IQ4_XS": 6, "Q5_K": 1, "Q6_K": 1},
    "qwen3-256-IQ4_NL": {"F32": 5, "IQ4_NL": 6, "Q5_K": 1, "Q6_K": 1},
    "qwen3-256-Q5_0": {"F32": 5, "Q5_0": 7, "Q6_K": 1},
    "qwen3-256-Q5_1": {"F32": 5, "Q5_1": 7, "Q6_K": 1},
    "qwen3-256-Q4_0": {"F32": 5, "Q4_0": 7, "Q6_K": 1},
    "qwen3-256-Q4_1": {"F32": 5, "Q4_1": 7, "Q6_K": 1},
    "llama-576-Q4_K_M": {"F32": 3, "Q5_0": 5, "Q8_0": 3},
    "llama-576-Q5_K_M": {"F32": 3, "Q5_1": 5, "Q8_0": 3},
    "llama-576-Q6_K": {"F32": 3, "Q8_0": 8},
    "llama-576-IQ4_XS": {"F32": 3, "IQ4_NL": 7, "Q8_0": 1},
}
FILES = list(TYPES)
TIE = 0.1
IDS = [1, 45, 300, 17, 99, 250, 12, 7, 301, 64, 128, 33, 210, 5, 77, 160]  # every file's vocab has 320 tokens or more


def _path(name: str) -> Path:
    return DATA / f"{name}.gguf"


def _file_types(name: str) -> dict[str, str]:
    """Tensor name -> GGUF type name, as gguf-py reads the file."""
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(_path(name))).tensors}


_llms: dict[str, LLM] = {}


@pytest.fixture(scope="module")
def llm():
    def get(name: str) -> LLM:
        if name not in _llms:
            _llms[name] = LLM(_path(name), max_model_len=64, max_num_seqs=1)
        return _llms[name]

    yield get
    for m in _llms.values():
        m.close()
    _llms.clear()


def test_the_fixtures_hold_the_formats_they_are_for():
    """Each file holds what llama.cpp's quantizer wrote for its preset (the README of tests/data/llamacpp)."""
    assert sorted(p.stem for p in DATA.glob("*.gguf")) == sorted(FILES)
    for name, want in TYPES.items():
        assert dict(Counter(_file_types(name).values())) == want, name


@pytest.mark.parametrize("name", FILES)
def test_every_quantized_weight_stays_in_its_format(name, llm):
    """Every 2-D tensor of these files is stored quantized: dtorch holds none of them as float ("strided"), holds each
    of the file's formats as its layout, and its weights take no more memory than the file's tensors (+10% for
    re-laid-out rows)."""
    types = _file_types(name)
    quantized = {t for t in types.values() if t not in FLOAT_TYPES}
    model = llm(name).model
    unique = {id(w): w for w in model.weights.values()}.values()  # a tied head is the embedding: once
    floats = sorted(n for n, w in model.weights.items() if len(w.shape) == 2 and w.layout == "strided")
    assert not floats, f"{name}: held as float: {floats}; the file has {sorted(Counter(types.values()).items())}"
    # the row layout of each (Q5_0 / Q8_0 projections may be held with 16 rows interleaved, "gguf.q5_0x16")
    assert {row_layout(w.layout) for w in unique if len(w.shape) == 2} == {f"gguf.{t.lower()}" for t in quantized}
    held = sum(b.tensor.numel() * b.tensor.element_size() for w in unique for b in w.blobs.values())
    stored = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(_path(name))).tensors)
    assert held <= 1.1 * stored, f"{name}: the weights take {held} bytes, {stored} in the file"


def _reference(name: str) -> torch.Tensor:
    """transformers' logits [T, V] for IDS, its weights the file's tensors dequantized by gguf-py (transformers' own
    GGUF reader: gguf.dequantize, its names, llama's q/k un-permuted)."""
    hf = transformers_from_gguf(_path(name))
    with torch.no_grad():
        return hf(torch.tensor([IDS])).logits[0].float()


def _nmse(got: torch.Tensor, want: torch.Tensor) -> float:
    """Normalized mean squared error, llama.cpp test-backend-ops' measure for quantized products."""
    return ((got - want) ** 2).sum().item() / (want ** 2).sum().item()


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
@pytest.mark.parametrize("name", FILES)
def test_logits_agree_with_transformers_on_the_dequantized_file(name, native, llm):
    """dtorch's logits of a 16-token prompt, whole (prefill) and one token per step (decode), against transformers on
    the dequantized weights: NMSE at most 1e-3 (native kernels may quantize activations to 8 bits, as llama.cpp does;
    a misread format gives NMSE ~1), and the same top-1 token at every position, up to near-ties (a token whose
    reference logit is within TIE of the best; the logits' std is about 1.7)."""
    want = _reference(name)
    m = llm(name)
    with dtorch.dispatcher.disabled(*(() if native else ("native",))):
        for how, got in (("prefill", m.logits(IDS)), ("decode", _stepwise_logits(m, IDS))):
            assert got.shape == want.shape
            err = _nmse(got, want)
            assert err <= 1e-3, f"{name} {how}: NMSE {err:.2e}"
            top = want.gather(1, got.argmax(-1, keepdim=True))[:, 0]  # the reference's logit of dtorch's top-1
            worse = (want.max(-1).values - top > TIE).nonzero().flatten().tolist()
            assert not worse, f"{name} {how}: top-1 differs at positions {worse}"
