"""OLMo 2 against transformers' Olmo2ForCausalLM: norms after each block only, q/k norms over all heads (on two
devices each holds half the heads: the norm must still span them all)."""

from __future__ import annotations

import pytest

from tests.family_check import SOURCES, checkpoint, runs_as_transformers

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("olmo2")
    return path, *checkpoint(transformers, "olmo2", path)


@pytest.mark.parametrize("source", SOURCES)
def test_olmo2_runs_as_transformers(model, source):
    path, hf, want = model
    llm = runs_as_transformers(hf, want, path, source)
    assert llm.config.norm_placement == "post" and llm.config.qk_norm_over == "all"
