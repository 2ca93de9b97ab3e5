"""Issue #43 (hardening, round 3): a request's bad numbers are its own 400 and a failure while sampling ends only
its own request; the kernel registry checks its ABI at the call; the server's own paths and exception text never
reach clients; the inputs that answered 500 are 400s naming the field."""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch.engine.llm import LLM
from dtorch.engine.sampling import SamplingParams, sample_step
from tests.test_engine import FAMILIES, greedy, rand_ids
from tests.tiny_models import hf_greedy, save_random

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, checkpoint directory) of a tiny random Qwen3."""
    path = tmp_path_factory.mktemp("qwen3")
    return save_random(transformers, FAMILIES["qwen3"](), path), str(path)


# --- item 2: bad sampling numbers -----------------------------------------------------------------------------------

@pytest.mark.parametrize("penalty", [1e-300, 1e-40, 1e-5, 1e5, 1e300])
def test_repetition_penalties_past_float32_are_refused(penalty):
    with pytest.raises(dtorch.SamplingError, match="repetition_penalty must be in"):
        SamplingParams(repetition_penalty=penalty)


def test_a_top_p_under_float32s_range_keeps_the_most_likely_token():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) * 5
    for top_p in (1e-300, 1e-45):
        p = SamplingParams(temperature=1.0, top_p=top_p, seed=0)
        tokens, _ = sample_step(logits, [p] * 2, [p.generator()] * 2, [()] * 2, [()] * 2)
        assert tokens == logits.argmax(-1).tolist()  # the top-p set of a tiny p is the argmax alone


def test_a_row_whose_sampling_fails_ends_alone(tiny):
    hf, path = tiny
    llm = LLM(path)
    try:
        e, good, bad = llm.engine, [], []
        poisoned = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=1)
        object.__setattr__(poisoned, "repetition_penalty", 1e-300)  # past the checks: the sampler meets NaN
        prompt = rand_ids(8, 12)
        e.add_request("bad", rand_ids(8, 13), poisoned, bad.append)
        e.add_request("good", prompt, greedy(12), lambda d: good.extend(d.token_ids))
        e.run_until(lambda: not e.has_unfinished(), timeout=60)
        assert good == hf_greedy(hf, prompt, 12)  # the batch went on without it
        assert bad[-1].finish_reason == "abort" and not any(d.token_ids for d in bad)
        assert e.stats().kv_blocks_used == 0
        again = []  # and the engine is whole afterwards
        e.add_request("again", prompt, greedy(12), lambda d: again.extend(d.token_ids))
        e.run_until(lambda: not e.has_unfinished(), timeout=60)
        assert again == good
    finally:
        llm.close()

