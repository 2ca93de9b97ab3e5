"""Granite 3.x against transformers' GraniteForCausalLM: its four multipliers read from config.json and from the GGUF
keys llama.cpp's converter writes (``embedding_scale``, ``residual_scale``, ``attention.scale``, ``logit_scale``)."""

import pytest

from tests.family_check import family_test

NAMES = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def _multipliers(config, hf) -> None:  # the tiny model's, far from 1: one missed or misplaced moves every logit
    assert [getattr(config, k) for k in NAMES] == pytest.approx([getattr(hf.config, k) for k in NAMES])  # GGUF: f32
    assert all(abs(getattr(hf.config, k) - 1) > 0.5 for k in NAMES)


test_granite_runs_as_transformers = family_test("granite", _multipliers)


def _meta(**keys):  # a granite file's metadata (llama.cpp's key names), the scales given by ``keys``
    base = {"vocab_size": 256, "embedding_length": 64, "feed_forward_length": 128, "block_count": 2,
            "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-5}
    return {"general.architecture": "granite", **{f"granite.{k}": v for k, v in (base | keys).items()}}


def test_granite_gguf_scales_as_llama_cpp_reads_them(tmp_path):
    # llama.cpp's src/models/granite.cpp requires logit_scale alone: an absent embedding_scale / residual_scale scales
    # nothing, an absent attention.scale is 1 / sqrt(head_dim); the converter writes each only where config.json has it
    import dtorch
    from dtorch.models.loaders.gguf import config_from_gguf

    config = config_from_gguf(_meta(logit_scale=2.5), {"output.weight"}, tmp_path / "m.gguf")
    assert (config.embedding_multiplier, config.residual_multiplier, config.attention_multiplier) == (None,) * 3
    assert (config.attn_scale, config.logits_scaling) == (16 ** -0.5, 2.5)
    with pytest.raises(dtorch.ModelError, match="granite.logit_scale"):
        config_from_gguf(_meta(), {"output.weight"}, tmp_path / "m.gguf")
    with pytest.raises(dtorch.ModelError, match="granite.rope.scaling.finetuned"):  # llama.cpp: no RoPE at all
        config_from_gguf(_meta(logit_scale=2.5, **{"rope.scaling.finetuned": False}), {"output.weight"},
                         tmp_path / "m.gguf")
