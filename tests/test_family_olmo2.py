"""OLMo 2 against transformers' Olmo2ForCausalLM: norms after each block only, q/k norms over all heads (on two
devices each holds half the heads: the norm must still span them all)."""

import pytest

from tests.family_check import family_test


def _post_norms(config, hf) -> None:
    assert config.norm_placement == "post" and config.qk_norm_over == "all"


# its converter reads a BPE tokenizer only; on two devices each holds half the heads the q/k norms span
test_olmo2_runs_as_transformers = family_test("olmo2", _post_norms, tokenizer="gpt2", converted_tp2=True)


def test_olmo2_gguf_with_a_sliding_window_is_refused(tmp_path):
    # OLMo 3 converts as olmo2; llama.cpp's src/models/olmo2.cpp then slides layers (attention.sliding_window > 0)
    import dtorch
    from dtorch.models.loaders.gguf import config_from_gguf

    base = {"vocab_size": 256, "embedding_length": 64, "feed_forward_length": 128, "block_count": 2,
            "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-6}
    meta = {"general.architecture": "olmo2", **{f"olmo2.{k}": v for k, v in base.items()}}
    assert config_from_gguf(meta | {"olmo2.attention.sliding_window": 0}, set(), tmp_path / "m.gguf").kv_window is None
    with pytest.raises(dtorch.ModelError, match="olmo2.attention.sliding_window=4096"):
        config_from_gguf(meta | {"olmo2.attention.sliding_window": 4096}, set(), tmp_path / "m.gguf")
