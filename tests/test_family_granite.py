"""Granite 3.x against transformers' GraniteForCausalLM: its four multipliers read from config.json and from the GGUF
keys llama.cpp's converter writes (``embedding_scale``, ``residual_scale``, ``attention.scale``, ``logit_scale``)."""

from __future__ import annotations

import pytest

from tests.family_check import SOURCES, checkpoint, runs_as_transformers

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("granite")
    return path, *checkpoint(transformers, "granite", path)


@pytest.mark.parametrize("source", SOURCES)
def test_granite_runs_as_transformers(model, source):
    path, hf, want = model
    llm = runs_as_transformers(hf, want, path, source)
    # the tiny model's, far from 1: a multiplier missed or misplaced moves every logit
    assert [getattr(llm.config, k) for k in MULTIPLIERS] == pytest.approx([getattr(hf.config, k) for k in MULTIPLIERS])
    assert all(abs(getattr(hf.config, k) - 1) > 0.5 for k in MULTIPLIERS)
