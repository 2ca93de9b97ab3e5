"""Gemma 2 against transformers' Gemma2ForCausalLM: attention scores and final logits soft-capped (caps small enough
to bite), sandwich (1 + w) norms, sliding and full layers alternating under prompts longer than the window."""

from __future__ import annotations

import pytest

from tests.family_check import SOURCES, checkpoint, runs_as_transformers

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma2")
    return path, *checkpoint(transformers, "gemma2", path)


@pytest.mark.parametrize("source", SOURCES)
def test_gemma2_runs_as_transformers(model, source):
    path, hf, want = model
    llm = runs_as_transformers(hf, want, path, source)
    c = llm.config
    assert (c.attn_softcap, c.logits_softcap) == (1.0, 2.0) and [c.window(i) for i in range(2)] == [8, None]
