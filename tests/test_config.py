"""ModelConfig: from_hf against transformers' configs, RoPE frequencies against transformers, bad values."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dtorch import ModelError
from dtorch.models import PRESETS, ModelConfig, rope_inv_freq

_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)
_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_SMALL, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5),
    "llama3": lambda: transformers.LlamaConfig(**_SMALL, rope_parameters=dict(_LLAMA3), tie_word_embeddings=True,
                                               bos_token_id=1, eos_token_id=[2, 3]),
    "qwen2": lambda: transformers.Qwen2Config(**_SMALL, tie_word_embeddings=True, eos_token_id=5),
    "qwen3": lambda: transformers.Qwen3Config(**_SMALL, head_dim=32, eos_token_id=5),
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_from_hf_matches_transformers(name):
    hf = HF_CONFIGS[name]()
    c = ModelConfig.from_hf(hf.to_dict())
    assert c.family == hf.model_type
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (hf.vocab_size, hf.hidden_size,
                                                                   hf.intermediate_size)
    assert (c.num_layers, c.num_heads, c.num_kv_heads) == (hf.num_hidden_layers, hf.num_attention_heads,
                                                            hf.num_key_value_heads)
    assert c.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert c.rope_theta == hf.rope_parameters["rope_theta"]
    assert c.rms_norm_eps == hf.rms_norm_eps
    assert c.max_position_embeddings == hf.max_position_embeddings
    assert c.tie_word_embeddings == hf.tie_word_embeddings
    eos = hf.eos_token_id
    assert c.eos_token_ids == (tuple(eos) if isinstance(eos, list) else (eos,))
    assert c.bos_token_id == hf.bos_token_id
    assert c.attention_bias == (name == "qwen2")
    assert c.qk_norm == (name == "qwen3")
    assert (c.rope_scaling is not None) == (name == "llama3")


def test_from_hf_old_spelling():
    """transformers 4.x wrote rope_theta and rope_scaling (with "type") at the top level."""
    old = {"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 1234.0,
           "rope_scaling": {"type": "linear", "factor": 2.0}}
    c = ModelConfig.from_hf(old)
    assert c.rope_theta == 1234.0 and c.num_kv_heads == 2 and c.head_dim == 16
    assert dict(c.rope_scaling) == {"rope_type": "linear", "factor": 2.0}


def _hf_inv_freq(hf) -> torch.Tensor:
    kind = hf.rope_parameters.get("rope_type", "default")
    if kind == "default":
        return transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(hf)[0]
    return ROPE_INIT_FUNCTIONS[kind](hf, "cpu")[0]


@pytest.mark.parametrize("rope", [None, _LLAMA3, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
                                  {**_LLAMA3, "original_max_position_embeddings": 8192, "factor": 32.0}])
def test_rope_inv_freq_matches_transformers(rope):
    hf = transformers.LlamaConfig(**_SMALL, rope_parameters=dict(rope) if rope else None)
    hf.head_dim = 64  # enough frequencies to cross llama3's low/high bands
    ours = rope_inv_freq(ModelConfig.from_hf(hf.to_dict()))
    ref = _hf_inv_freq(hf)
    assert ours.dtype == torch.float32 and ours.shape == (32,)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)


def test_presets_are_valid_and_overridable():
    for name, c in PRESETS.items():
        assert c.num_heads % c.num_kv_heads == 0, name
        assert rope_inv_freq(c).shape == (c.head_dim // 2,)
    c = ModelConfig.preset("tiny-llama", num_layers=3)
    assert c.num_layers == 3 and PRESETS["tiny-llama"].num_layers == 2
    with pytest.raises(ModelError, match="unknown preset 'nope'"):
        ModelConfig.preset("nope")


def test_config_is_frozen():
    c = PRESETS["tiny-llama3"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_layers = 5
    with pytest.raises(TypeError):
        c.rope_scaling["factor"] = 2.0


BAD = [
    (dict(family="gpt2"), "family must be one of"),
    (dict(num_layers=0), r"num_layers must be an int in \[1, 4096\], got 0"),
    (dict(hidden_size=64.0), r"hidden_size must be an int in \[1, 65536\], got 64.0"),
    (dict(num_kv_heads=3), "must be a multiple of num_kv_heads"),
    (dict(head_dim=15), "head_dim must be even"),
    (dict(rope_theta=-1.0), "rope_theta must be a positive finite number"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a positive finite number"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "type 'dynamic' is not supported"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), r"missing \['original_max_position_embeddings'\]"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                        "beta_fast": -1}), r"rope_scaling\['beta_fast'\] must be a positive number"),
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7,
                        "original_max_position_embeddings": 64}), r"rope_scaling\['long_factor'\] must be 8 positive"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "missing"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0}), "must be a positive number"),
    (dict(rope_scaling={"rope_type": "factors", "factors": (1.0,) * 7}), r"must be 8 positive numbers"),
    (dict(rope_scaling={"rope_type": "factors", "factors": (1.0,) * 7 + (-1.0,)}), r"must be 8 positive numbers"),
    (dict(eos_token_ids=(256,)), "token ids must be ints in"),
    (dict(bos_token_id=-1), "bos_token_id must be an int >= 0"),
    (dict(qk_norm="yes"), "qk_norm must be true or false"),
    (dict(norm_placement="middle"), "norm_placement must be one of"),
    (dict(logits_softcap=0.0), "logits_softcap must be a positive finite number"),
    (dict(nope_layers=(2,)), r"nope_layers must be layer indices in \[0, num_layers=2\)"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m for _, m in BAD])
def test_bad_values_raise_model_error(change, message):
    with pytest.raises(ModelError, match=message):
        dataclasses.replace(PRESETS["tiny-llama"], **change)


def test_from_hf_bad_input():
    with pytest.raises(ModelError, match="model_type 'gpt2' is not supported"):
        ModelConfig.from_hf({"model_type": "gpt2"})
    with pytest.raises(ModelError, match="mlp_bias=true is not supported for llama"):
        ModelConfig.from_hf(transformers.LlamaConfig(**_SMALL, mlp_bias=True).to_dict())
    with pytest.raises(ModelError, match="missing key 'intermediate_size'"):
        ModelConfig.from_hf({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
                             "num_attention_heads": 2})


def test_declared_gguf_keys_are_gguf_py_keys():
    # every GGUF key a field's spec or a family declares is one gguf-py names (gguf.Keys: what llama.cpp's converter
    # writes), so a typo in a declaration cannot make a key silently unread
    gguf = pytest.importorskip("gguf")
    from dtorch.models import families
    from dtorch.models.config_fields import check_field, known, specs

    names = {v for group in vars(gguf.Keys).values() if isinstance(group, type) for v in vars(group).values()
             if isinstance(v, str)}
    declared = {s.gguf for s in specs().values() if s.gguf is not None}
    declared |= {"{arch}." + key for name in families.names() for key in families.get(name).gguf_keys.values()}
    assert declared and sorted(declared - names) == []
    assert {f.name for f in dataclasses.fields(ModelConfig) if "spec" in f.metadata} <= known()
    with pytest.raises(ModelError, match="no field 'num_layer'"):  # a name no spec declares
        check_field("num_layer", 2, "test")
