"""Sampling: seeded draws are reproducible, filters never let a token outside their set through, bad values raise."""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch.models.sampling import SamplingParams, filter_logits, sample


def _draw(logits: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    g = params.generator()
    return [sample(logits[None], [params], [g])[0] for _ in range(n)]


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    assert sample(logits, [SamplingParams(temperature=0.0)] * 4, [None] * 4) == logits.argmax(-1).tolist()


def test_seed_reproducible_and_seeds_differ():
    logits = torch.randn(200)
    a = _draw(logits, SamplingParams(temperature=1.0, seed=7), 40)
    b = _draw(logits, SamplingParams(temperature=1.0, seed=7), 40)
    c = _draw(logits, SamplingParams(temperature=1.0, seed=8), 40)
    assert a == b
    assert a != c


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_stays_in_the_k_most_likely(k):
    logits = torch.randn(100)
    allowed = set(torch.topk(logits, k).indices.tolist())
    drawn = _draw(logits, SamplingParams(temperature=5.0, top_k=k, seed=1), 300)
    assert set(drawn) <= allowed
    if k > 1:
        assert len(set(drawn)) > 1  # a hot temperature over several allowed tokens does vary


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_top_p_stays_in_the_nucleus(p):
    logits = torch.randn(60) * 2
    probs = torch.softmax(logits, -1)
    order = torch.argsort(probs, descending=True)
    cum = torch.cumsum(probs[order], 0)
    n = int((cum < p).sum()) + 1  # the smallest prefix whose mass reaches p
    nucleus = set(order[:n].tolist())
    drawn = _draw(logits, SamplingParams(temperature=1.0, top_p=p, seed=2), 300)
    assert set(drawn) <= nucleus


def test_min_p_drops_unlikely_tokens():
    logits = torch.randn(80) * 3
    probs = torch.softmax(logits, -1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    drawn = _draw(logits, SamplingParams(temperature=1.0, min_p=0.2, seed=3), 300)
    assert set(drawn) <= allowed


def test_filters_keep_temperature_scaling():
    logits = torch.randn(30)
    out = filter_logits(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(out, logits / 0.5)


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2},
    {"top_k": 2.5}, {"min_p": -0.1}, {"min_p": 2.0}, {"max_tokens": 0}, {"seed": "x"}, {"stop": [""]},
    {"stop": 3}, {"ignore_eos": "yes"}, {"stop_token_ids": ["a"]},
])
def test_bad_values_raise_sampling_error(kwargs):
    with pytest.raises(dtorch.SamplingError) as info:
        SamplingParams(**kwargs)
    assert next(iter(kwargs)).split("_")[0] in str(info.value)


def test_stop_string_normalized_to_tuple():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
