"""OLMo 2 against transformers' Olmo2ForCausalLM: norms after each block only, q/k norms over all heads (on two
devices each holds half the heads: the norm must still span them all)."""

from tests.family_check import family_test


def _post_norms(config, hf) -> None:
    assert config.norm_placement == "post" and config.qk_norm_over == "all"


test_olmo2_runs_as_transformers = family_test("olmo2", _post_norms)
