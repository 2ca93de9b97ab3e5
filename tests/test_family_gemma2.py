"""Gemma 2 against transformers' Gemma2ForCausalLM: attention scores and final logits soft-capped (caps small enough
to bite), sandwich (1 + w) norms, sliding and full layers alternating under prompts longer than the window."""

from tests.family_check import family_test


def _caps(config, hf) -> None:
    assert (config.attn_softcap, config.logits_softcap) == (1.0, 2.0)
    assert [config.window(i) for i in range(2)] == [8, None]


test_gemma2_runs_as_transformers = family_test("gemma2", _caps)
