"""The check every family's own test runs (``tests/test_family_<name>.py``): a tiny random transformers model of the
family, saved by ``save_pretrained`` and written as llama.cpp's converter writes it (``tiny.write_gguf``), loaded
from its directory, from its GGUF file and on two devices; its logits and greedy ids must be transformers' own."""

from __future__ import annotations

from pathlib import Path

import torch

from dtorch.engine.llm import LLM
from dtorch.engine.sampling import SamplingParams
from dtorch.models.tiny import hf_greedy, save_random, tiny_config, write_gguf

SOURCES = ("hf", "gguf", "hf_tp2")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt(19, 1), prompt(7, 2)]


def checkpoint(transformers, family: str, path: Path):
    """(transformers model, greedy ids of ``PROMPTS``): the tiny random model of ``family`` (its ``Family.tiny``,
    vocabulary 128) saved in ``path`` with its GGUF file ``path / "model.gguf"``."""
    hf = save_random(transformers, tiny_config(transformers, family), path)
    write_gguf(hf, path / "model.gguf")
    return hf, [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]


def runs_as_transformers(hf, want: list[list[int]], path: Path, source: str) -> LLM:
    """Load ``path`` (``source``: "hf", "gguf" or "hf_tp2") and check the logits of a prompt and the greedy ids of
    ``PROMPTS`` (batched) against transformers' ``hf`` / ``want``; returns the LLM (closed)."""
    llm = LLM(str(path / "model.gguf" if source == "gguf" else path), max_num_seqs=2,
              tensor_parallel_size=2 if source == "hf_tp2" else 1)
    try:
        ids = PROMPTS[0]
        with torch.no_grad():
            want_logits = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(llm.logits(ids), want_logits, rtol=1e-4, atol=1e-4 * float(want_logits.abs().max()))
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    finally:
        llm.close()
    return llm
