"""Gemma 2 against transformers' Gemma2ForCausalLM: attention scores and final logits soft-capped (caps small enough
to bite), sandwich (1 + w) norms, sliding and full layers alternating under prompts longer than the window."""

import pytest

from tests.family_check import family_test


def _caps(config, hf) -> None:
    assert (config.attn_softcap, config.logits_softcap) == (1.0, 2.0)
    assert [config.window(i) for i in range(2)] == [8, None]


test_gemma2_runs_as_transformers = family_test("gemma2", _caps)


def _meta(**keys):  # a gemma2 file's metadata (llama.cpp's key names): 4 layers, head_dim 16
    base = {"vocab_size": 256, "embedding_length": 64, "feed_forward_length": 128, "block_count": 4,
            "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-6,
            "rope.freq_base": 10000.0}
    return {"general.architecture": "gemma2", **{f"gemma2.{k}": v for k, v in (base | keys).items()}}


def test_gemma2_gguf_layers_as_llama_cpp_reads_them(tmp_path):
    # llama.cpp's src/models/gemma2.cpp: a window of 4096 when the key is absent, set_swa_pattern(2) (layer i slides
    # when i % n < n - 1) unless attention.sliding_window_pattern says otherwise, the sliding layers' own RoPE base
    # from rope.freq_base_swa, caps 50 and 30 (src/llama-hparams.h) when absent
    import dtorch
    from dtorch.models.loaders.gguf import config_from_gguf

    path = tmp_path / "m.gguf"
    c = config_from_gguf(_meta(), set(), path)
    assert [c.window(i) for i in range(4)] == [4096, None, 4096, None]
    assert (c.attn_softcap, c.logits_softcap, c.rope_local_theta) == (50.0, 30.0, None)
    c = config_from_gguf(_meta(**{"attention.sliding_window": 8, "attention.sliding_window_pattern": 3,
                                  "rope.freq_base_swa": 500.0}), set(), path)
    assert [c.window(i) for i in range(4)] == [8, 8, None, 8]
    assert c.rope_local_theta == 500.0
    c = config_from_gguf(_meta(**{"attention.sliding_window_pattern": [False, True, True, False]}), set(), path)
    assert [c.window(i) for i in range(4)] == [None, 4096, 4096, None]
    with pytest.raises(dtorch.ModelError, match="gemma2.attention.sliding_window_pattern"):
        config_from_gguf(_meta(**{"attention.sliding_window_pattern": [True]}), set(), path)


def test_gemma2_config_json_without_caps_gets_transformers_defaults():
    """A config.json that omits the caps (and the window, the query scalar) runs as transformers' Gemma2Config
    defaults them."""
    transformers = pytest.importorskip("transformers")
    from dtorch.models.config import ModelConfig

    want = transformers.Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    raw = want.to_dict()
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "query_pre_attn_scalar"):
        raw.pop(key)
    c = ModelConfig.from_hf(raw)
    assert (c.attn_softcap, c.logits_softcap) == (want.attn_logit_softcapping, want.final_logit_softcapping)
    assert (c.sliding_window, c.attn_scale) == (want.sliding_window, want.query_pre_attn_scalar ** -0.5)
