"""SmolLM3 against transformers' SmolLM3ForCausalLM: four layers, the fourth without RoPE (transformers' default
``no_rope_layers``, the layer llama.cpp's loader takes as NoPE too)."""

from tests.family_check import family_test


def _nope(config, hf) -> None:
    assert hf.config.no_rope_layers == [1, 1, 1, 0] and config.nope_layers == (3,)


test_smollm3_runs_as_transformers = family_test("smollm3", _nope)
