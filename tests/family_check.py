"""The check every family's own test runs (``tests/test_family_<name>.py``): a tiny random transformers model of the
family (its ``Family.tiny``), saved by ``save_pretrained`` and written as llama.cpp's converter writes it
(``tiny.write_gguf``), loaded from its directory, from its GGUF file and on two devices; its logits and greedy ids
must be transformers' own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dtorch.engine.llm import LLM
from dtorch.engine.sampling import SamplingParams
from dtorch.models.config import ModelConfig
from dtorch.models.tiny import hf_greedy, save_random, tiny_config, write_gguf

SOURCES = ("hf", "gguf", "hf_tp2")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
_MODELS: dict[str, tuple[Path, Any, list[list[int]]]] = {}  # family -> (its directory, the transformers model, ids)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt(19, 1), prompt(7, 2)]  # longer and shorter than the tiny models' sliding windows


def family_test(family: str, check: Callable[[ModelConfig, Any], None] = lambda config, hf: None):
    """The test of ``family``, one case per source ("hf", "gguf", "hf_tp2"): the logits of a prompt and the batched
    greedy ids of ``PROMPTS`` against transformers'; then ``check(config, transformers model)`` on what was loaded.
    Bind it to a ``test_*`` name in the family's test module."""
    @pytest.mark.parametrize("source", SOURCES)
    def test(source: str, tmp_path_factory) -> None:
        transformers = pytest.importorskip("transformers")
        pytest.importorskip("gguf")
        if family not in _MODELS:  # written once per session, for the three sources
            path = tmp_path_factory.mktemp(family)
            hf = save_random(transformers, tiny_config(transformers, family), path)
            write_gguf(hf, path / "model.gguf")
            _MODELS[family] = path, hf, [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
        path, hf, want = _MODELS[family]
        llm = LLM(str(path / "model.gguf" if source == "gguf" else path), max_num_seqs=2,
                  tensor_parallel_size=2 if source == "hf_tp2" else 1)
        try:
            with torch.no_grad():
                want_logits = hf(torch.tensor([PROMPTS[0]])).logits[0]
            torch.testing.assert_close(llm.logits(PROMPTS[0]), want_logits, rtol=1e-4,
                                       atol=1e-4 * float(want_logits.abs().max()))
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
            check(llm.config, hf)
        finally:
            llm.close()

    return test
