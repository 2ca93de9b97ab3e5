"""Granite 3.x against transformers' GraniteForCausalLM: its four multipliers read from config.json and from the GGUF
keys llama.cpp's converter writes (``embedding_scale``, ``residual_scale``, ``attention.scale``, ``logit_scale``)."""

import pytest

from tests.family_check import family_test

NAMES = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def _multipliers(config, hf) -> None:  # the tiny model's, far from 1: one missed or misplaced moves every logit
    assert [getattr(config, k) for k in NAMES] == pytest.approx([getattr(hf.config, k) for k in NAMES])  # GGUF: f32
    assert all(abs(getattr(hf.config, k) - 1) > 0.5 for k in NAMES)


test_granite_runs_as_transformers = family_test("granite", _multipliers)
