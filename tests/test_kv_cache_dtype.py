"""LLM(kv_cache_dtype=...): a KV cache whose dtype is not the activations' (bfloat16 under float32), on the default
model: half the cache's bytes, twice the tokens in the same budget, the same answers; bad values refused by name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import dtorch
from dtorch import LLM
from dtorch.engine.sampling import SamplingParams
from dtorch.models.kv_cache import cache_dtype

PROMPT = ("The lighthouse stood on a rock at the mouth of the harbour, and for two hundred years its keepers kept the "
          "lamp burning through every storm. The first tower was built of timber and burned down within a decade")


def _cache_bytes(llm: LLM) -> int:
    return sum(b.tensor.nbytes for name, t in llm.cache.tensors.items() if "_cache." in name for b in t.blobs.values())


# 32 blocks of 16 float32 tokens of the default model (30 layers x 3 kv heads x 64 x 2 x 4 bytes = 46080 a token):
# less than max_num_seqs sequences of max_model_len need, so the budget decides the blocks
BUDGET = 32 * 16 * 46080


@pytest.fixture(scope="module")
def pair():
    """The default model with a float32 cache and with a bfloat16 one, the same budget."""
    llms = {kv: LLM(max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=BUDGET, kv_cache_dtype=kv)
            for kv in ("auto", "bfloat16")}
    yield llms
    for llm in llms.values():
        llm.close()


def test_a_bfloat16_cache_holds_twice_the_tokens_in_the_same_bytes(pair):
    f32, bf16 = pair["auto"], pair["bfloat16"]
    assert f32.cache.kv_dtype == torch.float32 and bf16.cache.kv_dtype == torch.bfloat16
    assert bf16.cache.tensors["k_cache.0"].blobs[0].tensor.dtype == torch.bfloat16
    assert f32.cache.num_blocks == 32 and bf16.cache.num_blocks == 64
    assert _cache_bytes(bf16) == _cache_bytes(f32) == BUDGET


def test_the_logits_stay_those_of_the_float32_cache(pair):
    """Each key and value rounded once to bfloat16 (8 bits of mantissa) moves the logits little: the same top-1 at
    every position of a prompt, and the same greedy answer."""
    ids = pair["auto"].tokenizer.encode(PROMPT)
    want, got = (pair[kv].logits(ids).float() for kv in ("auto", "bfloat16"))
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max() < 0.25 * want.std()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    a, b = (pair[kv].generate("The capital of France is", params)[0].outputs[0].token_ids
            for kv in ("auto", "bfloat16"))
    assert a == b


def test_speculation_over_a_bfloat16_cache_keeps_the_greedy_ids(pair):
    """Verify steps write and read the rounded keys as decode steps do: the same ids with drafts as without."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = "Repeat exactly: " + PROMPT + "\n\n"
    plain = pair["bfloat16"].generate(prompt, params)[0].outputs[0].token_ids
    spec = LLM(max_model_len=256, max_num_seqs=2, kv_cache_memory_bytes=BUDGET, kv_cache_dtype="bfloat16",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                   "prompt_lookup_min": 2})
    try:
        assert spec.generate(prompt, params)[0].outputs[0].token_ids == plain
        assert spec.engine.stats().spec_draft_tokens > 0
        assert spec.engine.blocks.num_free == spec.engine.blocks.num_blocks  # every block back
    finally:
        spec.close()


# the families whose attention differs: sliding windows (gemma3), a hybrid of gated delta nets beside attention
# (qwen3_next: its states stay in the activations' dtype), experts (qwen3_moe)
FAMILIES = {"gemma3": dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=4),
            "qwen3_next": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
            "qwen3_moe": {}}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_kind_of_attention_reads_a_bfloat16_cache(family, tmp_path):
    """Prompt logits, the bfloat16 cache against the float32 one."""
    transformers = pytest.importorskip("transformers")
    from tests.tiny_models import save_random, tiny_config

    save_random(transformers, tiny_config(transformers, family, **FAMILIES[family]), tmp_path)
    ids = [5, 17, 3, 99, 42, 8, 61, 23, 77, 12]
    got = {}
    for kv in ("auto", "bfloat16"):
        llm = LLM(str(tmp_path), max_model_len=64, max_num_seqs=2, kv_cache_dtype=kv, enable_prefix_caching=False)
        try:
            assert llm.cache.tensors[next(n for n in llm.cache.tensors if "k_cache" in n)].dtype == \
                (torch.bfloat16 if kv == "bfloat16" else torch.float32)
            # the last logits of each prefix of the prompt (a fresh prefill each), then every row of the whole prompt
            steps = [llm.logits(ids[:i + 1])[-1] for i in range(len(ids))]
            got[kv] = torch.stack(steps).float(), llm.logits(ids).float()
        finally:
            llm.close()
    for want, have in zip(got["auto"], got["bfloat16"], strict=True):
        assert torch.isfinite(have).all()
        assert (have - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("value", ["auto", None, "bfloat16", "bf16", "float16", "float32", torch.bfloat16])
def test_the_names_it_takes(value):
    want = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
            "float32": torch.float32}.get(value, torch.bfloat16 if value is torch.bfloat16 else torch.float32)
    assert cache_dtype(value, torch.float32) == want


@pytest.mark.parametrize("value", ["int8", "fp8", torch.int8, 16, ""])
def test_a_bad_value_is_refused_by_name(value):
    with pytest.raises(dtorch.ArgumentError, match="kv_cache_dtype"):
        LLM(kv_cache_dtype=value)


def test_info_reports_the_cache_dtype_and_its_bytes():
    out = {}
    for kv in ("auto", "bfloat16"):
        proc = subprocess.run([sys.executable, "-m", "dtorch", "info", "--json", "--ctx", "1024",
                               "--kv-cache-dtype", kv], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        out[kv] = json.loads(proc.stdout)
    assert out["auto"]["kv_cache_dtype"] == "float32" and out["bfloat16"]["kv_cache_dtype"] == "bfloat16"
    assert out["bfloat16"]["kv_bytes_per_token"] * 2 == out["auto"]["kv_bytes_per_token"]
    assert out["bfloat16"]["kv_cache_bytes"] * 2 == out["auto"]["kv_cache_bytes"]
