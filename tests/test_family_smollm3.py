"""SmolLM3 against transformers' SmolLM3ForCausalLM: four layers, the fourth without RoPE (transformers' default
``no_rope_layers``, the layer llama.cpp's loader takes as NoPE too)."""

from __future__ import annotations

import pytest

from tests.family_check import SOURCES, checkpoint, runs_as_transformers

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("smollm3")
    return path, *checkpoint(transformers, "smollm3", path)


@pytest.mark.parametrize("source", SOURCES)
def test_smollm3_runs_as_transformers(model, source):
    path, hf, want = model
    assert hf.config.no_rope_layers == [1, 1, 1, 0]
    llm = runs_as_transformers(hf, want, path, source)
    assert llm.config.nope_layers == (3,)
