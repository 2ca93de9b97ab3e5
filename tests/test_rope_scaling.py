"""YaRN and LongRoPE against transformers: inverse frequencies and attention factors of real configs' settings
against ``ROPE_INIT_FUNCTIONS``; tiny random Qwen2 / Qwen3 (YaRN) and Phi-3 (LongRoPE, both factor lists) whose
logits equal transformers', loaded from their directories and from GGUF files written with the keys and tensors
llama.cpp's converter writes; a GGUF's rope scaling keys read as llama.cpp reads them."""

from __future__ import annotations

import math

import pytest
import torch

from dtorch.core.errors import ModelError
from dtorch.models.config import ModelConfig, rope_attention_factor, rope_inv_freq
from dtorch.models.tiny import write_gguf
from tests.tiny_models import save_random, tiny_config

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

_G = torch.Generator().manual_seed(0)
# Phi-3-mini-128k's shape of head (96, all rotated), 4k original context, 128k positions; factors drawn here
PHI3_LONG = [1.0 + 3 * float(x) for x in torch.rand(48, generator=_G)]
PHI3_SHORT = [1.0 + 0.2 * float(x) for x in torch.rand(48, generator=_G)]
REAL = {  # name -> (transformers config class, its fields)
    "qwen2.5-yarn": ("Qwen2Config", dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                                         max_position_embeddings=131072,
                                         rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 4.0,
                                                                       "original_max_position_embeddings": 32768})),
    "qwen3-yarn": ("Qwen3Config", dict(hidden_size=2048, num_attention_heads=16, head_dim=128, rope_theta=1e6,
                                       max_position_embeddings=131072,
                                       rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 32768})),
    # DeepSeek's spelling: betas, mscale and mscale_all_dim (their ratio is the attention factor)
    "deepseek-yarn": ("LlamaConfig", dict(hidden_size=2048, num_attention_heads=16, max_position_embeddings=163840,
                                          rope_theta=10000.0,
                                          rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                                        "mscale": 1.0, "mscale_all_dim": 0.707,
                                                        "original_max_position_embeddings": 4096})),
    "yarn-attention-factor": ("Qwen2Config", dict(hidden_size=1024, num_attention_heads=8, rope_theta=1e6,
                                                  max_position_embeddings=65536,
                                                  rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                                                "attention_factor": 1.3, "truncate": False,
                                                                "original_max_position_embeddings": 32768})),
    "phi3-128k-longrope": ("Phi3Config", dict(hidden_size=3072, num_attention_heads=32, rope_theta=10000.0,
                                              max_position_embeddings=131072, original_max_position_embeddings=4096,
                                              rope_scaling={"type": "longrope", "long_factor": PHI3_LONG,
                                                            "short_factor": PHI3_SHORT})),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_frequencies_and_attention_factor_equal_transformers(name):
    cls, fields = REAL[name]
    hf = getattr(transformers, cls)(vocab_size=256, intermediate_size=64, num_hidden_layers=1, bos_token_id=1,
                                    eos_token_id=2, pad_token_id=0,
                                    **{"num_key_value_heads": fields["num_attention_heads"]} | fields)
    ours = ModelConfig.from_hf(hf.to_dict())
    kind = ours.rope_scaling["rope_type"]
    assert kind == hf.rope_parameters["rope_type"]
    old = hf.rope_parameters["original_max_position_embeddings"]
    for context in ((old, old * 2) if kind == "longrope" else (None,)):
        # transformers picks LongRoPE's long factors for sequences past the original context
        want, want_factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu", seq_len=context)
        got = rope_inv_freq(ours, context=context)
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
        assert rope_attention_factor(ours) == pytest.approx(want_factor, rel=1e-6)


# config.json as the models ship it (transformers 4 spelling: rope_theta and rope_scaling at the top, "type"; Phi-3's
# original context beside rope_scaling, its first LongRoPE name "su")
SHIPPED = {
    "Qwen2.5-7B-Instruct, yarn as its README says": dict(
        model_type="qwen2", hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, rope_theta=1e6,
        max_position_embeddings=32768, rope_scaling={"factor": 4.0, "original_max_position_embeddings": 32768,
                                                     "type": "yarn"}),
    "Phi-3-mini-128k-instruct": dict(
        model_type="phi3", hidden_size=3072, num_attention_heads=32, rope_theta=10000.0,
        max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_scaling={"type": "su", "long_factor": PHI3_LONG, "short_factor": PHI3_SHORT}),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_config_json_spellings(name):
    raw = dict(SHIPPED[name], vocab_size=256, intermediate_size=64, num_hidden_layers=1, bos_token_id=1,
               eos_token_id=2, pad_token_id=0)
    hf = transformers.AutoConfig.for_model(**raw)
    ours = ModelConfig.from_hf(raw)
    kind = hf.rope_parameters["rope_type"]
    assert ours.rope_scaling["rope_type"] == kind
    for context in (4096, 8192):
        want, want_factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu", seq_len=context)
        torch.testing.assert_close(rope_inv_freq(ours, context=context), want.float(), rtol=1e-6, atol=0)
        assert rope_attention_factor(ours) == pytest.approx(want_factor, rel=1e-6)


def _prompt(n: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist()


TINY = {  # name -> (family, overrides of its tiny config)
    "qwen2-yarn": ("qwen2", dict(max_position_embeddings=128, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen3-yarn": ("qwen3", dict(max_position_embeddings=128, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25})),
    "phi3-longrope": ("phi3", dict(max_position_embeddings=128, sliding_window=None,
                                   original_max_position_embeddings=32, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 32, "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0],
        "short_factor": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5]})),
}


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request, tmp_path_factory):
    """(name, transformers model, its directory, its GGUF file)."""
    family, overrides = TINY[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random(transformers, tiny_config(transformers, family, **overrides), path)
    write_gguf(hf, path / "model.gguf")
    return request.param, hf, path, path / "model.gguf"


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_logits_equal_transformers(tiny, source):
    from dtorch import LLM

    name, hf, path, gguf_path = tiny
    # LongRoPE: a context within the original 32 positions runs the short factors, a longer one the long factors;
    # transformers picks them by the sequence's length
    runs = [(32, 30), (128, 100)] if name.startswith("phi3") else [(None, 100)]
    for max_len, n in runs:
        llm = LLM(str(gguf_path if source == "gguf" else path), max_num_seqs=1, max_model_len=max_len)
        try:
            assert llm.config.rope_scaling["rope_type"] == hf.config.rope_parameters["rope_type"]
            ids = _prompt(n)
            with torch.no_grad():
                want = hf(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(llm.logits(ids), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        finally:
            llm.close()


def test_the_gguf_carries_the_converters_keys(tiny):
    name, hf, _, gguf_path = tiny
    fields = gguf.GGUFReader(str(gguf_path)).fields
    arch = fields["general.architecture"].contents()
    rope = hf.config.rope_parameters
    assert fields[f"{arch}.rope.scaling.original_context_length"].contents() == 32
    if name.startswith("phi3"):  # LongRoPE: the factor tensors, and the attention factor the converter computes
        assert f"{arch}.rope.scaling.type" not in fields
        assert fields[f"{arch}.rope.scaling.attn_factor"].contents() == pytest.approx(
            math.sqrt(1 + math.log(128 / 32) / math.log(32)))
    else:
        assert fields[f"{arch}.rope.scaling.type"].contents() == "yarn"
        assert fields[f"{arch}.rope.scaling.factor"].contents() == rope["factor"]


def _gguf_config(tmp_path, hf, **keys):
    """The config dtorch reads from ``hf`` written as GGUF with ``keys`` (after ``{arch}.``) added or replaced."""
    from dtorch.models.loaders import open_checkpoint

    arch = "qwen2"
    V = gguf.GGUFValueType
    meta = {f"{arch}.{k}": (v, V.STRING if isinstance(v, str) else V.FLOAT32) for k, v in keys.items()}
    write_gguf(hf, tmp_path / "m.gguf", metadata=meta)
    with open_checkpoint(tmp_path / "m.gguf") as ckpt:
        return ckpt.config


def test_gguf_yarn_keys_as_llama_cpp_reads_them(tmp_path):
    hf = transformers.Qwen2ForCausalLM(tiny_config(transformers, "qwen2", max_position_embeddings=128))
    # no original_context_length: llama.cpp takes the training context; attn_factor multiplies YaRN's own factor;
    # yarn_log_multiplier is mscale_all_dim (mscale 1)
    c = _gguf_config(tmp_path, hf, **{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                      "rope.scaling.attn_factor": 0.5, "rope.scaling.yarn_log_multiplier": 0.5})
    s = c.rope_scaling
    assert (s["rope_type"], s["factor"], s["original_max_position_embeddings"]) == ("yarn", 4.0, 128)
    mscale = (0.1 * math.log(4) + 1) / (0.1 * 0.5 * math.log(4) + 1)
    assert rope_attention_factor(c) == pytest.approx(mscale * 0.5)
    assert _gguf_config(tmp_path, hf, **{"rope.scaling.type": "none", "rope.scaling.factor": 4.0}).rope_scaling is None
    for keys, match in (({"rope.scaling.type": "dynamic"}, r"qwen2.rope.scaling.type is 'dynamic'; expected one of"),
                        ({"rope.scaling.type": "yarn"}, r"is 'yarn' but qwen2.rope.scaling.factor is missing"),
                        ({"rope.scaling.type": "yarn", "rope.scaling.factor": -2.0}, r"'factor'\] must be a positive")):
        with pytest.raises(ModelError, match=match):
            _gguf_config(tmp_path, hf, **keys)


def test_half_a_longrope_pair_is_refused(tmp_path):
    import numpy as np

    hf = transformers.Phi3ForCausalLM(tiny_config(transformers, "phi3"))
    extra = {"rope_factors_long.weight": (np.ones(6, dtype=np.float32), gguf.GGMLQuantizationType.F32)}
    write_gguf(hf, tmp_path / "m.gguf", extra=extra)
    from dtorch.models.loaders import open_checkpoint

    with pytest.raises(ModelError, match="needs both rope_factors_long.weight and rope_factors_short.weight; the file "
                                         "has long"):
        open_checkpoint(tmp_path / "m.gguf")



# config.json RoPE spellings (model_type, keys): transformers 4.x's rope_scaling with "type" beside rope_theta, 5.x's
# rope_parameters, one set per layer kind (Gemma 3), no base at all (the family's default), Phi-3's pre-training
# context beside the set and its first name for LongRoPE, a llama3 set without one (max_position_embeddings stands in)
_LONG = {"short_factor": PHI3_SHORT[:6], "long_factor": PHI3_LONG[:6]}  # 3/4 of 16 dims rotated: 6 frequencies
SPELLINGS = {
    "4.x-linear": ("llama", {"rope_theta": 1234.0, "rope_scaling": {"type": "linear", "factor": 2.0}}),
    "llama3-no-original": ("llama", {"max_position_embeddings": 4096, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}}),
    "5.x-yarn": ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                               "original_max_position_embeddings": 32}}),
    "theta-only": ("qwen2", {"rope_theta": 5e5}),
    "smollm3-default": ("smollm3", {}),
    "gemma3-default": ("gemma3_text", {}),
    "gemma3-4.x": ("gemma3_text", {"rope_theta": 5e5, "rope_local_base_freq": 2e4,
                                   "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    "gemma3-per-kind": ("gemma3_text", {"rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0}, "sliding_attention": {"rope_type": "default"}}}),
    "phi3-original-beside": ("phi3", {"max_position_embeddings": 512, "original_max_position_embeddings": 64,
                                      "partial_rotary_factor": 0.75,
                                      "rope_scaling": {"type": "longrope", **_LONG,
                                                       "original_max_position_embeddings": 128}}),
    "phi3-su": ("phi3", {"max_position_embeddings": 512, "original_max_position_embeddings": 64,
                         "partial_rotary_factor": 0.75, "rope_scaling": {"type": "su", **_LONG}}),
}


@pytest.mark.parametrize("name", SPELLINGS)
def test_rope_keys_read_as_transformers_standardizes_them(name):
    # transformers' config classes standardize every spelling into rope_parameters (standardize_rope_params, with
    # their own default_theta); ModelConfig.from_hf (rope_scaling.rope_from_hf with the family's hf_rope_theta, and
    # the family's hooks) reads the same base, rotated part, scaling and sliding layers' base
    model_type, keys = SPELLINGS[name]
    raw = dict(model_type=model_type, vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2) | keys
    want = transformers.AutoConfig.for_model(**raw).rope_parameters
    c = ModelConfig.from_hf(raw)
    full = want.get("full_attention", want)
    assert (c.rope_theta, c.partial_rotary_factor) == (full["rope_theta"], full.get("partial_rotary_factor", 1.0))
    scaling = {k: tuple(v) if isinstance(v, list) else v for k, v in full.items()
               if k not in ("rope_theta", "type", "partial_rotary_factor")}
    assert (None if c.rope_scaling is None else dict(c.rope_scaling)) == \
        (None if full["rope_type"] == "default" else scaling)
    if "sliding_attention" in want:
        assert c.rope_local_theta == want["sliding_attention"]["rope_theta"]
