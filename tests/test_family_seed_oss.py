"""Seed-OSS against transformers' SeedOssForCausalLM: q/k/v biases."""

from tests.family_check import family_test


def _biases(config, hf) -> None:
    assert config.attention_bias


test_seed_oss_runs_as_transformers = family_test("seed_oss", _biases, tokenizer="gpt2")
